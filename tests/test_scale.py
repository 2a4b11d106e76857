"""The bandwidth-scale presets: sized from the machine's cache, built in seconds from a seed,
the same model class (so the shipped model's equivalence tests cover its code path), and
clear errors for what the loader cannot do."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tinyserve import load_model, scale
from tinyserve.generate import decode_step, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama


def test_cpu_preset_spans_eight_last_level_caches_and_stays_under_the_cap() -> None:
    for llc in (8 * 2**20, 32 * 2**20, 96 * 2**20, 512 * 2**20):
        layers = scale.cpu_layers(llc)
        cfg = replace(scale._CPU_LAYER, num_hidden_layers=layers)
        size = scale.weight_bytes_of(cfg)
        assert size <= scale.CPU_CAP_BYTES
        if size < 8 * llc:   # only when one more layer would break the cap
            more = scale.weight_bytes_of(replace(cfg, num_hidden_layers=layers + 1))
            assert more > scale.CPU_CAP_BYTES
        elif layers > 1:      # the fewest layers that reach 8x
            fewer = scale.weight_bytes_of(replace(cfg, num_hidden_layers=layers - 1))
            assert fewer < 8 * llc


def test_cache_size_is_read_from_the_os_or_a_stated_fallback(tmp_path, monkeypatch) -> None:
    for name, kind, size in (("index0", "Data", "48K"), ("index1", "Instruction", "64M"),
                             ("index2", "Unified", "2048K"), ("index3", "Unified", "32768K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "type").write_text(kind + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    # the largest data or unified cache; an instruction cache never counts
    assert scale.last_level_cache_bytes(tmp_path) == (32 * 2**20, "sysfs")
    empty = tmp_path / "none"
    monkeypatch.setattr(scale.os, "sysconf", lambda name: 24 * 2**20)
    assert scale.last_level_cache_bytes(empty) == (24 * 2**20, "sysconf")
    monkeypatch.setattr(scale.os, "sysconf", lambda name: 0)
    assert scale.last_level_cache_bytes(empty) == (scale.FALLBACK_LLC_BYTES, "fallback")
    assert scale._parse_size("32768K") == 32 * 2**20
    assert scale._parse_size("2M") == 2 * 2**20


def test_gpu_preset_is_the_timing_model() -> None:
    cfg = scale.scale_config("bandwidth", "cuda")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4096, 11008, 8)
    assert 1.3e9 < scale.weight_bytes_of(cfg, 1) < 1.5e9          # ~1.4B parameters


def test_draft_is_much_cheaper_and_shares_the_vocabulary() -> None:
    for device in ("cpu", "cuda"):
        target = scale.scale_config("bandwidth", device)
        draft = scale.scale_config("bandwidth-draft", device)
        assert draft.vocab_size == target.vocab_size
        assert scale.weight_bytes_of(draft) * 10 < scale.weight_bytes_of(target)


def test_same_seed_same_weights_and_the_global_rng_is_left_alone() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = load_model("bandwidth-draft", device="cpu")
    assert torch.equal(torch.random.get_rng_state(), before)
    b = load_model("bandwidth-draft", device="cpu")
    assert isinstance(a, TinyLlama) and not a.training
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                   b.state_dict().values()))


def test_scale_model_runs_the_shipped_code_path_cached_equals_recompute() -> None:
    model = load_model("bandwidth", device="cpu", layers=1)
    assert model.config.hidden_size == 2048 and model.config.num_hidden_layers == 1
    ids = torch.tensor([[3, 17, 250, 4000, 12, 99]])
    with torch.inference_mode():
        full = model(ids)[0, -1]
        cache = KVCache.for_model(model, 1, 8)
        prefill(model, ids[:, :-1], cache)
        last = decode_step(model, ids[:, -1], torch.tensor([5]), cache)[0]
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-4)


def test_bad_input_names_the_choices_and_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="choose one of: target, draft, bandwidth, bandwidth-draft"):
        load_model("huge")
    with pytest.raises(ValueError, match="choose one of: bandwidth, bandwidth-draft"):
        scale.scale_config("wide")
    with pytest.raises(ValueError, match="positive whole number"):
        load_model("bandwidth", layers=0)
    with pytest.raises(ValueError, match="shipped 'target' model"):
        load_model("target", layers=2)
    monkeypatch.setattr(scale, "available_memory", lambda device: 100 * 2**20)
    with pytest.raises(ValueError, match=r"needs about .* GiB .* only 0.1 GiB is free; pass fewer layers"):
        load_model("bandwidth", device="cpu")
