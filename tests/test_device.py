"""Device choice: CPU by default here, TINYSERVE_DEVICE overrides, bf16 only on GPU."""
from __future__ import annotations

import pytest
import torch

from tinyserve.device import ENV_VAR, default_device, default_dtype, resolve


def test_env_var_forces_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cpu")
    assert default_device() == torch.device("cpu")
    assert resolve() == (torch.device("cpu"), torch.float32)


def test_default_follows_cuda_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert default_device().type == expected


def test_bf16_on_gpu_fp32_on_cpu() -> None:
    assert default_dtype("cpu") == torch.float32
    assert default_dtype("cuda") == torch.bfloat16


def test_asking_for_missing_cuda_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so the request is valid")
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match=ENV_VAR):
        default_device()


def test_timings_warm_up_then_time_each_call_with_its_setup_outside_the_clock() -> None:
    from tinyserve.device import timings
    calls: list[str] = []
    times = timings(lambda: calls.append("fn"), "cpu", 3, warmup=2,
                    setup=lambda: calls.append("setup"))
    assert calls == ["setup", "fn"] * 5 and len(times) == 3 and min(times) >= 0
    assert len(timings(lambda: None, torch.device("cpu"), 4, warmup=0)) == 4


def test_one_clock_and_one_timing_loop_for_the_course_and_the_bench() -> None:
    # issue 39: the loops' clock, bench's sync and the sweeps' timings are device.py's
    from bench import common
    from tinyserve import device, generate
    assert generate.clock is device.clock and common.sync is device.sync
    assert common.median_seconds(lambda: None, torch.device("cpu"), repeats=3) >= 0


def test_interleaved_seconds_runs_setup_before_each_call_outside_the_clock(monkeypatch) -> None:
    # The packed-linear measurement flushes the caches before each timed pass: the flush
    # must not be counted, and it runs before the warm-up calls too.
    import time as _time

    from tinyserve import device
    now, calls = [0.0], []
    monkeypatch.setattr(_time, "perf_counter", lambda: now[0])

    def flush() -> None:
        calls.append("flush")
        now[0] += 100.0                          # a slow flush: must not reach the figures

    def step(seconds: float, name: str):
        return lambda: (calls.append(name), now.__setitem__(0, now[0] + seconds))
    got = device.interleaved_seconds({"a": step(1.0, "a"), "b": step(2.0, "b")}, "cpu",
                                     rounds=2, warmup=1, setup=flush)
    assert got == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
    assert calls == ["flush", "a", "flush", "b"] * 2 + ["flush", "b", "flush", "a"]
