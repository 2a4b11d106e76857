"""The scale model against llama.cpp on the same weights (issue 37): decode at batch 1 and a
128-token prefill, one thread each, interleaved, greedy tokens checked equal first.

What a user comparing engines on a CPU would pick is llama.cpp. This suite exports the scale
model (``load_model("bandwidth")``, :mod:`tinyserve.scale`) with the project's own Hugging Face
writer (:func:`tinyserve.hf_export.write_hf_checkpoint`), converts that folder to GGUF at f32
and q8_0 with llama.cpp's own converter (``convert_hf_to_gguf.py``, which ships in the
llama-cpp-python source distribution; ``make peers`` unpacks it), and runs llama.cpp through
llama-cpp-python in its own venv (``.venv-peers/llamacpp``, built from source by ``make
peers``: a long compile on a machine with few cores). llama.cpp runs in a worker process of
that venv (this file, run with ``--worker``), driven over a pipe; each figure it returns is
timed inside the worker around the llama.cpp calls, so the pipe costs nothing.

The converter runs in the course's own venv (it needs torch and transformers, which `make
bench`'s venv has) with the ``gguf-py`` package that ships beside it. Our tokenizer is
byte-level BPE, which the converter recognises only by hashing a known model's tokenization:
it is named here as GPT-2's pre-tokenizer. The suite hands llama.cpp token ids, never text.

What one run does, in order:

- **tokens first**: 16 greedy tokens from a fixed prompt, ours (fp32, the plain loop) against
  llama.cpp f32; they must be equal, or the suite stops before timing anything. Then over
  ``AGREE_PROMPTS`` prompts, how many leading greedy tokens each 8-bit model keeps of our fp32
  model's: our int8 (``quantize_model(group_size=32)``: a scale per 32 weights, q8_0's layout,
  weight-only), our per-row int8 (``quantize_model(kernel="fbgemm")``: W8A8, activations
  quantized per call) and llama.cpp's q8_0 (a scale per 32 weights, activations quantized to
  q8_0 blocks for its dot products);
- **decode at batch 1**: ``STEPS`` greedy steps after a ``PROMPT_TOKENS``-token prompt, each
  token fed back: ours on the fastest path (``torch.compile`` max-autotune with inductor's
  freezing, :func:`tinyserve.roofline.compile_settings`, the same compiled decoder as
  :func:`tinyserve.roofline.compiled_step_seconds`), ours eager, our group-wise int8 on the
  same compiled path (its linears one fused reduction over int8 weights:
  :func:`tinyserve.quant.grouped_matvec`), our per-row fbgemm int8 (eager), llama.cpp f32 and
  q8_0 (``llama_decode`` on one token through the low-level API: the high-level ``Llama.eval``
  keeps Python bookkeeping per call, so it is not used for timing);
- **prefill**: a ``PREFILL_TOKENS``-token prompt into an empty cache, logits of the last
  position only on both sides: ours fp32, group-wise int8 and per-row fbgemm int8 (eager: the
  loops' prefill), llama.cpp f32 and q8_0 (one ``llama_decode`` of the whole prompt,
  ``n_batch`` holding it), and in the same rounds torch's two fp32 linear kernels (MKL's and
  oneDNN's) at the prefill's largest matmul: a missed prefill goal's note gives each side's
  FLOP rate beside theirs. The decode rounds take the memory's read probe in turn likewise.

Every figure is taken in turns (:func:`bench.common.in_turns`: each round runs every one once,
the first rotating), so a busy spell hits all alike; a ratio is the median over rounds of the
same-round pairs. Ratios, ours / llama.cpp's (below 1: ours faster):
``scale_fast_vs_llamacpp_f32_decode``, ``scale_int8_vs_llamacpp_q8_decode``,
``scale_prefill_vs_llamacpp_f32``; the goals are issue 37's, in :mod:`bench.headlines`. "int8"
there is the group-wise model; the per-row fbgemm model's figures are beside them with
``int8_rowwise`` in the name, and no goal. The leading tokens kept are in the report, not
among the ratios: on these random N(0, 0.02) weights (no outliers, near-uniform logits) they
count near-ties, which llama.cpp's own f32 can flip, not quality. The 8-bit schemes' quality,
q8_0's included, is measured on the trained target by ``bench trained_quality`` (issue 52).

Not in ``bench all`` (it needs ``make peers``). ``--quick`` runs a one-layer scale model with
two rounds and the compiled path only traced: its figures mean nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Only the standard library at the top: the worker half of this file runs in the peer's
# venv, which has llama-cpp-python and numpy but no torch and no tinyserve.

REPO = Path(__file__).resolve().parents[2]
#: Not in ``bench all``: it needs ``make peers`` (llama-cpp-python built from source).
BENCH_ALL = False
LLAMA_CPP_PYTHON = "0.3.36"        # the version ``make peers`` builds
PROMPT_TOKENS = 64                 # the decode comparison's prompt (as in bench scale)
STEPS = 16                         # greedy decode steps per timed run
PREFILL_TOKENS = 128
CHECK_TOKENS = 16                  # greedy tokens compared per prompt
GROUP_SIZE = 32                    # our int8's weights per scale: q8_0's block
# Prompts for the agreement count: with 8 (16 tokens each) one early flip moved a model's count
# by up to 16 of 128, and the group-wise int8 and q8_0 each kept more on different prompts
# (87 and 89 kept in all, 2026-12-03): 32 for a count that one prompt does not decide.
AGREE_PROMPTS = 32
AGREE_PROMPT_TOKENS = 32
ROUNDS, QUICK_ROUNDS = 15, 2
FIRST_ID = 8                       # prompts draw ids above the tokenizer's special ones
N_CTX = 256                        # llama.cpp's context (and n_batch): holds every prompt
GGUF_TYPES = ("f32", "q8_0")
#: What makes the converter take our tokenizer: its SentencePiece and Llama-HF vocabularies
#: are skipped (we have neither file), and the byte-level BPE pre-tokenizer, which it knows
#: only by hashing known models' tokenizations, is named as GPT-2's.
CONVERT_DRIVER = """
import runpy, sys
folder = sys.argv[1]
sys.path.insert(0, folder)
sys.argv = [folder + "/convert_hf_to_gguf.py", *sys.argv[2:]]
import conversion.base as base
def no_such_vocab(self, *args, **kwargs):
    raise FileNotFoundError("byte-level BPE: tokenizer.json only")
base.TextModel._set_vocab_sentencepiece = no_such_vocab
base.TextModel._set_vocab_llama_hf = no_such_vocab
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# --- where the peer lives ---------------------------------------------------------------------

def peers_dir() -> Path:
    """The peers' venvs (``TINYSERVE_PEERS_DIR`` overrides, as for bench peers)."""
    return Path(os.environ.get("TINYSERVE_PEERS_DIR", REPO / ".venv-peers"))


def peer_python() -> Path:
    return peers_dir() / "llamacpp" / "bin" / "python"


def converter_dir() -> Path:
    """Where ``make peers`` unpacks llama.cpp's converter (with its gguf-py and conversion/)."""
    return peers_dir() / "llamacpp" / "convert"


NOTHING = "Nothing was measured or written."


def missing_message(what: str, outcome: str = NOTHING) -> str:
    return (f"llama.cpp is not ready: {what}. Run `make peers` (or `make peers-llamacpp`): it "
            f"builds llama-cpp-python {LLAMA_CPP_PYTHON} from source into "
            f"{peers_dir() / 'llamacpp'} (15-35 minutes on 2 cores) and unpacks its GGUF "
            f"converter; then rerun. {outcome}")


def missing(outcome: str = NOTHING) -> str | None:
    """What is missing for llama.cpp, or None when the peer venv and converter are there
    (``outcome``: what the caller does without them, the message's last sentence)."""
    python, convert = peer_python(), converter_dir() / "convert_hf_to_gguf.py"
    if not (python.is_file() and os.access(python, os.X_OK)):
        return missing_message(f"no venv at {python.parent.parent}", outcome)
    if not convert.is_file():
        return missing_message(f"no converter at {convert}", outcome)
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return missing_message(f"llama_cpp does not import in {python} ({tail})", outcome)
    return None


# --- the pure parts -----------------------------------------------------------------------------

def leading_agreement(reference: Sequence[int], candidate: Sequence[int]) -> int:
    """How many tokens ``candidate`` keeps of ``reference`` before the first difference (after
    one, greedy decoding follows a different text, so later matches mean nothing)."""
    kept = 0
    for a, b in zip(reference, candidate):
        if a != b:
            break
        kept += 1
    return kept


def agreement(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> int:
    """Leading tokens kept, summed over prompts."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference runs against {len(candidate)}")
    return sum(leading_agreement(r, c) for r, c in zip(reference, candidate))


def same_round_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """numerator / denominator of each round, same-round pairs, sorted."""
    return sorted(a / b for a, b in zip(numerator, denominator, strict=True))


def median_pair_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """The median over rounds of numerator / denominator, same-round pairs (as
    :func:`bench.common.median_ratio`; here without torch, for the tests)."""
    pairs = same_round_ratios(numerator, denominator)
    mid = len(pairs) // 2
    return pairs[mid] if len(pairs) % 2 else (pairs[mid - 1] + pairs[mid]) / 2


def compute_ratios(decode: dict[str, list[float]],
                   prefill: dict[str, list[float]]) -> dict[str, float]:
    """The suite's ratios, ours / llama.cpp's, from the per-round seconds (by path): "int8"
    is group-wise, on the fast path for decode; "int8_rowwise" per-row fbgemm. No agreement
    ratio: on the scale model's random weights the tokens kept count near-ties (the counts
    stay in the report; quality is ``bench trained_quality``'s, on the trained target)."""
    ratios = {
        "scale_fast_vs_llamacpp_f32_decode": median_pair_ratio(decode["fast"],
                                                               decode["llamacpp_f32"]),
        "scale_eager_vs_llamacpp_f32_decode": median_pair_ratio(decode["eager"],
                                                                decode["llamacpp_f32"]),
        "scale_prefill_vs_llamacpp_f32": median_pair_ratio(prefill["fast"],
                                                           prefill["llamacpp_f32"]),
        "scale_eager_prefill_vs_llamacpp_f32": median_pair_ratio(prefill["fp32"],
                                                                 prefill["llamacpp_f32"]),
    }
    for ours in ("int8", "int8_rowwise"):
        ratios[f"scale_{ours}_vs_llamacpp_q8_decode"] = median_pair_ratio(
            decode[ours], decode["llamacpp_q8_0"])
        ratios[f"scale_{ours}_prefill_vs_llamacpp_q8"] = median_pair_ratio(
            prefill[ours], prefill["llamacpp_q8_0"])
    return ratios


def prefill_flops(cfg: Any, tokens: int) -> int:
    """Forward FLOPs of a ``tokens``-token prefill into an empty cache with the logits of the
    last position only, as both sides run it: every token's matmuls except the last layer's
    MLP, which serves the last position alone (``TinyLlama.forward``; llama.cpp's
    ``inp_out_ids``), one LM head row, and causal attention (token t attends to the t before
    it and itself)."""
    head = 2 * cfg.hidden_size * cfg.vocab_size
    mlp = 2 * 3 * cfg.hidden_size * cfg.intermediate_size          # one layer, one token
    body = cfg.flops_per_token(0) - head                            # every layer, one token
    attention = sum(cfg.flops_per_token(t + 1) - cfg.flops_per_token(0) for t in range(tokens))
    return tokens * body - (tokens - 1) * mlp + head + attention


# --- the worker: llama.cpp in the peer's venv ---------------------------------------------------

def extra_buffers_off_reason(cpuinfo: str | None = None) -> str | None:
    """Why llama.cpp's extra buffer types must go off on this host, or None: llama.cpp then
    runs at its defaults. They hold its AMX, KleidiAI and repacked CPU layouts (ggml-cpu's
    ``ggml_backend_cpu_get_extra_buffers_type``), so turning them off also turns off the
    repacked q8_0 layout a user gets by default: they go off only where they are known to
    crash, a CPU with AMX, where q8_0 weights land in the AMX buffer and the first q8_0 step
    can fault in ``ggml_backend_amx_mul_mat`` (f32 unaffected; ggml-org/llama.cpp issue
    20824). ``cpuinfo``: ``/proc/cpuinfo``'s text (read here when None; absent: no AMX)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = {word for line in cpuinfo.splitlines() if line.startswith("flags")
             for word in line.split(":", 1)[-1].split()}
    amx = sorted(flags & {"amx_int8", "amx_tile", "amx_bf16"})
    if amx:
        return (f"off: this CPU has AMX ({', '.join(amx)}), where q8_0 in llama.cpp's AMX buffer "
                "can crash (ggml-org/llama.cpp issue 20824); its repacked layouts go off too")
    return None


def extra_buffers_text(reason: str | None) -> str:
    """The report's line for this host's choice (:func:`extra_buffers_off_reason`)."""
    return reason or ("on (llama.cpp's default: no AMX here, so its extra buffer types, the "
                      "repacked CPU layouts among them, run as a user gets them)")


class Peer:
    """One GGUF model in llama.cpp, one thread, driven through the low-level API."""

    def __init__(self, path: str, extra_buffers: bool = True, n_ctx: int = N_CTX,
                 logits_all: bool = False) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as capi
        self.lib = llama_cpp
        # With ``extra_buffers`` False, llama.cpp's --no-extra-bufts (Llama() has no argument
        # for it, so the defaults it starts from are patched while it loads): only where
        # extra_buffers_off_reason says so, the report records why.
        defaults = capi.llama_model_default_params

        def without_extra_buffers() -> Any:
            params = defaults()
            params.use_extra_bufts = False
            return params
        if not extra_buffers:
            capi.llama_model_default_params = without_extra_buffers
        try:
            self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx,
                                       n_ubatch=n_ctx, n_threads=1, n_threads_batch=1,
                                       logits_all=logits_all, n_gpu_layers=0, use_mmap=False,
                                       verbose=False)
        finally:
            capi.llama_model_default_params = defaults
        self.ctx = self.llm.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = self.llm.n_vocab()

    def decode(self, tokens: Sequence[int]) -> None:
        """The tokens at the next positions of sequence 0; logits of the last only."""
        array = (self.lib.llama_token * len(tokens))(*tokens)
        code = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(array, len(tokens)))
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def argmax(self) -> int:
        import numpy as np
        logits = self.lib.llama_get_logits_ith(self.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        self.clear()
        self.decode(prompt)
        out = [self.argmax()]
        while len(out) < n:
            self.decode(out[-1:])
            out.append(self.argmax())
        return out

    def decode_seconds(self, prompt: Sequence[int], n: int) -> float:
        """Seconds per step of ``n`` greedy steps after ``prompt`` (prefilled untimed)."""
        self.clear()
        self.decode(prompt)
        token = self.argmax()
        start = time.perf_counter()
        for _ in range(n):
            self.decode([token])
            token = self.argmax()
        return (time.perf_counter() - start) / n

    def all_logits(self, tokens: Sequence[int], out: str) -> list[int]:
        """Every position's logits for ``tokens`` in one batch from an empty cache (the
        high-level ``Llama.eval``, which keeps them all when loaded with ``logits_all``),
        saved as a float32 .npy at ``out``; returns their shape."""
        import numpy as np
        self.llm.reset()
        self.llm.eval(list(tokens))
        logits = np.array(self.llm.scores[:len(tokens)], dtype=np.float32)
        np.save(out, logits)
        return list(logits.shape)

    def prefill_seconds(self, prompt: Sequence[int]) -> float:
        self.clear()
        start = time.perf_counter()
        self.decode(prompt)
        self.argmax()
        return time.perf_counter() - start


def worker_main() -> int:
    """Answer one JSON request per line on stdin with one JSON line on stdout."""
    import llama_cpp
    peers: dict[str, Peer] = {}
    out = sys.stdout
    sys.stdout = sys.stderr          # nothing else may write to the answer channel
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "load":
            peers[req["name"]] = Peer(req["path"], req.get("extra_buffers", True),
                                      req.get("n_ctx", N_CTX), req.get("logits_all", False))
            answer: Any = {"version": llama_cpp.__version__,
                           "system_info": llama_cpp.llama_print_system_info().decode()}
        elif op == "greedy":
            answer = peers[req["name"]].greedy(req["prompt"], req["n"])
        elif op == "decode":
            answer = peers[req["name"]].decode_seconds(req["prompt"], req["n"])
        elif op == "prefill":
            answer = peers[req["name"]].prefill_seconds(req["prompt"])
        elif op == "logits":
            answer = peers[req["name"]].all_logits(req["tokens"], req["out"])
        else:
            raise ValueError(f"unknown op {op!r}")
        out.write(json.dumps({"ok": answer}) + "\n")
        out.flush()
    return 0


class Worker:
    """The client end: a worker process in the peer's venv, one thread, one request at a time."""

    def __init__(self, log: Path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1"}
        self.log = log
        self.proc = subprocess.Popen([str(peer_python()), str(Path(__file__).resolve()),
                                      "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                                     env=env)

    def ask(self, **req: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            tail = "\n".join(self.log.read_text().splitlines()[-15:])
            raise RuntimeError(f"the llama.cpp worker stopped on {req['op']}:\n{tail}")
        return json.loads(line)["ok"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def worker(log: Path) -> Iterator[Worker]:
    w = Worker(log)
    try:
        yield w
    finally:
        w.close()


# --- the model and the files llama.cpp reads ------------------------------------------------

def export_and_convert(model: Any, work: Path, stem: str = "scale") -> dict[str, Any]:
    """The model as a Hugging Face folder (our writer), then GGUF at each of GGUF_TYPES (the
    converter in this venv). Returns the files, how long each took, and each file's tensor
    types as the converter logged them (:func:`tensor_types`: a matrix whose rows q8_0's
    block does not divide stays F16 in the q8_0 file)."""
    from tinyserve.hf_export import write_hf_checkpoint
    from tinyserve.tokenizer import load_tokenizer
    start = time.perf_counter()
    hf_dir = write_hf_checkpoint(model, load_tokenizer(), work / "hf")
    out: dict[str, Any] = {"export_s": round(time.perf_counter() - start, 1), "files": {}}
    for outtype in GGUF_TYPES:
        path = work / f"{stem}-{outtype}.gguf"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CONVERT_DRIVER, str(converter_dir()),
                               str(hf_dir), "--outtype", outtype, "--outfile", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0 or not path.is_file():
            raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n"
                               + "\n".join(proc.stderr.splitlines()[-20:]))
        out["files"][outtype] = {"path": str(path), "bytes": path.stat().st_size,
                                 "convert_s": round(time.perf_counter() - start, 1),
                                 "tensor_types": tensor_types(proc.stderr + proc.stdout)}
    return out


def tensor_types(log: str) -> dict[str, str]:
    """Each tensor's GGUF type from the converter's log lines (``NAME, DTYPE --> TYPE, shape =
    {...}``: ``conversion/base.py`` logs one per tensor, after its F16 fallback for a row
    its block does not divide)."""
    import re
    return {m.group(1): m.group(2) for m in re.finditer(
        r"([\w.]+),\s+\S+\s+-->\s+(\w+),\s+shape", log)}


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, vocab, (count, length), generator=g).tolist()


# --- ours ---------------------------------------------------------------------------------

def our_greedy(model: Any, prompt: Sequence[int], n: int) -> list[int]:
    """Our plain greedy loop (the reference every fast path is tested against)."""
    from tinyserve.generate import generate
    return list(generate(model, list(prompt), n).tokens)[:n]


def check_tokens(model: Any, int8: dict[str, Any], peer: Worker, quick: bool) -> dict[str, Any]:
    """The f32 check on the fixed prompt (it must hold before anything is timed), then each
    8-bit model's leading greedy tokens kept of our fp32 model's over AGREE_PROMPTS prompts
    (``int8``: our int8 models by path name, run by the plain loop)."""
    vocab = model.config.vocab_size
    count = 2 if quick else AGREE_PROMPTS
    runs: dict[str, list[list[int]]] = {"fp32": [], **{name: [] for name in int8},
                                        "llamacpp_f32": [], "llamacpp_q8_0": []}
    for prompt in prompts(vocab, count, AGREE_PROMPT_TOKENS, seed=3):
        runs["fp32"].append(our_greedy(model, prompt, CHECK_TOKENS))
        for name, m in int8.items():
            runs[name].append(our_greedy(m, prompt, CHECK_TOKENS))
        for kind in GGUF_TYPES:
            runs[f"llamacpp_{kind}"].append(peer.ask(op="greedy", name=kind, prompt=prompt,
                                                     n=CHECK_TOKENS))
    equal = runs["fp32"][0] == runs["llamacpp_f32"][0]
    agreed = {name: agreement(runs["fp32"], r) for name, r in runs.items() if name != "fp32"}
    return {"fixed_prompt_equal_f32": equal, "prompts": count, "tokens_per_prompt": CHECK_TOKENS,
            "possible": count * CHECK_TOKENS, "leading_tokens_kept": agreed, "tokens": runs}


def our_decoders(model: Any, int8: dict[str, Any], prompt: Any,
                 fast: dict[str, Any]) -> dict[str, Any]:
    """Callables that each run STEPS greedy steps after ``prompt`` (1, T) and return seconds
    per step: the fastest compiled path for fp32 ("fast") and for the group-wise int8 model
    ("int8"), eager fp32 and eager per-row fbgemm int8 ("int8_rowwise"); and each compile's
    seconds."""
    import torch

    from tinyserve.backends.compiled import compiled_decoder
    from tinyserve.device import clock
    from tinyserve.generate import decode_step, prefill
    from tinyserve.kv_cache import KVCache
    from tinyserve.roofline import compile_settings

    T = prompt.shape[1]

    def stepped(step: Any, first: Any, reset: Any) -> Any:
        @torch.no_grad()
        def run() -> float:
            reset()
            tokens, pos = first, torch.full_like(first, T)
            start = clock(model.device)
            for _ in range(STEPS):
                tokens = step(tokens, pos).argmax(-1)
                pos = pos + 1
            return (clock(model.device) - start) / STEPS
        return run

    def compiled(m: Any) -> tuple[Any, float]:
        with compile_settings(fast["freezing"], 1):       # one row, as the loops'
            decoder = compiled_decoder(m, 1, mode=fast["mode"], backend=fast["backend"],
                                       tokens=T + STEPS)
            first = decoder.prefill(prompt)[:, -1].argmax(-1)
            start = clock(m.device)
            decoder.step(first, torch.full_like(first, T))          # compiles
            compile_s = clock(m.device) - start
        return stepped(decoder.step, first, lambda: None), compile_s

    def eager(m: Any) -> Any:
        cache = KVCache.for_model(m, 1, T + STEPS)
        with torch.no_grad():
            first = prefill(m, prompt, cache)[:, -1].argmax(-1)
        return stepped(lambda tokens, _pos: decode_step(m, tokens, None, cache), first,
                       lambda: cache.rewind([T]))

    (fast_fn, fast_s), (int8_fn, int8_s) = compiled(model), compiled(int8["int8"])
    fns = {"fast": fast_fn, "eager": eager(model), "int8": int8_fn,
           "int8_rowwise": eager(int8["int8_rowwise"])}
    return {"fns": fns, "compile_s": {"fast": fast_s, "int8": int8_s}}


def our_prefills(model: Any, int8: dict[str, Any], ids: Any) -> dict[str, Any]:
    """Callables that each prefill ``ids`` (1, T) into an empty cache, last logits only:
    "fast" as the loops run it with ``path="fast"`` (its linears on weights packed once where
    that measured faster here: ``tinyserve.backends.fast.eager_passes``, packed before the
    rounds), "fp32" plain eager, and each int8 model eager."""
    import contextlib

    import torch

    from tinyserve.backends.fast import eager_passes, prepare_eager
    from tinyserve.device import clock
    from tinyserve.generate import prefill
    from tinyserve.kv_cache import KVCache
    last = torch.tensor([ids.shape[1] - 1])

    def timed(m: Any, passes: Any = contextlib.nullcontext) -> Any:
        cache = KVCache.for_model(m, 1, ids.shape[1])

        @torch.no_grad()
        def run() -> float:
            cache.rewind([0])
            start = clock(m.device)
            with passes():
                prefill(m, ids, cache, logits_at=last)
            return clock(m.device) - start
        return run
    prepare_eager(model)
    return {"fast": timed(model, lambda: eager_passes(model, ids.shape[1])), "fp32": timed(model),
            **{name: timed(m) for name, m in int8.items()}}


# --- the run ------------------------------------------------------------------------------

def fastest_path(quick: bool) -> dict[str, Any]:
    """The compiled decoder's options: max-autotune with freezing (bench scale's fastest CPU
    path); ``--quick`` only traces (code generation takes minutes)."""
    if quick:
        return {"backend": "eager", "mode": None, "freezing": False}
    return {"backend": "inductor", "mode": "max-autotune", "freezing": True}


def timed_in_turns(model: Any, int8: dict[str, Any], peer: Worker,
                   quick: bool) -> dict[str, Any]:
    """Decode and prefill, ours and llama.cpp's, every path once a round (in_turns)."""
    import torch

    from ..common import in_turns
    vocab, rounds = model.config.vocab_size, QUICK_ROUNDS if quick else ROUNDS
    decode_prompt = prompts(vocab, 1, PROMPT_TOKENS, seed=0)[0]
    prefill_prompt = prompts(vocab, 1, PREFILL_TOKENS, seed=1)[0]
    fast = fastest_path(quick)
    ours = our_decoders(model, int8, torch.tensor([decode_prompt]), fast)
    decode_fns = dict(ours["fns"])
    prefill_fns = our_prefills(model, int8, torch.tensor([prefill_prompt]))
    for kind in GGUF_TYPES:
        decode_fns[f"llamacpp_{kind}"] = (lambda k=kind: peer.ask(
            op="decode", name=k, prompt=decode_prompt, n=STEPS))
        prefill_fns[f"llamacpp_{kind}"] = (lambda k=kind: peer.ask(
            op="prefill", name=k, prompt=prefill_prompt))
    decode_fns[READ_PROBE] = read_probe(quick)
    print(f"decode, {len(decode_fns)} paths in turns, {rounds} rounds ...", flush=True)
    decode = in_turns(decode_fns, rounds)
    read = decode.pop(READ_PROBE)
    kernels = kernel_probes(model.config, PREFILL_TOKENS)
    prefill_fns.update(kernels)
    print(f"prefill of {PREFILL_TOKENS} tokens, {len(prefill_fns)} paths in turns ...",
          flush=True)
    prefill = in_turns(prefill_fns, rounds)
    shape = f"{PREFILL_TOKENS} x {model.config.hidden_size} by {model.config.hidden_size} x " \
            f"{model.config.intermediate_size}"
    return {"decode_s": decode, "prefill_s": prefill, "rounds": rounds, "fastest_path": fast,
            "read_probe_bytes_per_s": read,
            "kernel_probes": {name: {"flops": runs[0][0], "seconds": [t for _, t in runs]}
                              for name, runs in ((k, prefill.pop(k)) for k in kernels)},
            "kernel_probe_shape": f"the prefill's up_proj: {shape}, fp32, one thread",
            "compile_s": {k: round(v, 1) for k, v in ours["compile_s"].items()},
            "roofline_timers_s": roofline_cross_check(model, torch.tensor([decode_prompt]), fast)}


#: The decode rounds' extra turn: the memory's read rate (roofline.read_bandwidth's best
#: way), so a decode step's read rate is held against what the memory gave in its round.
READ_PROBE = "read_probe"
#: The prefill rounds' extra turns: torch's two fp32 linear kernels at the prefill's largest
#: matmul shape, the FLOP rates a prefill made of that matmul could reach on this core.
KERNEL_PROBES = {"probe_mkl": "F.linear (MKL's sgemm, what the eager prefill runs)",
                 "probe_onednn": "oneDNN's linear over weights reordered once "
                                 "(mkldnn._linear_pointwise, the fast prefill's where it "
                                 "measured faster)"}


def read_probe(quick: bool) -> Any:
    """A call returning the memory's read rate, bytes/s (the probe the scale suite uses)."""
    from tinyserve.roofline import read_bandwidth
    nbytes = (16 if quick else 512) * 2**20
    return lambda: read_bandwidth("cpu", nbytes, 2).best


def kernel_probes(cfg: Any, rows: int) -> dict[str, Any]:
    """Calls returning (FLOPs, seconds) of one fp32 linear of the prefill's up_proj shape
    (``rows`` x hidden by hidden x intermediate), by :data:`KERNEL_PROBES` name: MKL's, and
    oneDNN's where this torch has it (the weight reordered once, as inductor packs it)."""
    import torch
    import torch.nn.functional as F

    from tinyserve.device import clock
    x = torch.randn(rows, cfg.hidden_size)
    w = torch.randn(cfg.intermediate_size, cfg.hidden_size)
    flops = 2 * rows * cfg.hidden_size * cfg.intermediate_size

    def timed(call: Callable[[], Any]) -> Callable[[], tuple[int, float]]:
        def run() -> tuple[int, float]:
            start = clock(x.device)
            call()
            return flops, clock(x.device) - start
        return run
    probes = {"probe_mkl": timed(lambda: F.linear(x, w))}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        probes["probe_onednn"] = timed(lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], ""))
    return probes


def roofline_cross_check(model: Any, prompt: Any, fast: dict[str, Any]) -> dict[str, float]:
    """The same two fp32 steps through the course's own timers (the fastest of 3 runs of
    STEPS; the compiled decoder is the one already built): the in-turns loop above should
    read about the same."""
    from tinyserve.roofline import compiled_step_seconds, eager_step_seconds
    compiled, _ = compiled_step_seconds(model, prompt, STEPS, 3, fast["backend"],
                                        mode=fast["mode"], freezing=fast["freezing"])
    return {"fast": compiled, "eager": eager_step_seconds(model, prompt, STEPS, 3)}


def summary_rows(timed: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for what, key, unit in (("decode step", "decode_s", 1e3), ("prefill", "prefill_s", 1e3)):
        for path, times in timed[key].items():
            rows.append([what, path, f"{unit * min(times):.2f}",
                         f"{unit * sorted(times)[len(times) // 2]:.2f}"])
    return rows


GOALS = {"scale_fast_vs_llamacpp_f32_decode": 0.9, "scale_int8_vs_llamacpp_q8_decode": 1.0,
         "scale_prefill_vs_llamacpp_f32": 1.0}   # at most (bench.headlines holds the ledger's)
_PAIRS = {"scale_fast_vs_llamacpp_f32_decode": ("decode_s", "fast", "llamacpp_f32"),
          "scale_int8_vs_llamacpp_q8_decode": ("decode_s", "int8", "llamacpp_q8_0"),
          "scale_prefill_vs_llamacpp_f32": ("prefill_s", "fast", "llamacpp_f32")}


def explain(ratios: dict[str, float], m: dict[str, Any],
            load: Sequence[float]) -> dict[str, str]:
    """A note for each missed goal, with the measurements beside it, and one for the load
    (``load``: the 1-minute averages before and after, judged as every report's ``load`` is:
    :func:`bench.machine_load.stamp`)."""
    from ..machine_load import stamp      # here, not at the top: the worker runs as a script
    notes: dict[str, str] = {}
    for name, (key, ours, theirs) in _PAIRS.items():
        if ratios.get(name, 0.0) > GOALS[name]:
            a, b = min(m[key][ours]), min(m[key][theirs])
            notes[name] = (f"missed: ours ({ours}) {1e3 * a:.2f} ms against llama.cpp "
                           f"({theirs}) {1e3 * b:.2f} ms, the fastest of each's rounds "
                           f"({a / b:.2f}x); the median same-round ratio is {ratios[name]:.2f}"
                           + _read_rates(m, key, ours, theirs)
                           + _flop_rates(m, key, ours, theirs))
    judged = stamp(load[0], load[-1]) if load else None    # the after figure holds our thread
    if judged and judged["busy"]:
        notes["load"] = (f"not a quiet machine: the 1-minute load average was {load[0]} before "
                         f"and {load[-1]} after, busy above {judged['busy_above']} less this "
                         "run's own thread (other work shared its cores). Every path was "
                         "timed in turns, so each ratio's pairs met the same load, but the "
                         "absolute times are not a quiet machine's")
    return notes


#: A decode step reading at this share of the read probe or more streams at the memory's rate.
STREAMING = 0.85


def _read_rates(m: dict[str, Any], key: str, ours: str, theirs: str) -> str:
    """'; ' and the rate each side read its weights at (bytes over its fastest step) beside
    the memory's (the read probe's best in the same rounds) and, for an 8-bit step, our fp32
    fast step's: a step reading well below the memory is held back by its kernel, and an 8-bit
    one reading below our fp32 step by its arithmetic. Empty for a prefill or a report without
    the bytes."""
    given = m.get("weight_bytes", {})
    sizes = {**given, "fast": given.get("fp32"), "eager": given.get("fp32")}   # one fp32 model
    if key != "decode_s" or not sizes.get(ours) or not sizes.get("fast"):
        return ""
    file = {"llamacpp_f32": "f32", "llamacpp_q8_0": "q8_0"}[theirs]
    theirs_bytes = m["gguf"]["files"][file]["bytes"]
    rate = {name: n / min(m[key][name]) / 1e9 for name, n in (
        (ours, sizes[ours]), ("fast", sizes["fast"]), (theirs, theirs_bytes))}
    text = (f"; read rates (weight bytes over the fastest step): ours {rate[ours]:.1f} GB/s "
            f"({sizes[ours] / 1e6:.0f} MB), llama.cpp {rate[theirs]:.1f} "
            f"({theirs_bytes / 1e6:.0f} MB of file)")
    memory = max(m.get("read_probe_bytes_per_s") or [0.0]) / 1e9
    if memory:
        text += (f", the memory {memory:.1f} (the read probe's best in the same rounds: ours at "
                 f"{rate[ours] / memory:.2f} of it, llama.cpp at {rate[theirs] / memory:.2f})")
    if ours in ("fast", "eager"):
        if memory and min(rate[ours], rate[theirs]) >= STREAMING * memory:
            return text + (": both steps stream the same fp32 bytes at about the memory's "
                           "rate, so on this machine neither can take much less time than "
                           "the other: the goal asks for more than the memory gives")
        return text + (": both read the same fp32 bytes, so the step that reads nearer the "
                       "memory's rate has the kernel that streams better on this core (ours: "
                       "torch's one-row fp32 matmul)")
    return text + (f", our fp32 fast step {rate['fast']:.1f}: an 8-bit step reading well below "
                   "the fp32 step's rate is bound by its arithmetic (ours turns each int8 "
                   "weight into a float and multiplies floats; q8_0 multiplies int8 blocks by "
                   "int8 blocks), not the memory")


def _flop_rates(m: dict[str, Any], key: str, ours: str, theirs: str) -> str:
    """'; ' and each side's FLOP rate over its fastest prefill beside the kernel probes of the
    same rounds (torch's fp32 linear kernels at the prefill's largest matmul), and how the
    same-round ratios spread: a 128-row prefill is bound by its matmuls' arithmetic, so the
    question is which kernel each side runs and how fast that kernel is on this core. Empty
    for a decode pass or a report without the probes."""
    probes, flops = m.get("kernel_probes"), m.get("prefill_flops")
    if key != "prefill_s" or not probes or not flops:
        return ""
    rate = {name: flops / min(m[key][name]) / 1e9 for name in (ours, theirs)}
    kernels = ", ".join(
        f"{KERNEL_PROBES.get(name, name)} {p['flops'] / min(p['seconds']) / 1e9:.0f}"
        for name, p in probes.items())
    pairs = same_round_ratios(m[key][ours], m[key][theirs])
    under = sum(r <= 1.0 for r in pairs)
    return (f"; FLOP rates ({flops / 1e9:.1f} GFLOP over the fastest prefill): ours "
            f"({ours}) {rate[ours]:.0f} GFLOP/s, llama.cpp {rate[theirs]:.0f}; torch's kernels at "
            f"{m.get('kernel_probe_shape', 'the largest matmul')} in the same rounds: "
            f"{kernels}; the same-round ratios ran {pairs[0]:.2f}-{pairs[-1]:.2f}, {under} of "
            f"{len(pairs)} at or under 1.0")


def load_model_for(quick: bool) -> tuple[Any, dict[str, Any]]:
    """The scale model in fp32 (one layer with ``quick``) and its int8 copies by path name:
    "int8", a scale per GROUP_SIZE weights; "int8_rowwise", per-row fbgemm W8A8."""
    import torch

    from tinyserve import load_model
    from tinyserve.quant import quantize_model
    model = load_model("bandwidth", device="cpu", dtype=torch.float32,
                       layers=1 if quick else None)
    return model, {"int8": quantize_model(model, group_size=GROUP_SIZE),
                   "int8_rowwise": quantize_model(model, kernel="fbgemm")}


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    problem = missing()
    if problem:
        print(problem, file=sys.stderr)
        raise SystemExit(2)
    from ..common import report, table, write_json
    model, int8 = load_model_for(quick)
    cfg = model.config
    load_before = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="tinyserve-llamacpp-") as tmp:
        work = Path(tmp)
        files = export_and_convert(model, work)
        with worker(work / "worker.log") as peer:
            off = extra_buffers_off_reason()        # llama.cpp's defaults unless they crash here
            loaded = {kind: peer.ask(op="load", name=kind, path=files["files"][kind]["path"],
                                     extra_buffers=off is None)
                      for kind in GGUF_TYPES}
            tokens = check_tokens(model, int8, peer, quick)
            if not tokens["fixed_prompt_equal_f32"]:
                raise RuntimeError(
                    "llama.cpp f32 does not reproduce our greedy tokens on the fixed prompt "
                    f"(ours {tokens['tokens']['fp32'][0]}, llama.cpp "
                    f"{tokens['tokens']['llamacpp_f32'][0]}): the export or the conversion is "
                    "wrong, so nothing is timed")
            timed = timed_in_turns(model, int8, peer, quick)
    ratios = compute_ratios(timed["decode_s"], timed["prefill_s"])
    print(table(["pass", "path", "fastest ms", "median ms"], summary_rows(timed)))
    from tinyserve.backends.fast import eager_kernels
    from tinyserve.quant import weight_bytes
    measurements = {"tokens": tokens, **timed, "gguf": files,
                    "weight_bytes": {"fp32": weight_bytes(model),
                                     **{k: weight_bytes(q) for k, q in int8.items()}},
                    "prefill_flops": prefill_flops(cfg, PREFILL_TOKENS),
                    "fast_prefill_kernel": eager_kernels(model).sentence(),
                    "llamacpp": {"llama_cpp_python": loaded["f32"]["version"],
                                 "system_info": loaded["f32"]["system_info"],
                                 "api": "llama_decode on llama_batch_get_one (low level)",
                                 "extra_buffer_types": extra_buffers_text(off)}}
    conditions = {"model": f"bandwidth (seeded random, hidden {cfg.hidden_size}, MLP "
                           f"{cfg.intermediate_size}, {cfg.num_hidden_layers} layers)",
                  "threads": "1 each (torch: set_num_threads(1); llama.cpp: n_threads=1)",
                  "prompt_tokens": PROMPT_TOKENS, "steps": STEPS,
                  "prefill_tokens": PREFILL_TOKENS, "timing": "in turns, median same-round ratio",
                  "load_average_1min": [load_before, round(os.getloadavg()[0], 2)]}
    data = report("llamacpp", ratios, measurements, conditions, quick)
    data["notes"] = explain(ratios, measurements, conditions["load_average_1min"])
    for name, text in data["notes"].items():
        print(f"{name}: {text}")
    write_json(data, json_path)
    return data


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        raise SystemExit(worker_main())
    raise SystemExit("run it as `python -m tinyserve bench llamacpp` (--worker: the peer's half)")
