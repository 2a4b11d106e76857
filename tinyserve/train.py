"""Train the shipped models on the Harbor ticket corpus, on CPU, in minutes.

``python -m tinyserve train --preset target|draft``. Seeded end to end (corpus, tokenizer,
initialisation, batch order), so the same command on the same machine reproduces the
shipped weights. Documents are packed into one token stream and cut into fixed windows of
``seq_len`` tokens; attention may cross a document boundary, which is harmless because every
document starts with ``<|ticket|>`` and ends with ``<|end|>``.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .checkpoint import model_dir, save_model
from .config import PRESETS, ModelConfig
from .corpus import build_corpus
from .model import TinyLlama
from .provenance import git_commit, machine_info
from .tokenizer import load_tokenizer


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int = 4
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_tokens: int = 65_536
    seed: int = 0
    # bf16 autocast for the forward pass (fp32 master weights and optimizer state): faster
    # per step on CPUs with native bf16 matmuls (AVX512-BF16 or AMX), which the training budget
    # assumes; elsewhere it stays off (bf16_is_fast). train_report.json records the speed.
    bf16_autocast: bool = True


# Step counts chosen so each preset trains in minutes on a 2-core CPU (each model's
# train_report.json records its time, speed and machine). Small batches and many steps: the
# skill that makes replies right (copying the customer's name and the ticket's details from
# the prompt) appears after enough optimizer *updates*.
TRAIN_PRESETS: dict[str, TrainConfig] = {
    "target": TrainConfig(steps=1800),
    "draft": TrainConfig(steps=2000, lr=4e-3),
}


def token_stream(texts: list[str]) -> torch.Tensor:
    """Concatenate tokenized documents into one 1-D LongTensor."""
    tok = load_tokenizer()
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text))
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def eval_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping (N, seq_len + 1) windows from the start of ``stream``: a fixed,
    deterministic validation set."""
    n = min(len(stream) - 1, max_tokens) // seq_len
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


@torch.no_grad()
def evaluate_loss(model: TinyLlama, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) over the windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i: i + batch_size].to(model.device)
        logits = model(batch[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


@torch.no_grad()
def greedy_agreement(target: TinyLlama, draft: TinyLlama, windows: torch.Tensor,
                     batch_size: int = 8) -> float:
    """Fraction of positions where the draft's argmax next token equals the target's.

    This is the per-token acceptance rate greedy speculative decoding will see."""
    target.eval(), draft.eval()
    same, count = 0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i: i + batch_size, :-1]
        a = target(batch.to(target.device)).argmax(-1).cpu()
        b = draft(batch.to(draft.device)).argmax(-1).cpu()
        same += int((a == b).sum())
        count += a.numel()
    return same / count


def bf16_is_fast() -> bool:
    """Whether this CPU has native bf16 matmuls (oneDNN); elsewhere autocast would be slower."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def train(preset: str, *, steps: int | None = None, save: bool = True,
          plot_path: Path | None = None) -> dict[str, Any]:
    """Train one preset from scratch on CPU and (by default) ship the result."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    tcfg = TRAIN_PRESETS[preset]
    if steps is not None:
        tcfg = TrainConfig(**{**asdict(tcfg), "steps": steps})
    torch.manual_seed(tcfg.seed)
    tok = load_tokenizer()
    mcfg = ModelConfig(**{**PRESETS[preset].to_dict(), "vocab_size": tok.vocab_size,
                          "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                          "pad_token_id": tok.pad_id})
    train_texts, val_texts = build_corpus(seed=tcfg.seed)
    train_ids, val_ids = token_stream(train_texts), token_stream(val_texts)
    val_windows = eval_windows(val_ids, tcfg.seq_len, tcfg.eval_tokens)

    model = TinyLlama(mcfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tcfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(tcfg.seed)
    history: dict[str, list[float]] = {"step": [], "loss": [], "val_step": [], "val_loss": []}

    use_bf16 = tcfg.bf16_autocast and bf16_is_fast()
    start = time.perf_counter()
    bar = tqdm(range(tcfg.steps), desc=f"train {preset}", unit="step")
    for step in bar:
        model.train()
        starts = torch.randint(0, len(train_ids) - tcfg.seq_len - 1, (tcfg.batch_size,),
                               generator=gen)
        batch = torch.stack([train_ids[s: s + tcfg.seq_len + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tcfg)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        history["step"].append(step)
        history["loss"].append(loss.item())
        if (step + 1) % tcfg.eval_every == 0 or step + 1 == tcfg.steps:
            history["val_step"].append(step)
            history["val_loss"].append(evaluate_loss(model, val_windows))
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{history['val_loss'][-1]:.3f}")
    seconds = time.perf_counter() - start

    tokens = tcfg.steps * tcfg.batch_size * tcfg.seq_len
    report: dict[str, Any] = {
        "preset": preset, "parameters": model.num_parameters(),
        "flops_per_token": mcfg.flops_per_token(), "train_config": asdict(tcfg),
        "train_tokens_seen": tokens, "corpus_train_tokens": len(train_ids),
        "corpus_val_tokens": len(val_ids), "train_seconds": round(seconds, 1),
        "train_tokens_per_second": round(tokens / seconds),
        "final_train_loss": round(history["loss"][-1], 4),
        "val_loss": round(history["val_loss"][-1], 4),
        "val_tokens": int(val_windows[:, 1:].numel()),
        "bf16_autocast": use_bf16,
        "machine": machine_info(), "git_commit": git_commit(),
    }
    if plot_path is None:  # a trial run (save=False) must not replace the shipped plot
        plot_path = model_dir(preset) / "loss.png" if save else Path("runs") / f"loss_{preset}.png"
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot_loss(history, preset, plot_path)
    if save:
        save_model(model, preset, report)
    return report


def plot_loss(history: dict[str, list[float]], preset: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(history["step"], history["loss"], lw=0.8, alpha=0.6, label="train (per step)")
    ax.plot(history["val_step"], history["val_loss"], "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{preset} model: training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
