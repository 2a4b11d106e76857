"""Which int8 kernel runs on CUDA. ``auto`` (the default) is ``scale_after`` on a CPU,
unchanged, and on CUDA (issue 36) the fastest of ``int8pack`` (where the torch build has a
CUDA kernel for it), the compiled ``scale_after`` and the eager one (cuBLAS on a cast copy),
timed once per device, dtype and shape class. ``cuda_kernel`` (issue 24) is the kernel that
reads int8 in the matmul: ``int8pack`` where the build has it, else compiled, else a clear
error. The choice logic, the once-per-device probe and the timed choice are tested here with
the probe and the timings faked; the real kernels get CUDA-marked tests."""
from __future__ import annotations

import pytest
import torch

import tinyserve.quant as quant
from conftest import random_prompt, sharp_model
from tinyserve.config import ModelConfig
from tinyserve.quant import (AUTO_CANDIDATES, Int8Linear, auto_choices, choose_cuda_kernel,
                             cuda_kernel, quantize_model, quantize_rows)

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


# ------------------------------------------------------------------ auto's timed choice

@pytest.fixture
def timed(faked, monkeypatch):
    """``faked`` plus fake timings: ``timed["seconds"][kernel]`` is what each candidate
    "takes"; ``timed["timed"]`` lists every timing as (device, kernel, rows, weight shape)."""
    state = faked      # the probe's answers stay in the one dict its fakes read
    state.update(seconds={"int8pack": 3e-6, "compiled": 2e-6, "scale_after": 5e-6}, timed=[])
    monkeypatch.setattr(quant, "AUTO_CHOICES", {})
    monkeypatch.setattr(quant, "_INT8PACK_RUNS", {})

    def fake_time(kernel, x, qweight, scale):
        state["timed"].append((str(x.device), kernel, x.shape[0], tuple(qweight.shape)))
        return state["seconds"][kernel]
    monkeypatch.setattr(quant, "time_kernel", fake_time)
    return state


def _on(device: torch.device, monkeypatch) -> None:
    """Every tensor claims to live on ``device`` (the kernels themselves are not run)."""
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: device))


def test_auto_on_cuda_keeps_the_fastest_once_per_device_and_shape_class(timed, monkeypatch,
                                                                        capsys) -> None:
    timed["int8pack"] = True
    layer, other = _layer(24, 16, "auto", seed=1), _layer(40, 16, "auto", seed=2)
    g = torch.Generator().manual_seed(3)
    one, three, five = (torch.randn(n, 16, generator=g) for n in (1, 3, 5))
    assert layer.kernel_for(one) == "scale_after"               # on the CPU: nothing timed
    assert timed["timed"] == [] and auto_choices() == []
    _on(torch.device("cuda", 0), monkeypatch)
    assert layer.kernel_for(one) == "compiled"                  # the fastest of the three
    assert timed["timed"] == [("cuda:0", k, 1, (24, 16)) for k in AUTO_CANDIDATES]
    timed["seconds"] = {"int8pack": 1e-6, "compiled": 9e-6, "scale_after": 9e-6}
    assert layer.kernel_for(one[None]) == "compiled"            # the same class: kept,
    assert len(timed["timed"]) == 3                             # not timed again
    assert layer.kernel_for(three) == "int8pack"                # 2-16 rows: its own class
    assert layer.kernel_for(five) == "int8pack" and len(timed["timed"]) == 6
    assert other.kernel_for(one) == "int8pack"                  # another weight shape
    assert len(timed["timed"]) == 9
    timed["seconds"] = {"int8pack": 4e-6, "compiled": 4e-6, "scale_after": 4e-6}
    _on(torch.device("cuda", 1), monkeypatch)
    assert layer.kernel_for(one) == "int8pack"                  # another device; a tie:
    assert timed["timed"][-3][0] == "cuda:1"                    # the candidates' order
    choices = auto_choices("cuda:0")
    assert [(c.rows, c.out_features, c.kernel) for c in choices] == \
        [("1", 24, "compiled"), ("2-16", 24, "int8pack"), ("1", 40, "int8pack")]
    assert choices[0].seconds == {"int8pack": 3e-6, "compiled": 2e-6, "scale_after": 5e-6}
    assert [c.kernel for c in auto_choices("cuda:1", torch.float32)] == ["int8pack"]
    assert len(auto_choices("cuda")) == 4 and auto_choices("cuda", torch.bfloat16) == []
    printed = capsys.readouterr().out.splitlines()              # one line per choice
    assert len(printed) == 4 and printed[0] == str(choices[0])
    assert printed[0].endswith(": compiled") and "compiled 2.0 us" in printed[0]
    assert timed["probes"] == [("cuda:0", torch.float32), ("cuda:1", torch.float32)]


def test_auto_times_only_the_kernels_that_run_here(timed, monkeypatch) -> None:
    timed["int8pack"], timed["compiler"] = False, False
    timed["seconds"]["scale_after"] = 1e-3                     # slow, but the only one
    _on(torch.device("cuda", 0), monkeypatch)
    assert _layer(24, 16, "auto").kernel_for(torch.randn(2, 16)) == "scale_after"
    assert [t[1] for t in timed["timed"]] == ["scale_after"]
    timed["compiler"] = True
    assert _layer(8, 16, "auto").kernel_for(torch.randn(2, 16)) == "compiled"
    assert [t[1] for t in timed["timed"]] == ["scale_after", "compiled", "scale_after"]


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
        # A one-row step (batch-1 decode) through a kernel that reads int8 writes no float
        # copy of a 16 MB int8 weight: the eager scale_after allocates 32 MB (bf16) or
        # 64 MB (fp32) for it. (auto keeps scale_after only where cuBLAS timed fastest.)
        big = _layer(4096, 4096, "auto", "cuda", seed=4)
        one = torch.randn(1, 4096, device="cuda").to(dtype)
        chosen = big.kernel_for(one)
        assert chosen in AUTO_CANDIDATES and auto_choices("cuda", dtype)
        if chosen != "scale_after":
            assert _one_row_peak(big, one) < 4 << 20
        eager = Int8Linear(big.qweight, big.scale, "scale_after")
        assert _one_row_peak(eager, one) >= 32 << 20   # the copy the test would catch


@pytest.mark.gpu
def test_on_cuda_the_int8_model_decodes_the_reference_tokens() -> None:
    from tinyserve.generate import generate
    model = sharp_model(SMALL, seed=5).to("cuda")
    prompt = random_prompt(SMALL.vocab_size, 7, seed=6)
    ref = generate(quantize_model(model, kernel="reference"), prompt, 12, path="eager").tokens
    int8 = quantize_model(model)
    assert generate(int8, prompt, 12, path="eager").tokens == ref
    assert generate(int8, prompt, 12, path="graph").tokens == ref    # captured after warm-up
