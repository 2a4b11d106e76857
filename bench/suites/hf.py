"""Our cached greedy loop vs ``transformers``' ``generate()``, and the decode roofline.

**vs generate()**: the same weights (exported with ``write_hf_checkpoint``), the same device,
fp32, greedy, the same prompts and the same number of new tokens (no early stop). The run
asserts both produce identical tokens, then reports ``vs_hf_generate_bN`` = HF time / our
time (greater than 1: we are faster). The three loops run in turns, round after round, and
each ratio is the median of the rounds' ratios (see ``bench.common.interleaved_seconds``:
on a shared machine, timing one loop's runs and then the other's folds the machine's
drift into the ratio). Batch 8 uses eight prompts cut to one length, so
neither side needs padding.

**Roofline**: a decode step at batch 1 must read every weight and the cached keys and values
once, so it cannot beat (weight bytes + KV bytes) / memory bandwidth. The suite measures the
bandwidth as the course's one reference, the fastest of three ways to read a buffer far past
the cache (:func:`~tinyserve.roofline.read_bandwidth`; runs before issue 38 took a copy's
figure), and reports that floor next to the per-token time we reach (our
TPOT at batch 1). ``decode_roofline_fraction`` = floor / achieved: 1.0 would be
bandwidth-bound; far below it, per-step overheads dominate. (On a CPU a 25 MB model partly
fits in the last-level cache, so a floor from a read far past the cache is a conservative one.)

**Yardstick**: :mod:`bench.suites._plain_loop`, greedy decoding in one plain function over the same
weights (no modules, no cache class, no mask), timed in the same run and asserted to give
the same tokens. ``plain_loop_vs_ours_bN`` = our time / its time: how much of our step is
the engine's generality rather than arithmetic (1.0: none).

``--quick`` runs the same code on a tiny random model; its figures mean nothing.
"""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import replace
from typing import Any

import torch

from tinyserve.workbook.capacity import GB, kv_bytes_for_config
from tinyserve.corpus import example_prompts
from tinyserve.device import default_device
from tinyserve.generate import generate_compiled
from tinyserve.generate import generate, generate_batch
from tinyserve.hf_export import write_hf_checkpoint
from tinyserve.metrics import tpot
from tinyserve.model import TinyLlama
from tinyserve.roofline import read_bandwidth
from tinyserve.tokenizer import load_tokenizer

from ..common import (QUICK_CONFIG, interleaved_seconds, load_bench_model, median_ratio, report,
                     table, write_json)
from ._plain_loop import plain_greedy

#: ``bench hf --compile`` times our side with the compiled decode step.
COMPILABLE = True


def _model(quick: bool) -> tuple[TinyLlama, str]:
    if not quick:
        return load_bench_model(False)
    # The quick model must share the tokenizer's vocabulary and special ids: the export
    # writes the tokenizer next to the weights.
    tok = load_tokenizer()
    cfg = replace(QUICK_CONFIG, vocab_size=tok.vocab_size, max_position_embeddings=128,
                  bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    return load_bench_model(True, quick_config=cfg)


def _hf_generate(hf: Any, ids: torch.Tensor, n: int) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0, top_k=None, top_p=None, temperature=None)
    return out[:, ids.shape[1]:].tolist()


def _roofline(model: TinyLlama, prompt: list[int], prompt_len: int, n_new: int, repeats: int,
              quick: bool, compile: bool) -> tuple[float, dict[str, Any]]:
    """Batch 1: the bytes one decode step must read over the bandwidth vs our TPOT (the
    fastest of ``repeats`` generations)."""
    device = model.device
    bandwidth = read_bandwidth(device, (16 if quick else 512) * 2**20).best  # the one reference
    weight_bytes = model.num_parameters() * model.dtype.itemsize
    mid_context = prompt_len + n_new // 2
    kv_bytes = kv_bytes_for_config(model.config, mid_context, model.dtype)
    floor = (weight_bytes + kv_bytes) / bandwidth
    achieved = [x for x in (tpot(generate(model, prompt, n_new, path="compiled" if compile else "auto"))
                            for _ in range(repeats))
                if x is not None]
    # The fastest run, as the bandwidth is the fastest read (tinyserve.roofline: other
    # programs only ever slow a run down): a median here against a best there understated
    # the fraction by however busy the machine was while generating.
    achieved_s = min(achieved)
    print(f"\ndecode roofline, batch 1: bandwidth {bandwidth / GB:.1f} GB/s; reads "
          f"{(weight_bytes + kv_bytes) / 1e6:.1f} MB per token -> floor {floor * 1e3:.3f} ms; "
          f"achieved {achieved_s * 1e3:.3f} ms ({floor / achieved_s:.0%} of the bound)")
    return floor / achieved_s, {
        "bandwidth_gb_per_s": bandwidth / GB, "weight_bytes": weight_bytes,
        "kv_bytes_at_mid_context": kv_bytes, "mid_context": mid_context,
        "floor_ms_per_token": floor * 1e3, "achieved_ms_per_token": achieved_s * 1e3}


def run(json_path: str | None = None, quick: bool = False, compile: bool = False) -> dict[str, Any]:
    import transformers

    device = default_device()
    model, name = _model(quick)
    tok = load_tokenizer()
    n_new, prompt_len, repeats = (8, 16, 2) if quick else (128, 64, 7)
    prompts = [tok.encode(p)[:prompt_len] for p in example_prompts(8)]
    if min(map(len, prompts)) < prompt_len:
        raise RuntimeError(f"an example prompt is shorter than {prompt_len} tokens")

    with tempfile.TemporaryDirectory() as folder:
        write_hf_checkpoint(model, tok, folder)   # moves our model to CPU fp32
        hf = transformers.LlamaForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=torch.float32).to(device).eval()
    model = model.to(device)

    rows, ratios, measured = [], {}, {}
    for batch in (1, 8):
        ids = torch.tensor(prompts[:batch], device=device)
        ours_out: dict[str, list[list[int]]] = {}

        def ours() -> None:
            if batch == 1:
                ours_out["tokens"] = [generate(model, prompts[0], n_new, path="compiled" if compile else "auto").tokens]
            elif compile:
                ours_out["tokens"] = generate_compiled(model, prompts[:batch], n_new)
            else:
                ours_out["tokens"] = generate_batch(model, prompts[:batch], n_new)

        theirs_out: dict[str, list[list[int]]] = {}

        def theirs() -> None:
            theirs_out["tokens"] = _hf_generate(hf, ids, n_new)

        plain_out: dict[str, list[list[int]]] = {}

        def plain() -> None:
            plain_out["tokens"] = plain_greedy(model, prompts[:batch], n_new)

        runs = interleaved_seconds({"ours": ours, "generate": theirs, "plain": plain},
                                   device, repeats)
        t_ours, t_hf, t_plain = (statistics.median(runs[k]) for k in ("ours", "generate", "plain"))
        if not ours_out["tokens"] == theirs_out["tokens"] == plain_out["tokens"]:
            raise RuntimeError(f"batch {batch}: our greedy tokens, generate()'s and the plain "
                               f"loop's are not all equal")
        vs_hf, vs_plain = (median_ratio(runs["generate"], runs["ours"]),
                           median_ratio(runs["ours"], runs["plain"]))
        ratios[f"vs_hf_generate_b{batch}"] = vs_hf
        ratios[f"plain_loop_vs_ours_b{batch}"] = vs_plain
        measured[f"b{batch}"] = {"ours_s": t_ours, "hf_generate_s": t_hf, "plain_loop_s": t_plain,
                                 "rounds_s": runs,
                                 "new_tokens": n_new, "prompt_tokens": prompt_len,
                                 "ours_tokens_per_s": batch * n_new / t_ours,
                                 "hf_tokens_per_s": batch * n_new / t_hf}
        rows.append([batch, t_ours, t_hf, t_plain, batch * n_new / t_ours,
                     batch * n_new / t_hf, vs_hf, vs_plain])
    print(f"greedy, {prompt_len}-token prompts, {n_new} new tokens ({name}, {device}, fp32, "
          f"{repeats} rounds taken in turns: median times, ratios the median of the rounds' "
          f"ratios; transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} torch thread(s))")
    print(table(["batch", "ours s", "generate() s", "plain loop s", "ours tok/s",
                 "generate() tok/s", "generate()/ours", "ours/plain loop"], rows), flush=True)

    ratios["decode_roofline_fraction"], measured["roofline"] = _roofline(
        model, prompts[0], prompt_len, n_new, repeats, quick, compile)

    data = report("hf", ratios=ratios, measurements=measured,
                  conditions={"model": name, "device": str(device), "dtype": "float32",
                              "ours": "compiled decode step" if compile else "eager",
                              "sampling": "greedy", "repeats": repeats,
                              "prompt_tokens": prompt_len, "new_tokens": n_new},
                  quick=quick)
    write_json(data, json_path)
    return data
