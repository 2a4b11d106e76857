"""A compile says what it does and about how long before it starts, and its display moves
during the single long call (tinyserve.backends.waits), tested with a fake clock."""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
import torch

from tinyserve.backends import fast, waits
from tinyserve.backends.waits import CompileTimes, Wait, estimate_line, waiting


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_display_advances_during_one_call_with_the_elapsed_time() -> None:
    clock, out = FakeClock(), io.StringIO()
    wait = Wait("compiling decode 1 rows x window 128", 40.0, clock=clock, out=out, interval=60)
    try:
        for now, shown in ((10, 10), (25, 25), (55, 40)):
            clock.now = 1000.0 + now
            wait.tick()
            assert wait.bar.n == shown
            assert f"{now} s elapsed" in out.getvalue()
        assert "of ~40 s" in out.getvalue() and "longer than the estimate" in out.getvalue()
    finally:
        assert wait.end() == 55


def test_a_background_thread_moves_it_while_the_call_blocks() -> None:
    clock, out = FakeClock(), io.StringIO()
    with waiting("compiling X", None, show=True, clock=clock, out=out, interval=0.01,
                 say=lambda _: None) as wait:
        assert wait is not None
        for now in (3, 70):
            clock.now = 1000.0 + now
            wait.ticked.clear()
            # the call itself is blocked (here: this wait); only the thread can tick
            assert wait.ticked.wait(timeout=10)
            assert wait.ticked.wait(timeout=10) and f"{now} s elapsed" in out.getvalue()
    assert not wait._thread.is_alive()


def test_before_it_starts_it_says_what_and_about_how_long() -> None:
    said: list[str] = []
    with waiting("compiling Y", 42.4, "its last compile here", show=True, say=said.append,
                 out=io.StringIO(), interval=60):
        assert said == ["compiling Y: about 42 s on this machine (its last compile here)"]
        with waiting("compiling Y inside", 1.0, show=True, say=said.append) as inner:
            assert inner is None                          # the outer wait speaks for both
    assert len(said) == 1
    assert "no estimate yet" in estimate_line("compiling Z", None, "")
    with waiting("quiet", 1.0, show=False, say=said.append) as none:
        assert none is None and len(said) == 1


def test_the_measurement_is_kept_for_the_next_estimate(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CompileTimes, "latest", {})
    times = CompileTimes(tmp_path)
    key = "cpu X | 2 threads | hidden {} | decode {} rows | recipe r".format
    assert times.estimate(key(256, 1)) == (None, "")
    times.put(key(256, 1), 30.0)
    assert times.estimate(key(256, 4)) == (30.0, "this model's last compile in this run")
    assert times.estimate(key(2048, 1)) == (None, "")          # another model's time says little
    times.put(key(256, 4), 12.5)
    monkeypatch.setattr(CompileTimes, "latest", {})                     # a new process
    assert CompileTimes(tmp_path).estimate(key(256, 4))[0] == 12.5      # reads it
    assert CompileTimes(tmp_path).estimate(key(256, 8)) == \
        (30.0, "this model's longest kept compile of another shape")
    (tmp_path / waits.COMPILE_TIMES_FILE).write_text("not json")
    assert CompileTimes(tmp_path).get(key(256, 4)) is None              # unreadable: no estimate


def test_a_fast_step_says_its_estimate_and_keeps_its_time(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    from tinyserve.checkpoint import load_model
    model = load_model("draft", device="cpu")
    monkeypatch.setattr(fast.toolchain, "ready", lambda device: True)
    monkeypatch.setattr(CompileTimes, "latest", {})
    compiles: list[int] = []

    def compiled() -> torch.Tensor:
        compiles.append(1)
        time.sleep(0.05)                            # stands in for the compile
        return torch.zeros(1)

    ways = {"compiled": compiled, "eager": lambda: torch.zeros(1)}
    with waits.shown(True):
        fast.first_step(model, "decode 1 rows x window 64", 1, fast.CPU_RECIPE, tmp_path, ways)
    printed = capsys.readouterr().out
    assert "compiling decode 1 rows x window 64: the first compile of its kind" in printed
    key = fast.shape_key(model, "decode 1 rows x window 64", fast.CPU_RECIPE)
    kept = CompileTimes(tmp_path).get(key)
    assert kept is not None and kept >= 0.05
    assert CompileTimes(tmp_path).estimate(key)[1].startswith("its last compile here")


def test_the_compiled_decoder_keeps_its_kernels_and_time_in_the_folder_it_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The loops hand the compiled step the cache folder (TINYSERVE_CACHE_DIR, or the
    checkout's .cache/): inductor's kernels and the compile's time go there, and the next
    decoder of that shape, in this process or a new one, says how long it took last time."""
    from tinyserve.backends.compiled import CompiledDecoder
    from tinyserve.checkpoint import load_model
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(CompileTimes, "latest", {})
    model = load_model("draft", device="cpu")

    def decoder() -> CompiledDecoder:
        made = CompiledDecoder(model, 1, window=64, cache=tmp_path)
        eager = made._forward
        made._step = lambda tokens, positions: (time.sleep(0.05), eager(tokens, positions))[1]
        return made                                  # the compile itself stood in by a sleep

    first = decoder()
    with waits.shown(True):
        first.step(torch.tensor([3]), torch.tensor([0]))
    kernels = tmp_path / "inductor" / fast.INDUCTOR_FOLDER
    assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == kernels
    assert "compiling the decode step (1 rows, window 64): the first compile" in capsys.readouterr().out
    kept = json.loads((kernels / waits.COMPILE_TIMES_FILE).read_text())
    assert len(kept) == 1 and list(kept.values())[0] >= 0.05
    monkeypatch.setattr(CompileTimes, "latest", {})               # as a new process
    with waits.shown(True):
        decoder().step(torch.tensor([3]), torch.tensor([0]))
    assert "about 0 s on this machine (its last compile here" in capsys.readouterr().out
