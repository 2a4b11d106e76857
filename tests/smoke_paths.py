"""Every decoding path once, on the shipped models: does this torch run the course?

``make torch-floor`` runs it with the oldest torch pyproject.toml admits (a throwaway venv);
tests/test_torch_floor.py runs it with this venv's torch, so it cannot rot. Each path's
greedy tokens are checked against plain cached ``generate`` (the reference), so a path that
runs but computes something else fails too::

    python tests/smoke_paths.py                  # one line per path; exit 1 if any failed
    python tests/smoke_paths.py --lowest-torch   # the oldest torch the index has >= the floor
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

TOKENS = 12
PROMPTS = ("<|ticket|>Subject: Login fails after the update",
           "<|ticket|>Subject: Refund",
           "<|ticket|>Subject: The app crashes when I open the settings page on my phone")


#: The paths :func:`smoke` runs after the reference (each a line of its output).
PATHS = 9


def smoke(say: Callable[[str], None] = print) -> list[tuple[str, str]]:
    """``(path, problem)`` for each of the :data:`PATHS` paths that failed; every path's
    line is ``say``-ed."""
    import torch
    import tinyserve
    from tinyserve import load_model, load_tokenizer
    from tinyserve.engine import EngineConfig, generate_many
    from tinyserve.generate import generate, generate_batch
    from tinyserve.quant import quantize_model
    from tinyserve.speculative import ModelDrafter, speculative_generate

    say(f"torch {torch.__version__} (floor {'.'.join(map(str, tinyserve.TORCH_FLOOR))}), "
        f"python {sys.version.split()[0]}, device cpu")
    target = load_model("target", device="cpu", dtype=torch.float32)
    draft = load_model("draft", device="cpu", dtype=torch.float32)
    tok = load_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    want = [generate(target, p, TOKENS, path="eager").tokens for p in prompts]
    say(f"  ok    load + generate (the reference): {len(want[0])} tokens")

    def spec(path: str) -> list[list[int]]:
        return [speculative_generate(target, ModelDrafter(draft, path=path), p, TOKENS,
                                     k=3, path=path)[0] for p in prompts]

    def engine(path: str) -> list[list[int]]:
        # 8 tokens a step: the 19-token prompt is prefilled in chunks beside decode rows
        config = EngineConfig(num_blocks=64, block_size=8, max_num_seqs=3,
                              max_num_batched_tokens=8, chunked_prefill=True, path=path)
        return generate_many(target, prompts, TOKENS, config)

    checks: list[tuple[str, Callable[[], list[list[int]]]]] = [
        ("generate path='graph'", lambda: [generate(target, p, TOKENS, path="graph").tokens
                                         for p in prompts]),
        ("generate, no cache", lambda: [generate(target, p, TOKENS, use_cache=False).tokens
                                        for p in prompts]),
        ("generate_batch", lambda: generate_batch(target, prompts, TOKENS, path="eager")),
        ("generate_batch path='graph'", lambda: generate_batch(target, prompts, TOKENS, path="graph")),
        ("engine, chunked prefill", lambda: engine("eager")),
        ("engine, chunked prefill, path='graph'", lambda: engine("graph")),
        ("speculative, model drafter", lambda: spec("eager")),
        ("speculative, path='graph'", lambda: spec("graph")),
    ]
    failed: list[tuple[str, str]] = []
    for name, run in checks:
        start = time.perf_counter()
        try:
            got = run()
            problem = "" if got == want else f"tokens differ from generate's: {got} vs {want}"
        except Exception:   # noqa: BLE001 - a smoke reports every path, then fails
            problem = traceback.format_exc(limit=-3).strip()
        seconds = time.perf_counter() - start
        say(f"  {'FAIL' if problem else 'ok':5} {name} ({seconds:.1f} s)"
            + (f"\n{problem}" if problem else ""))
        if problem:
            failed.append((name, problem))
    # int8 changes the numbers, so its tokens are not the float model's: it must run and
    # give a full answer (its agreement with float is tests/test_quant.py's business)
    try:
        out = generate(quantize_model(target), prompts[0], TOKENS).tokens
        problem = "" if len(out) == TOKENS else f"{len(out)} tokens, not {TOKENS}"
    except Exception:   # noqa: BLE001
        problem = traceback.format_exc(limit=-3).strip()
    say(f"  {'FAIL' if problem else 'ok':5} int8 (quantize_model, kernel auto)"
        + (f"\n{problem}" if problem else ""))
    if problem:
        failed.append(("int8", problem))
    return failed


def declared_floor(pyproject: str) -> tuple[int, ...]:
    """The ``torch>=X.Y`` floor of pyproject.toml's text (read without importing torch)."""
    found = re.search(r'"torch>=([0-9.]+)"', pyproject)
    if found is None:
        raise ValueError("pyproject.toml declares no torch>= floor")
    return tuple(map(int, found.group(1).split(".")))


def lowest_torch(available: str, floor: tuple[int, ...]) -> str:
    """The oldest release at or above ``floor`` in ``pip index versions torch``'s output
    (local builds such as ``2.13.0+cpu`` and pre-releases left out)."""
    listed = re.search(r"Available versions:\s*(.*)", available)
    if listed is None:
        raise ValueError(f"no 'Available versions:' line in pip's answer: {available[:300]!r}")
    releases = [v.strip() for v in listed.group(1).split(",")
                if re.fullmatch(r"\d+(\.\d+)+", v.strip())]
    fits = sorted((tuple(map(int, v.split("."))), v) for v in releases
                  if tuple(map(int, v.split("."))) >= floor)
    if not fits:
        raise ValueError(f"the index has no torch at or above {floor}: {releases}")
    return fits[0][1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--lowest-torch"]:
        from pathlib import Path
        floor = declared_floor((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
        answer = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"],
                                capture_output=True, text=True, check=True).stdout
        print(lowest_torch(answer, floor))
        return 0
    if argv:
        print(f"unknown arguments {argv}; use none, or --lowest-torch", file=sys.stderr)
        return 2
    failed = smoke()
    if failed:
        print(f"FAILED: {', '.join(n for n, _ in failed)}")
    print(f"smoke: {PATHS - len(failed)} passed, {len(failed)} failed")   # CI's closing line
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
