"""tinyserve: a tiny Llama and the small serving engine a course builds around it.

Module map. The core is flat: the modules the chapters import, by chapter. The periphery
(serving, load generation, parallelism, course helpers) and the decode backends live in
subpackages; a subpackage's docstring says its rule.

The model (chapters 0-1)
    config          ``ModelConfig`` and the presets, with Hugging Face ``LlamaConfig`` names
    model           the tiny Llama: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention
    tokenizer       the byte-level BPE tokenizer (4,096 tokens)
    checkpoint      the shipped weights (safetensors), the sha256 manifest
    scale           the bandwidth-scale presets: the same model, random weights, sized so
                    that decode must read its weights from memory (``load_model("bandwidth")``)
    device          CPU by default, CUDA when present, ``TINYSERVE_DEVICE`` to override
    corpus, harbor_world, train   the synthetic Harbor tickets and the training run
    hf_export       the shipped model as a Hugging Face Llama folder

One request (chapters 0-2)
    sampling        greedy, temperature, top-k, top-p, seeded
    generate        the recompute loop and the cached loop with a clock (prefill, decode)
    prompts         the check every loop makes of a prompt first, and its PromptError
    kv_cache        the contiguous KV cache
    backends/       decode steps on fixed buffers, which the loops choose (the model knows
                    nothing of them); they import only config, device, toolchain, model,
                    kv_cache, paged and sampling, never a loop or roofline. ``static`` (StaticKVCache,
                    window_for, bucket_for), ``compiled`` (the step traced by
                    ``torch.compile``, opt-in), ``cuda_graph`` (the step captured once per
                    batch bucket and replayed: CUDA's default; the engine's graphs),
                    ``spec_graphs`` (speculation's passes), ``decoder_cache`` (the bounded,
                    least recently used first out cache of built decoders), ``fast`` (what
                    ``path="fast"`` runs here: the graphs on CUDA, the step compiled with the
                    fastest of compiled, packed and eager on a CPU; its kernel cache and
                    ``prepare``), ``choices`` (what each fast shape runs, timed in turns
                    here, kept on disk), ``packed`` (the eager passes' linears over weights
                    packed once for oneDNN), ``waits`` (a compile says what and about how
                    long before it starts, and shows its elapsed time while it runs)
    step_path       the loops' one switch, path=: how a decode step runs (auto, eager, graph,
                    compiled, fast), the same in generate, speculation and the engine
    toolchain       can torch.compile build CPU kernels here? one probe a process; the line
                    that says why not and how to fix it (python -m tinyserve.toolchain)
    graph_check     eager against graph decode, timed (python -m tinyserve.graph_check, gpu-check)
    roofline        what a decode step must read and compute vs what the machine can do
    metrics         TTFT, ITL, TPOT, E2E of a request; SLOs, goodput, percentiles
    long_context    decode at long context: caches filled directly, the KV crossover, the fit

Many requests (chapters 3-5)
    sequence        one request inside the engine: tokens, KV progress, trace
    block_manager   KV blocks as a pool: allocate on demand, reference counts, prefix caching
    paged           paged KV storage and attention through block tables
    scheduler       the iteration-level scheduler: who runs next step, how many tokens
    policies        queue policies: FCFS, shortest-prompt-first, size-aware
    engine          the continuous-batching engine: schedule, execute, post-process
    batching        left padding, the padded mask and the slot steps as plain functions
    workload        arrival processes and request-length distributions
    simulator       the engine on a virtual clock with a calibrated cost model

Cheaper tokens (chapters 6-8)
    quant           int8 weight-only quantization and the int8 KV cache
    parallel/       tensor (``tensor``) and pipeline (``pipeline``) parallelism, ``launch``
                    for the ranks, ``timing`` for the chapter's and ``bench parallel``'s runs
    speculative     draft-model and n-gram speculative decoding, rejection sampling
    draft_replay    a drafter for timing speculation at scale: real draft passes, a set acceptance
    spec_graphs     kept for the notebooks: re-exports ``backends.spec_graphs``

Serving (chapter 9)
    serving/        ``server`` (the OpenAI-compatible app), ``async_engine`` (the step loop
                    behind it), ``api_schema`` (request bodies, chat template),
                    ``server_metrics`` (Prometheus), ``options`` (the server's knobs
                    and defaults), ``routing`` (replicas), ``local_servers`` (our server
                    on a free port)
    loadgen/        ``generator`` (arrivals, streamed requests, summaries), ``prompts``,
                    ``cli`` (``python -m tinyserve loadgen``), ``plot``

Around it
    workbook/       course helpers: ``capacity`` (KV memory), ``lab`` (the KV calculator
                    widget), ``predict`` (commit a guess, then measure), ``roofline_lab``
                    (predict where decode stops being memory-bound), ``scale_sweeps`` (the
                    sweeps chapters 2 and 3 run at both scales), ``plots``,
                    ``model_card``, ``markers`` (README sections a command writes),
                    ``study_time`` (estimated working time per notebook), ``course_runs``
                    (the reports in bench/results, read where a chapter cites them),
                    ``fast_lab`` (the shapes and timings of the fast path in chapters 1, 3,
                    6b and 8; quick mode), ``engine_lab`` (the engine at the wall:
                    requests served at once, chapter 9 and ``bench scale``), ``kv_regime``
                    (chapter 6b's long-context section: its contexts and lines)
    paths           ``ASSETS``: where the shipped files are, in a checkout or installed
    provenance      the machine and commit recorded with every benchmark report
    tables          the plain-text table every report prints
    __main__        ``python -m tinyserve COMMAND``
"""
import re as _re

import torch as _torch

#: The oldest torch this package runs on: ``F.rms_norm`` is 2.4+, SDPA's ``enable_gqa``
#: 2.5+, and on 2.4 the CPU's flash kernel returns a layout the model did not expect. Also
#: the floor pyproject.toml and environment.yml declare (tests/test_torch_floor.py), and the
#: one ``make torch-floor`` installs and runs every decoding path on.
TORCH_FLOOR = (2, 5)


def check_torch_version(version: str) -> None:
    """Raise ImportError, naming the floor and how to upgrade, if ``version`` (torch's
    ``__version__``: ``2.13.0+cpu``, ``2.5.0a0+git...`` of a source build) is older."""
    found = _re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(map(int, found.groups())) >= TORCH_FLOOR:
        return
    floor = ".".join(map(str, TORCH_FLOOR))
    raise ImportError(
        f"tinyserve needs torch >= {floor}, but this environment has torch {version} "
        f"(older ones lack F.rms_norm or SDPA's enable_gqa). Upgrade it first, e.g. "
        f"pip install \"torch>={floor}\" (on a GPU, the build for your CUDA: README, \"Which torch\"), "
        f"then import tinyserve again.")


check_torch_version(_torch.__version__)

from .checkpoint import load_model  # noqa: E402 - after the torch check, which they need
from .config import PRESETS, ModelConfig  # noqa: E402
from .device import default_device, default_dtype  # noqa: E402
from .model import TinyLlama  # noqa: E402

__all__ = ["ModelConfig", "PRESETS", "TORCH_FLOOR", "TinyLlama", "check_torch_version",
           "default_device", "default_dtype", "load_model", "load_tokenizer"]


def load_tokenizer():  # type: ignore[no-untyped-def]
    """The shipped tokenizer (imported lazily: only text-facing code needs ``tokenizers``)."""
    from .tokenizer import load_tokenizer as _load
    return _load()
