"""Which int8 kernel runs on CUDA (issue 24): one that reads int8 in the matmul, never the
eager ``scale_after`` that writes a float copy of every weight each step. ``auto`` (the
default) is ``scale_after`` on a CPU, unchanged, and on CUDA ``int8pack`` where the torch
build has a CUDA kernel for it, else the compiled ``scale_after``, else a clear error. The
choice logic and its once-per-device probe are tested here with the probe faked; the real
kernels get CUDA-marked tests."""
from __future__ import annotations

import pytest
import torch

import tinyserve.quant as quant
from conftest import random_prompt, sharp_model
from tinyserve.config import ModelConfig
from tinyserve.quant import (Int8Linear, choose_cuda_kernel, cuda_kernel, quantize_model,
                             quantize_rows)

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)


def _layer(out_f: int, in_f: int, kernel: str, device: str = "cpu", seed: int = 0) -> Int8Linear:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_rows(torch.randn(out_f, in_f, generator=g))
    return Int8Linear(q.to(device), s.to(device), kernel)


@pytest.fixture
def faked(monkeypatch):
    """A fresh choice cache and a fake probe: ``faked["int8pack"]`` / ``["compiler"]`` set
    the answers, ``faked["probes"]`` lists each probe's (device, dtype)."""
    state = {"int8pack": False, "compiler": True, "probes": []}
    monkeypatch.setattr(quant, "_CUDA_CHOICE", {})

    def probe(device, dtype):
        state["probes"].append((str(device), dtype))
        return state["int8pack"]
    monkeypatch.setattr(quant, "int8pack_runs", probe)
    monkeypatch.setattr(quant, "compiler_available", lambda device: state["compiler"])
    return state


def test_the_choice_prefers_int8pack_then_compiled_and_names_the_options_else() -> None:
    assert choose_cuda_kernel(True, True) == choose_cuda_kernel(True, False) == "int8pack"
    assert choose_cuda_kernel(False, True) == "compiled"
    with pytest.raises(RuntimeError, match="cuda:1.*_weight_int8pack_mm.*Triton.*scale_after"):
        choose_cuda_kernel(False, False, "cuda:1")


def test_the_probe_runs_once_per_device_and_dtype(faked) -> None:
    faked["int8pack"] = True
    assert cuda_kernel("cuda:0", torch.bfloat16) == "int8pack"
    faked["int8pack"] = False                   # remembered: not probed again
    assert cuda_kernel("cuda:0", torch.bfloat16) == "int8pack"
    assert cuda_kernel(torch.device("cuda", 0), torch.bfloat16) == "int8pack"
    assert cuda_kernel("cuda:0", torch.float16) == "compiled"   # another dtype: probed
    assert cuda_kernel("cuda:1", torch.bfloat16) == "compiled"  # another device: probed
    assert faked["probes"] == [("cuda:0", torch.bfloat16), ("cuda:0", torch.float16),
                               ("cuda:1", torch.bfloat16)]
    faked["compiler"] = False
    with pytest.raises(RuntimeError, match="no int8 kernel that reads int8"):
        cuda_kernel("cuda:2", torch.bfloat16)
    assert ("cuda:2", torch.bfloat16) not in quant._CUDA_CHOICE   # a failure is not kept


def test_auto_is_scale_after_on_the_cpu_and_probes_nothing(faked) -> None:
    auto, plain = _layer(24, 16, "auto", seed=1), _layer(24, 16, "scale_after", seed=1)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.bfloat16):
        assert auto.kernel_for(x.to(dtype)) == "scale_after"
        assert torch.equal(auto(x.to(dtype)), plain(x.to(dtype)))
    assert faked["probes"] == []
    model = sharp_model(SMALL, seed=2)
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 9, seed=4)])
    default = quantize_model(model)
    assert all(m.kernel == "auto" for m in default.modules() if isinstance(m, Int8Linear))
    with torch.no_grad():
        assert torch.equal(default(ids), quantize_model(model, kernel="scale_after")(ids))


def test_the_probe_says_no_where_the_kernel_is_missing() -> None:
    # On this CPU the real probe runs the real CPU kernel: yes; on 'meta' it cannot compare.
    assert quant.int8pack_runs(torch.device("cpu"), torch.float32)
    assert not quant.int8pack_runs(torch.device("meta"), torch.float32)


def test_explicit_int8pack_on_cuda_without_a_kernel_is_a_clear_error(faked, monkeypatch) -> None:
    layer = _layer(8, 16, "int8pack")
    x = torch.randn(1, 16)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    with pytest.raises(RuntimeError, match="no CUDA kernel for aten._weight_int8pack_mm.*'auto'"):
        layer(x)


# ------------------------------------------------------------------ on a GPU

def _one_row_peak(layer: Int8Linear, x: torch.Tensor) -> int:
    """Bytes allocated above the start during one call (after a warm-up call)."""
    layer(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    layer(x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_auto_reads_int8_and_equals_the_reference(dtype) -> None:
    kernel = cuda_kernel("cuda", dtype)
    assert kernel in ("int8pack", "compiled")
    ref = _layer(80, 48, "reference", "cuda", seed=3)
    fast = Int8Linear(ref.qweight, ref.scale, "auto")
    x = torch.randn(3, 5, 48, device="cuda").to(dtype)
    with torch.no_grad():
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(fast(x).float(), ref(x).float(), **tol)
        # A one-row step (batch-1 decode) writes no float copy of a 16 MB int8 weight: the
        # eager scale_after allocates 32 MB (bf16) or 64 MB (fp32) for it.
        big = _layer(4096, 4096, "auto", "cuda", seed=4)
        one = torch.randn(1, 4096, device="cuda").to(dtype)
        assert _one_row_peak(big, one) < 4 << 20
        eager = Int8Linear(big.qweight, big.scale, "scale_after")
        assert _one_row_peak(eager, one) >= 32 << 20   # the copy the test would catch


@pytest.mark.gpu
def test_on_cuda_the_int8_model_decodes_the_reference_tokens() -> None:
    from tinyserve.generate import generate
    model = sharp_model(SMALL, seed=5).to("cuda")
    prompt = random_prompt(SMALL.vocab_size, 7, seed=6)
    ref = generate(quantize_model(model, kernel="reference"), prompt, 12, graph=False).tokens
    int8 = quantize_model(model)
    assert generate(int8, prompt, 12, graph=False).tokens == ref
    assert generate(int8, prompt, 12, graph=True).tokens == ref    # captured after warm-up
