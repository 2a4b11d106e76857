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
