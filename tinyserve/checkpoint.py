"""Shipped weights: safetensors + config.json per model, and a sha256 manifest over all assets.

Layout (inside the package, so an installed course finds them too)::

    tinyserve/assets/tokenizer.json
    tinyserve/assets/models/<name>/model.safetensors   # our parameter names, fp32
    tinyserve/assets/models/<name>/config.json          # ModelConfig (HF LlamaConfig names)
    tinyserve/assets/models/<name>/train_report.json    # how it was trained, what it scored
    tinyserve/assets/MANIFEST.sha256                    # `sha256sum -c` compatible
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .device import resolve
from .model import TinyLlama
from .paths import ASSETS, MODEL_NAMES

MODELS_DIR = ASSETS / "models"
MANIFEST = ASSETS / "MANIFEST.sha256"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_dir(name: str) -> Path:
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    return MODELS_DIR / name


def write_manifest() -> Path:
    """Hash every shipped asset (except the manifest itself) into MANIFEST.sha256."""
    lines = []
    for path in sorted(p for p in ASSETS.rglob("*") if p.is_file() and p != MANIFEST):
        if path.suffix in {".png"}:  # plots are documentation, not inputs
            continue
        lines.append(f"{sha256_of(path)}  {path.relative_to(ASSETS).as_posix()}")
    MANIFEST.write_text("\n".join(lines) + "\n")
    return MANIFEST


def read_manifest() -> dict[str, str]:
    if not MANIFEST.exists():
        return {}
    entries = {}
    for line in MANIFEST.read_text().splitlines():
        if line.strip():
            digest, rel = line.split(maxsplit=1)
            entries[rel.strip()] = digest
    return entries


def verify(path: Path) -> None:
    """Raise if ``path`` differs from the digest the manifest recorded for it."""
    rel = path.resolve().relative_to(ASSETS).as_posix()
    expected = read_manifest().get(rel)
    if expected is None:
        raise RuntimeError(f"{rel} is not listed in {MANIFEST.name}; rebuild it with "
                           "`python -m tinyserve train` (which rewrites the manifest).")
    actual = sha256_of(path)
    if actual != expected:
        raise RuntimeError(f"{rel} is corrupted or was replaced (sha256 {actual[:12]}..., "
                           f"manifest says {expected[:12]}...); restore it with `git checkout "
                           f"-- {path}` or retrain with `python -m tinyserve train`.")


def save_model(model: TinyLlama, name: str, report: dict[str, Any] | None = None) -> Path:
    """Write weights (fp32, tied embedding stored once), config and report; refresh manifest."""
    out = model_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous()
             for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # the same tensor as model.embed_tokens.weight
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "name": name})
    # safetensors writes 0600; the grading sandbox reads weights as an unprivileged user.
    (out / "model.safetensors").chmod(0o644)
    model.config.save(out / "config.json")
    if report is not None:
        (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_manifest()
    return out


def load_model(name: str = "target", device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, *, check: bool = True,
               layers: int | None = None) -> TinyLlama:
    """Load a model in eval mode on ``device`` (default: CUDA if present, else CPU) in
    ``dtype`` (default: bf16 on GPU, fp32 on CPU).

    ``target`` and ``draft`` are the shipped, trained models. ``bandwidth`` and
    ``bandwidth-draft`` are the scale presets (:mod:`tinyserve.scale`): random weights,
    created here at a size where decode is bound by memory; ``layers`` changes their depth."""
    from .scale import SCALE_PRESETS, build_scale_model
    if name in SCALE_PRESETS:
        return build_scale_model(name, device, dtype, layers=layers)
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of: "
                         f"{', '.join([*MODEL_NAMES, *SCALE_PRESETS])}")
    if layers is not None:
        raise ValueError(f"layers= sizes the scale presets ({', '.join(SCALE_PRESETS)}); "
                         f"the shipped {name!r} model has the depth it was trained with")
    folder = model_dir(name)
    weights = folder / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"no weights for model {name!r} at {weights}; train them with "
                                f"`python -m tinyserve train --preset {name}`.")
    if check:
        verify(weights)
    cfg = ModelConfig.load(folder / "config.json")
    dev, dt = resolve(device, dtype)
    model = TinyLlama(cfg)
    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"{weights} does not match its config: missing {missing}, "
                           f"unexpected {unexpected}")
    return model.to(device=dev, dtype=dt).eval()


def load_report(name: str) -> dict[str, Any]:
    path = model_dir(name) / "train_report.json"
    return json.loads(path.read_text()) if path.exists() else {}
