"""Facts the course states about the libraries it runs on, held where a test can hold them
(issue 27): if a new PyTorch changes one, the sentence that states it fails here first."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from tinyserve import load_model
from tinyserve.generate import decode_step, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.loadgen.generator import _token_text


def test_mixed_integer_and_tensor_index_keeps_dimension_order() -> None:
    # build_kv_cache's indexing tip: in PyTorch, k[layer, :, positions] is (heads, T, d);
    # NumPy would put the positions first.
    k = torch.zeros(4, 2, 10, 5)
    positions = torch.tensor([1, 2, 7])
    assert k[1, :, positions].shape == (2, 3, 5) == k[1][:, positions].shape


def test_sdpa_returns_zeros_for_a_row_that_reads_nothing() -> None:
    # build_batching's mask rule: SDPA gives zeros (not NaN) for an empty row since 2.5, while
    # a hand-written softmax gives NaN, which the next layer spreads through 0 x NaN.
    q = k = v = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    real = torch.tensor([False, True, True])
    mask = torch.ones(3, 3, dtype=torch.bool).tril() & real[None, :]     # the pad's row is empty
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[0, 0, 0], torch.zeros(4)) and not out.isnan().any()
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
    by_hand = scores.softmax(-1) @ v
    assert by_hand[0, 0, 0].isnan().all() and not by_hand[0, 0, 1:].isnan().any()
    again = (by_hand @ by_hand.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1) @ by_hand
    assert again.isnan().all()                  # a masked weight of 0 times the pad's NaN value


def test_a_decode_step_dispatches_a_few_hundred_operations() -> None:
    # Chapters 1, 3, 6, 6b and 8: "a few hundred small operations", "a few dozen per layer".
    model = load_model("target", device="cpu", dtype=torch.float32).eval()
    ids = torch.randint(4, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model, 1, 17)
    with torch.no_grad():
        token = prefill(model, ids, cache)[:, -1].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode_step(model, token, torch.tensor([16]), cache)
    ops = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))
    assert 150 <= ops <= 500
    assert 24 <= ops / model.config.num_hidden_layers <= 72


def test_a_role_only_opening_chunk_is_no_token() -> None:
    # The serving exercise's counting rule and the load generator's agree on vLLM's first chunk.
    assert _token_text({"index": 0, "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None}, chat=True) is None
    assert _token_text({"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                        "finish_reason": None}, chat=True) == "Hi"
    assert _token_text({"index": 0, "delta": {"content": ""}, "finish_reason": None},
                       chat=True) == ""


# --- issue 38: figures of the course's runs, one MBU reference, ridges with their threads ---

import ast  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

from tinyserve import roofline  # noqa: E402
from tinyserve.workbook import course_runs, scale_sweeps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "course").glob("*.ipynb"))
# A figure a sentence could quote: a ratio, a time, a share, a rate ("1.2 to 1.5 times").
FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s*(?:-|to)\s*\d+(?:\.\d+)?)?\s*"
                    r"(?:x|ms|%|GB/s|times)(?!\w)")
# A paragraph that speaks of the course machine's stored runs.
CITES_A_RUN = re.compile(r"bench/results|course's (?:2-core )?(?:machine|run)|course machine|"
                         r"quiet run")


def _cells(path: Path, kind: str) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]
            if c["cell_type"] == kind]


def test_a_course_run_is_read_in_a_cell_never_typed() -> None:
    # Chapters 8 and 9 quoted runs the results files no longer held (issue 38, findings 1-2):
    # a paragraph that speaks of the course's runs quotes no figure; a cell reads it.
    typed = [(p.name, FIGURE.findall(para)) for p in CHAPTERS for text in _cells(p, "markdown")
             for para in text.split("\n\n") if CITES_A_RUN.search(para) and FIGURE.search(para)]
    assert not typed, f"figures of a course run typed into prose (read them in a cell): {typed}"
    reads = {p.name for p in CHAPTERS if "course_run(" in "\n".join(_cells(p, "code"))}
    assert {"08_speculative_decoding.ipynb", "09_serving.ipynb"} <= reads, reads


def test_course_runs_read_the_stored_reports_and_say_when_absent(tmp_path: Path) -> None:
    peers = course_runs.course_run("peers")
    if course_runs.RESULTS is not None:            # a checkout: the reports are there
        assert peers is not None and "server_vs_transformers_output_throughput_prefix_on_c1" \
            in peers["ratios"]
        assert course_runs.provenance(peers).startswith("bench peers, ")
    assert course_runs.course_run("peers", tmp_path) is None
    assert course_runs.course_run("peers", None) is None
    assert "not here" in course_runs.missing("peers")
    assert course_runs.span([1.01, 0.88, 0.95]) == "0.88-1.01"
    assert course_runs.span([-8.0, -0.2], "{:+.1f}") == "-8.0 to -0.2"
    assert course_runs.span([1.234, 1.231]) == "1.23"


def test_one_bandwidth_reference_and_one_flop_ceiling() -> None:
    # Finding 4: MBU divides by the fastest read everywhere (a copy or a matvec alone inflated
    # it); finding 13: one way to measure the FLOP ceiling on each device.
    for path in CHAPTERS:
        code = "\n".join(_cells(path, "code"))
        assert "memory_bandwidth(" not in code, f"{path.name}: use read_bandwidth(...).best"
        assert "matmul_flops(" not in code, f"{path.name}: use flop_ceiling or measure_ceilings"
        for cell in _cells(path, "code"):
            for reference in _mbu_references(cell):
                assert ".best" in reference, \
                    f"{path.name}: mbu(..., {reference}, ...) must divide by the fastest read"
    assert "ReadBandwidth.best" in roofline.mbu.__doc__
    assert roofline.CEILING_MATMUL_N == {"cpu": 1024, "cuda": 8192}
    assert scale_sweeps.flop_ceiling is roofline.flop_ceiling
    # ...and the suites whose reports the chapters cite divide by the same two ceilings.
    for suite in ("decode", "hf", "scale"):
        code = (ROOT / "bench" / "suites" / f"{suite}.py").read_text()
        assert "memory_bandwidth(" not in code and "4096 if" not in code, suite


def test_chapter_ones_matmul_lines_are_the_flop_ceilings_ways(monkeypatch) -> None:
    # Chapter 1 prints each way the ceiling's matmul ran (MKL's a @ b ran at 0.44 of oneDNN's on
    # an AMD EPYC) and takes the fastest: the same measurement as flop_ceiling's, at its size.
    sizes = []
    monkeypatch.setattr(roofline, "matmul_ways",
                        lambda device, dtype, n, *_: sizes.append(n) or {"aten": 1e9, "onednn": 2e9})
    assert scale_sweeps.ceiling_ways("cpu") == {"aten": 1e9, "onednn": 2e9}
    assert roofline.flop_ceiling("cpu") == 2e9
    assert sizes == [scale_sweeps.CEILING_MATMUL_N["cpu"]] * 2
    code = "\n".join(_cells(ROOT / "course" / "01_prefill_vs_decode.ipynb", "code"))
    assert "flop_rate = max(matmuls.values())" in code and "ceiling_ways(" in code


def test_measure_ceilings_takes_the_flop_ceiling_and_records_threads(monkeypatch) -> None:
    sizes = []
    monkeypatch.setattr(roofline, "matmul_flops",
                        lambda device, dtype, n: sizes.append(n) or 1e9)
    c = scale_sweeps.measure_ceilings("cpu", nbytes=4 * 2**20)
    assert sizes == [scale_sweeps.CEILING_MATMUL_N["cpu"]]
    assert c.threads == torch.get_num_threads()
    assert f"on {c.threads} torch thread" in c.describe()


def _calls(source: str, name: str) -> list[ast.Call]:
    try:
        tree = ast.parse(source.replace("%matplotlib inline", ""))
    except SyntaxError:                          # another IPython magic: nothing to check
        return []
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == name]


def _mbu_references(source: str) -> list[str]:
    """The bandwidth argument (the second) of every ``mbu(...)`` call in a cell."""
    clean = source.replace("%matplotlib inline", "")
    return [ast.get_source_segment(clean, call.args[1]) or "" for call in _calls(source, "mbu")
            if len(call.args) > 1]


# A printed ridge: a value formatted next to the word, or this machine's FLOP rate / bandwidth.
RIDGE = re.compile(r"ridge[^\"{}]{0,12}\{|\{[^}]*ridge|\{[^}]*flop_rate\s*/\s*bandwidth")


def test_every_measured_ridge_is_printed_with_its_thread_count() -> None:
    # Finding 9: chapters 1 and 6b run torch's default threads, 2-9 one; a ridge holds for its
    # thread count, so each printed ridge says it (datasheet ridges excepted).
    bare = [(p.name, line) for p in CHAPTERS for cell in _cells(p, "code")
            for line in (ast.get_source_segment(cell.replace("%matplotlib inline", ""), call)
                         or "" for call in _calls(cell, "print"))
            if RIDGE.search(line) and "sheet" not in line
            and "thread" not in line and ".describe()" not in line]
    assert not bare, f"a ridge printed without its thread count: {bare}"


def test_the_measurements_the_prose_now_rests_on_are_in_the_cells() -> None:
    # Finding 3: on a GPU chapter 6 times int8 through quantize_model's CUDA choice, not a skip;
    # finding 5: chapter 8 prices c and v on the passes its runs replay (CUDA graphs on a GPU);
    # finding 7: chapter 7 sets the split against one process on two threads as well.
    code = {p.name: "\n".join(_cells(p, "code")) for p in CHAPTERS}
    assert 'quantize_model(big, kernel="auto")' in code["06_quantization.ipynb"]
    assert "int8 skipped on CUDA: it runs there only" not in code["06_quantization.ipynb"]
    assert "static_passes(" in code["08_speculative_decoding.ipynb"]
    assert "for n in (1, 2):" in code["07_parallelism.ipynb"] \
        and "torch.set_num_threads(n)" in code["07_parallelism.ipynb"]
    # Finding 16: chunked prefill is SARATHI's (arXiv:2308.16369), before Sarathi-Serve.
    assert "2308.16369" in "\n".join(_cells(ROOT / "course" / "05_scheduling.ipynb", "markdown"))


# --- issue 52: one name per cause, the two bounds, one MBU per path, one TP bound ---------

import inspect  # noqa: E402

from tinyserve.workbook import fast_lab, roofline_lab  # noqa: E402


def _text(name: str, kind: str) -> str:
    return "\n".join(_cells(ROOT / "course" / name, kind))


def test_the_rule_names_a_kernel_below_the_roof_where_the_chapters_probe_one() -> None:
    # M1: a step far off its roofline is kernel-bound when its matmuls alone explain the gap;
    # the chapters that name an eager step at scale (or a recompute, a prefill) pass the probe.
    assert "kernel-bound" in roofline_lab.REGIMES
    for name in ("01_prefill_vs_decode.ipynb", "02_kv_cache.ipynb", "03_batching.ipynb",
                 "06_quantization.ipynb", "08_speculative_decoding.ipynb"):
        code = _text(name, "code")
        assert "kernel_s=" in code and "kernel_probe_seconds(" in code, name
    stale = [p.name for p in CHAPTERS if "kernel slower than the machine's best" in
             "\n".join(_cells(p, "markdown") + _cells(p, "code"))]
    assert not stale, f"the old overhead-bound wording: {stale}"


def test_the_two_bounds_are_taught_and_printed_together() -> None:
    # M4: max() is the perfect-overlap bound, the sum the no-overlap one; chapters 3 and 8
    # print both beside each measurement and say which this machine followed.
    for name in ("03_batching.ipynb", "08_speculative_decoding.ipynb"):
        assert "two_bounds(" in _text(name, "code"), name
        md = _text(name, "markdown")
        assert "perfect" in md and "overlap" in md and "sum" in md, name
    assert "roofline_knee(*knee_args, overlap=False)" in _text("03_batching.ipynb", "code")
    old = ("ride along nearly free", "prices the pass at about one step")
    stale = [(p.name, o) for p in CHAPTERS for o in old if o in "\n".join(_cells(p, "markdown"))]
    assert not stale, stale


def test_one_batch1_mbu_per_path_in_the_scale_report() -> None:
    # I7: the report's batch-1 MBU is the loops' step against the run's fastest read, one per
    # path; the rows sweep no longer reports a second one, and no chapter reads it.
    from bench.suites import scale
    assert '"mbu_b1": {"eager"' not in inspect.getsource(scale.roofline_figures)
    for p in CHAPTERS:
        assert "['mbu_b1']" not in "\n".join(_cells(p, "code")), p.name
    for name in ("01_prefill_vs_decode.ipynb", "06b_decode_roofline.ipynb"):
        assert "loops['mbu_fast']" in _text(name, "code"), name


def test_one_tp_bandwidth_bound_in_chapter_7_and_bench_scale() -> None:
    # I3: the chapter's definition, the read gain times the bytes the split saves.
    from bench.suites import scale
    assert "tp_bandwidth_bound(" in _text("07_parallelism.ipynb", "code")
    assert "tp_bandwidth_bound(" in inspect.getsource(scale.tensor_parallel)
    assert "second bus" not in "\n".join(_cells(ROOT / "course" / "07_parallelism.ipynb", "code"))


def test_the_quick_mode_knee_and_k_are_stated_as_the_code_runs() -> None:
    # I8: a knee past the rows timed is graded as a lower limit; W2: chapter 8's quick k.
    code, md = _text("03_batching.ipynb", "code"), _text("03_batching.ipynb", "markdown")
    assert "record_past(FAST_ROWS[-1])" in code and "past the rows timed" in md
    said = re.findall(r"or (\d+) in quick mode", _text("08_speculative_decoding.ipynb", "markdown"))
    assert said and all(int(k) == fast_lab.QUICK_K for k in said), said


def test_chapter_8_says_which_acceptance_each_figure_uses() -> None:
    # W1: the replay at the trained pair's per-draft a (not 0.8, not the acceptance rate),
    # and a lower a priced beside the break-even.
    name = "08_speculative_decoding.ipynb"
    md, code = _text(name, "markdown"), _text(name, "code")
    assert "sets 0.8" not in md and "trained pair's per-draft *a*" in md
    assert "A_LOW" in code and "break-even" in code
    assert "nearly vanish" not in md                            # the draft's share is printed


def test_chapters_3_and_5_leave_regimes_to_the_rule() -> None:
    # the partly fixed findings: no regime test of their own beside the rule
    assert "predicted / 1.5" not in _text("03_batching.ipynb", "code")
    assert "1.3 * lin[1]" not in _text("03_batching.ipynb", "code")
    assert "1 / 1.5 < ms_per_token" not in _text("05_scheduling.ipynb", "code")
    assert "regime_of(" in _text("05_scheduling.ipynb", "code")


def test_the_course_machine_is_named_and_the_l2_is_a_gpus_class() -> None:
    # M3: no sentence speaks of "the course machine" without saying which; I1: only
    # A100/H100-class L2s hold the shipped model.
    vague = re.compile(r"course machine|course's machine")
    named = [(p.name, para[:80]) for p in [*CHAPTERS, ROOT / "START_HERE.ipynb"]
             for text in _cells(p, "markdown") for para in text.split("\n\n")
             if vague.search(para) and "EPYC" not in para]
    assert not named, named
    gpu_l2 = [p.name for p in CHAPTERS if "in a GPU's L2" in "\n".join(_cells(p, "markdown"))]
    assert not gpu_l2, gpu_l2


def test_the_eager_gemm_is_taught_as_a_per_call_and_a_per_row_cost() -> None:
    # M2: repacking is per call; the per-row slope is the library's rate (printed in GFLOP/s)
    old = ("repacks the weights", "packs the weights again at every call",
           "packed again at every call", "packs its weights at every call")
    files = [*CHAPTERS, ROOT / "tinyserve" / "backends" / "packed.py",
             ROOT / "tinyserve" / "workbook" / "engine_lab.py"]
    stale = [(f.name, o) for f in files for o in old if o in f.read_text()]
    assert not stale, stale
    assert "per_row_flops(" in _text("03_batching.ipynb", "code")


def test_q8_0s_block_and_the_8b_steps_bytes_are_counted_as_read() -> None:
    # I4: q8_0 stores an fp16 scale per 32 (34 bytes), ours fp32 (36); I9: a decode step
    # reads one row of the input embedding, not the table.
    name = "06b_decode_roofline.ipynb"
    md, code = _text(name, "markdown"), _text(name, "code")
    assert "34 bytes" in md and "36" in md and "(32 + 2) / 32" in code
    assert "- embedding_8b" in code
    assert "fp16" in (ROOT / "tinyserve" / "quant.py").read_text()


def test_start_heres_run_times_cover_its_table() -> None:
    # I2: the opening sentence may not cap a chapter's run below what the table states.
    text = _cells(ROOT / "START_HERE.ipynb", "markdown")[0]
    table = "\n".join(_cells(ROOT / "START_HERE.ipynb", "markdown"))
    longest = max(int(m) for m in re.findall(r"\| \d+-(\d+) min \|", table)
                  + re.findall(r"\| about (\d+) min \|", table) or ["0"])
    if longest > 2:
        assert "about two minutes" not in text and "a minute or two" not in text
