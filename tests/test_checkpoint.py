"""Shipped assets: the manifest matches every file, tampering is caught, loading is strict."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tinyserve import checkpoint
from tinyserve.checkpoint import load_model, read_manifest, sha256_of


def test_manifest_lists_every_shipped_asset_with_its_digest() -> None:
    entries = read_manifest()
    for required in ("tokenizer.json", "models/target/model.safetensors",
                     "models/target/config.json", "models/draft/model.safetensors",
                     "models/draft/config.json"):
        assert required in entries, f"{required} missing from MANIFEST.sha256"
    for rel, digest in entries.items():
        assert sha256_of(checkpoint.ASSETS / rel) == digest, f"{rel} changed since the manifest"


@pytest.mark.parametrize("name", ["target", "draft"])
def test_load_model_on_cpu_in_eval_mode(name: str) -> None:
    model = load_model(name, device="cpu")
    assert not model.training
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unknown_model_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of: target, draft"):
        load_model("huge")


def test_corrupted_weights_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assets = tmp_path / "assets"
    shutil.copytree(checkpoint.ASSETS, assets)
    monkeypatch.setattr(checkpoint, "ASSETS", assets)
    monkeypatch.setattr(checkpoint, "MODELS_DIR", assets / "models")
    monkeypatch.setattr(checkpoint, "MANIFEST", assets / "MANIFEST.sha256")
    load_model("draft")  # the intact copy loads
    weights = assets / "models" / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="corrupted or was replaced"):
        load_model("draft")
