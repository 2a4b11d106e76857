"""Export a shipped model as a Hugging Face Llama checkpoint folder.

The folder loads with ``LlamaForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` offline, and so in any Llama-compatible server; the
tokenizer carries our server's chat template (``apply_chat_template`` gives our prompt ids).
Written without importing ``transformers``: it is only a test oracle here, not a runtime
dependency. Our parameter names already are Hugging Face's, so the weights are a plain copy.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import load_model
from .config import ModelConfig
from .model import TinyLlama
from .serving.api_schema import CHAT_TEMPLATE
from .tokenizer import TinyTokenizer, load_tokenizer


def hf_config(cfg: ModelConfig) -> dict:
    """Our config in ``LlamaConfig`` terms (the field names already match)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def export_hf(out_dir: Path | str, model_name: str = "target") -> Path:
    """Export a shipped model with the shipped tokenizer."""
    return write_hf_checkpoint(load_model(model_name, device="cpu", dtype=torch.float32),
                               load_tokenizer(), out_dir)


def write_hf_checkpoint(model: TinyLlama, tok: TinyTokenizer, out_dir: Path | str) -> Path:
    """Write config.json, model.safetensors, generation_config.json and tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # transformers re-ties it from the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(model.config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"]}, indent=2) + "\n")

    tok.backend.save(str(out / "tokenizer.json"))
    specials = {"bos_token": tok.backend.id_to_token(tok.bos_id),
                "eos_token": tok.backend.id_to_token(tok.eos_id),
                "pad_token": tok.backend.id_to_token(tok.pad_id)}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, **specials,
        # Our server's chat template, so transformers (and any server reading this folder)
        # turns messages into the same prompt ids as ours.
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return out
