"""The figures the README's model card quotes, recomputed from the shipped weights.

``python -m tinyserve model-card`` reloads both models, re-measures validation loss on the
held-out tickets and the draft's greedy agreement with the target, and reads the training
time from each model's training report (a time cannot be recomputed without retraining).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load_model, load_report
from ..corpus import Ticket, build_corpus, prompt_for, split_tickets
from ..generate import generate_ids
from ..model import TinyLlama
from ..tokenizer import load_tokenizer
from ..train import TRAIN_PRESETS, eval_windows, evaluate_loss, greedy_agreement, token_stream
from .markers import section, write_section


def greets_by_name(model: TinyLlama, tickets: list[Ticket]) -> float:
    """Fraction of held-out tickets whose greedy reply opens with "Hi <customer>,".

    The name appears only in the ticket header, so this measures whether the model copies a
    detail from its prompt rather than reciting a likely name."""
    tok = load_tokenizer()
    hits = 0
    for ticket in tickets:
        ids = list(generate_ids(model, tok.encode(prompt_for(ticket)), 6))
        hits += tok.decode(ids).startswith(f"Hi {ticket.customer},")
    return hits / len(tickets)


def model_card(n_name_checks: int = 50) -> dict[str, Any]:
    torch.manual_seed(0)
    tcfg = TRAIN_PRESETS["target"]
    _, val_texts = build_corpus(seed=tcfg.seed)
    windows = eval_windows(token_stream(val_texts), tcfg.seq_len, tcfg.eval_tokens)
    models = {name: load_model(name, device="cpu", dtype=torch.float32)
              for name in ("target", "draft")}
    figures: dict[str, Any] = {}
    name_tickets = split_tickets(seed=tcfg.seed)[1][:n_name_checks]
    for name, model in models.items():
        report = load_report(name)
        loss = evaluate_loss(model, windows)
        cfg = model.config
        figures[name] = {
            "parameters": model.num_parameters(),
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "query_heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
            "context_window": cfg.max_position_embeddings,
            "flops_per_token": cfg.flops_per_token(),
            "train_seconds": report.get("train_seconds"),
            "train_threads": report.get("machine", {}).get(
                "torch_threads", report.get("machine", {}).get("cpu_threads")),
            "train_steps": report.get("train_config", {}).get("steps"),
            "train_tokens_seen": report.get("train_tokens_seen"),
            "val_loss": round(loss, 4), "val_perplexity": round(math.exp(loss), 2),
            "greets_customer_by_name": round(greets_by_name(model, name_tickets), 3),
        }
    figures["draft"]["greedy_agreement_with_target"] = round(
        greedy_agreement(models["target"], models["draft"], windows), 4)
    figures["flops_ratio_target_over_draft"] = round(
        figures["target"]["flops_per_token"] / figures["draft"]["flops_per_token"], 2)
    figures["val_tokens"] = int(windows[:, 1:].numel())

    t, d = figures["target"], figures["draft"]
    rows = [
        ("parameters", f"{t['parameters']:,}", f"{d['parameters']:,}"),
        ("layers / hidden / query heads / KV heads",
         f"{t['layers']} / {t['hidden_size']} / {t['query_heads']} / {t['kv_heads']}",
         f"{d['layers']} / {d['hidden_size']} / {d['query_heads']} / {d['kv_heads']}"),
        ("context window (tokens)", str(t["context_window"]), str(d["context_window"])),
        ("forward FLOPs per token", f"{t['flops_per_token']:,}", f"{d['flops_per_token']:,}"),
        ("training: steps, wall time, CPU threads",
         f"{t['train_steps']}, {t['train_seconds']} s, {t['train_threads']}",
         f"{d['train_steps']}, {d['train_seconds']} s, {d['train_threads']}"),
        ("training tokens seen", f"{t['train_tokens_seen']:,}" if t["train_tokens_seen"] else "?",
         f"{d['train_tokens_seen']:,}" if d["train_tokens_seen"] else "?"),
        ("validation loss (nats/token)", f"{t['val_loss']:.3f}", f"{d['val_loss']:.3f}"),
        ("validation perplexity", f"{t['val_perplexity']:.2f}", f"{d['val_perplexity']:.2f}"),
        (f"reply greets the customer by name ({n_name_checks} held-out tickets)",
         f"{t['greets_customer_by_name']:.0%}", f"{d['greets_customer_by_name']:.0%}"),
        ("greedy next-token agreement with target", "-",
         f"{d['greedy_agreement_with_target']:.1%}"),
    ]
    lines = ["| | target | draft |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines.append(f"\nValidation: {figures['val_tokens']:,} held-out tokens; the draft costs "
                 f"{figures['flops_ratio_target_over_draft']}x fewer FLOPs per token.")
    return {"figures": figures, "markdown": "\n".join(lines)}


def card_in_readme(readme: Path) -> str:
    """The model card currently written between the model-card markers of ``readme``."""
    return section(readme, "model-card")


def update_readme(readme: Path, markdown: str) -> None:
    write_section(readme, "model-card", markdown)
