"""The fast path on a machine that cannot compile: it never crashes, gives eager's tokens and
says once why and how to fix it (tinyserve.toolchain); and what each fast shape runs is the
fastest way timed here, kept on disk (tinyserve.backends.choices).

Each machine without a compiler is simulated in a child process (inductor reads ``CXX`` when
it is imported, and keeps its compiler search for the process): a ``CXX`` that does not
exist, and one that answers ``--version`` but fails every compile."""
from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest
import torch

from tinyserve import toolchain
from tinyserve.backends import choices, fast
from tinyserve.config import ModelConfig
from tinyserve.generate import generate, generate_batch
from tinyserve.paths import CHECKOUT

from conftest import random_prompt, sharp_model

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

#: Every loop on the fast path against eager, in one process; prints one JSON line last.
CHILD = r"""
import json, sys, torch
from tinyserve.config import ModelConfig
from tinyserve.model import TinyLlama
from tinyserve.generate import generate, generate_batch
from tinyserve.engine import EngineConfig, generate_many
from tinyserve.speculative import ModelDrafter, speculative_generate
from tinyserve import quant

def model(seed):
    torch.manual_seed(seed)
    m = TinyLlama(ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3)
    return m

def prompt(n, seed):
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

target, draft = model(3), model(4)
p, ps = prompt(6, 1), [prompt(n, n) for n in (3, 4, 5)]
same = {
    "generate": generate(target, p, 8, path="fast").tokens == generate(target, p, 8).tokens,
    "compile": generate(target, p, 8, path="compiled").tokens == generate(target, p, 8).tokens,
    "batch": generate_batch(target, ps, 6, path="fast") == generate_batch(target, ps, 6),
    "speculation": speculative_generate(target, ModelDrafter(draft, path="fast"), p, 8, k=2,
                                        path="fast")[0]
                   == speculative_generate(target, ModelDrafter(draft), p, 8, k=2)[0],
    "engine": generate_many(target, ps, 6, EngineConfig(max_num_seqs=4, path="fast"))
              == generate_many(target, ps, 6, EngineConfig(max_num_seqs=4)),
}
print(json.dumps({"same": same, "compiler_available": quant.compiler_available(torch.device("cpu"))}))
"""


def _child(tmp_path: Path, cxx: str, extra: str = "") -> tuple[dict, str]:
    env = {**os.environ, "CXX": cxx, "TINYSERVE_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1",
           "TINYSERVE_DEVICE": "cpu"}
    run = subprocess.run([sys.executable, "-c", extra + CHILD], env=env, cwd=CHECKOUT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stdout


@pytest.mark.parametrize("cxx, cause", [
    ("/nonexistent/g++", "no working C++ compiler"),
    ("failing", "the C++ compiler failed"),
])
def test_without_a_working_compiler_every_fast_loop_gives_eager_tokens_and_says_why_once(
        tmp_path: Path, cxx: str, cause: str) -> None:
    if cxx == "failing":        # found by inductor's search, fails every compile
        script = tmp_path / "g++"
        script.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "g++ (fake) 12"; '
                          'exit 0; fi\necho "fake: cannot compile" >&2; exit 1\n')
        script.chmod(0o755)
        cxx = str(script)
    result, out = _child(tmp_path, cxx)
    assert result["same"] == dict.fromkeys(result["same"], True)
    assert result["compiler_available"] is False       # the int8 kernels' choice asks it too
    lines = [line for line in out.splitlines() if line.startswith("fast path off")]
    assert len(lines) == 1, out
    assert f"fast path off: {cause} (" in lines[0]
    assert toolchain.fix_for(cause) in lines[0] and "same tokens" in lines[0]


def test_with_onednn_and_mkl_reported_absent_the_fast_path_gives_eager_tokens(
        tmp_path: Path) -> None:
    # A torch without oneDNN's packed linear (the course asks tinyserve.backends.packed) and
    # without MKL (inductor asks torch._C.has_mkl: its frozen linears then take no MKL
    # kernel): no packed way anywhere, the compiled step and eager left; this machine's real
    # compiler. (torch.backends.mkldnn's answer is not patched: inductor's C++ half would
    # still find oneDNN, a torch that exists nowhere.)
    absent = ("import torch\ntorch._C.has_mkl = False\n"
              "from tinyserve.backends import packed\npacked.available = lambda: False\n")
    result, out = _child(tmp_path, os.environ.get("CXX", "g++"), absent)
    assert result["same"] == dict.fromkeys(result["same"], True)
    assert "fast path off" not in out and result["compiler_available"] is True
    kept = json.loads((tmp_path / "inductor" / choices.CHOICES_FILE).read_text())   # the
    # kernels' folder the child was given (TORCHINDUCTOR_CACHE_DIR), where its choices go too
    assert kept and all(c["kernel"] != "packed" for c in kept.values())


def test_the_toolchains_cause_and_fix_name_the_missing_piece_for_each_os() -> None:
    assert toolchain.cause_of(RuntimeError("InvalidCxxCompiler: No working C++ compiler")) \
        == "no working C++ compiler"
    omp = RuntimeError("CppCompileError: C++ compile error\nCommand:\ng++ -fopenmp x.cpp\n"
                       "Output:\nx.cpp:1:10: fatal error: omp.h: No such file or directory")
    assert toolchain.cause_of(omp) == "no OpenMP for the C++ compiler"
    flags_only = RuntimeError("CppCompileError\nCommand:\ng++ -fopenmp x.cpp\nOutput:\nld: oops")
    assert toolchain.cause_of(flags_only) == "the C++ compiler failed"   # not the flags' -fopenmp
    headers = RuntimeError("Command:\ng++ x.cpp\nOutput:\nfatal error: Python.h: No such file")
    assert toolchain.cause_of(headers) == "no Python headers"
    assert "python3-dev" in toolchain.fix_for("no Python headers", "Linux")
    assert "libomp" in toolchain.fix_for("no OpenMP for the C++ compiler", "Darwin")
    assert "WSL2" in toolchain.fix_for("no working C++ compiler", "Windows")
    line = toolchain.Toolchain(False, "no working C++ compiler", "x", "install g++").line()
    assert line.startswith("fast path off: no working C++ compiler (x)") and "install g++" in line


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The fast path traced only (no code generation), its steps' ways *timed*, choices kept
    in a temporary cache folder."""
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), False, "eager", "plain", "measured"))
    monkeypatch.setenv("TINYSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path


def _held(model) -> list:
    from tinyserve.backends.compiled import DECODERS
    return [d for d in DECODERS.decoders(model) if isinstance(d, fast.FastDecoder)]


def test_a_shape_timed_once_is_kept_on_disk_and_one_that_lost_never_compiles(
        measured: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = sharp_model(SMALL, seed=5)
    prompt = random_prompt(96, 6, seed=2)
    eager = generate(model, prompt, 8).tokens
    assert generate(model, prompt, 8, path="fast").tokens == eager
    (decoder,) = _held(model)
    assert decoder.choice.why == "timed" and {w for w, _ in decoder.choice.seconds} == \
        {"compiled", "eager"}                          # one row: no packed way
    book = choices.ChoiceBook(measured / "inductor" / fast.INDUCTOR_FOLDER)
    key = choices.shape_key(model, "decode 1 rows x window 64", fast.CPU_RECIPE)
    assert book.get(key).kernel == decoder.choice.kernel
    # a new process (a new model of the same shape) whose kept choice says eager won: the
    # step is never compiled, and gives eager's tokens
    book.put(key, choices.StepChoice(1, "eager", (("compiled", 0.02), ("eager", 0.01))))
    from tinyserve.backends import compiled

    def no_compile(*_a, **_k):
        raise AssertionError("a shape whose kept choice is eager was compiled")
    monkeypatch.setattr(compiled, "compiling", no_compile)
    again = sharp_model(SMALL, seed=5)
    assert generate(again, prompt, 8, path="fast").tokens == eager
    (decoder,) = _held(again)
    assert decoder.choice.kernel == "eager" and decoder.choice.why == "kept"
    assert "eager (timed in an earlier run, kept on disk: compiled 20.0 ms, eager 10.0 ms)" \
        == decoder.choice.sentence()


def test_a_compile_that_fails_falls_back_to_eager_and_says_why_once(
        measured: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    # the probe passed, a lowering did not (inductor's LoweringException, say)
    monkeypatch.setattr(fast, "CPU_RECIPE", fast.Recipe((), False, "inductor", "plain", "measured"))
    monkeypatch.setattr(toolchain, "_PROBED", toolchain.Toolchain(True))
    monkeypatch.setattr(toolchain, "_ANNOUNCED", False)
    from tinyserve.backends import compiled

    def lowering_fails(*_a, **_k):
        raise RuntimeError("LoweringException: a lowering this inductor lacks")
    monkeypatch.setattr(compiled, "compiling", lowering_fails)
    model = sharp_model(SMALL, seed=6)
    prompts = [random_prompt(96, n, seed=n) for n in (3, 5)]
    assert generate_batch(model, prompts, 6, path="fast") == generate_batch(model, prompts, 6)
    assert generate(model, prompts[0], 6, path="fast").tokens == generate(model, prompts[0], 6).tokens
    said = [line for line in capsys.readouterr().out.splitlines() if "fast path off" in line]
    assert len(said) == 1 and "torch.compile failed here (LoweringException" in said[0]
    held = _held(model)
    # the first compile failed; the later decoders were told nothing compiles here
    assert held and {d.choice.why for d in held} <= {"compile failed", "no compiler"}
    assert any(d.choice.why == "compile failed" for d in held)


def test_the_probe_says_yes_on_a_machine_with_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchain, "_PROBED", None)     # asked afresh in this process
    found = toolchain.probe()
    assert found.ok and toolchain.ready("cpu") and found.line().startswith("fast path: ")


def test_a_frozen_steps_cache_key_holds_its_weights() -> None:
    # Inductor's FX graph cache keys a frozen graph by shapes and code and keeps the
    # constants lowering adds by value: without the weights in the key, a model of the same
    # shapes (speculation's draft beside its target; a checkpoint loaded in place) ran with
    # another's weights on a torch without MKL (the test above, whose speculation failed).
    import torch.compiler.config as compiler_config
    a, b = sharp_model(SMALL, seed=1), sharp_model(SMALL, seed=2)
    assert fast.weights_digest(a) == fast.weights_digest(sharp_model(SMALL, seed=1))
    assert fast.weights_digest(a) != fast.weights_digest(b)
    held = fast.weights_digest(a)
    with torch.no_grad():
        a.lm_head.weight[0, 0] += 1.0                          # in place: a new version
    assert fast.weights_digest(a) != held
    with fast.compile_settings(True, 1, weights="abc"):
        assert compiler_config.cache_key_tag.endswith("tinyserve-weights-abc")
    assert "tinyserve-weights" not in compiler_config.cache_key_tag
