"""Model configuration, with Hugging Face ``LlamaConfig`` field names.

Using the same names means ``export-hf`` writes our config almost verbatim, and a reader who
moves on to real models finds the same knobs.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 5
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def flops_per_token(self, context: int = 0) -> int:
        """Forward FLOPs for one token: 2 x (matmul weights, LM head included) plus the
        attention scores and weighted sum against ``context`` cached positions."""
        h, L = self.hidden_size, self.num_hidden_layers
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * self.intermediate_size
        matmul = L * per_layer + h * self.vocab_size
        attention = L * 2 * 2 * context * h
        return 2 * matmul + attention


# The two shipped models share the tokenizer. The draft costs ~10x fewer FLOPs per token,
# so it can propose tokens for the target to verify (speculative decoding, chapter 8).
PRESETS: dict[str, ModelConfig] = {
    "target": ModelConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                          num_attention_heads=8, num_key_value_heads=2),
    "draft": ModelConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1),
}


def parameter_count(cfg: ModelConfig) -> int:
    """Weights of a Llama-shaped model from its config alone (no tensors allocated): how the
    course sizes a model it does not have, such as an 8B one."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h  # + 2 norms
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_hidden_layers * per_layer + embeddings + h                   # + final norm
