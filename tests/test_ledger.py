"""The benchmark ledger is rendered, never typed: the READMEs' tables are the rendering of
the committed reports (a hand edit fails here), the rendering judges provenance (no commit,
a --quick run, code changed since), and ``bench compare`` marks a ratio that moved the wrong
way. Small fixture reports and a throwaway git repository; nothing is timed."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from bench import ledger
from bench.compare import HostMismatch, changes, load_report, render
from bench.headlines import SUITES, Goal
from bench.machine_load import busy_threshold, busy_warning, stamp
from bench.run_all import replace_results
from bench.staleness import is_shallow
from tinyserve.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_readmes_hold_the_rendering_of_the_committed_results() -> None:
    if is_shallow(ROOT):
        pytest.skip("a shallow clone lacks the commits the results were measured at")
    stale = ledger.differences(ROOT)
    assert not stale, (f"{stale} differ from what bench/results/ renders: never edit them by "
                       f"hand; run `python -m tinyserve bench ledger --write` and commit")


def benchmarks_prose() -> str:
    """README's Benchmarks section, the generated table cut out."""
    text = (ROOT / "README.md").read_text()
    part = text.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    return re.sub(r"<!-- bench-ledger:begin -->.*<!-- bench-ledger:end -->", "", part, flags=re.S)


def test_the_benchmarks_prose_quotes_no_measured_figure() -> None:
    # A ratio (1.5x), a time (3.2 ms, 17 s), a share (34%), a rate (12.7 GB/s, req/s): those
    # come from the rendering only. Counts of things (a 384-token prompt, 16 rows) may stay.
    figure = re.compile(r"\b\d+(\.\d+)?\s?(x\b|ms\b|s\b|%|GB/s|GFLOP/s|req/s|tok/s)")
    found = [m.group(0) for m in figure.finditer(benchmarks_prose())]
    assert not found, f"figures typed by hand in README's Benchmarks prose: {found}"


def test_every_declared_suite_has_sources_that_exist() -> None:
    missing = [(s.suite, p) for s in SUITES for p in s.sources if not (ROOT / p).exists()]
    assert not missing, f"declared source paths that do not exist: {missing}"


#: What a suite's own module may import that times its figures, and the source paths a
#: change to it must make stale (issue 39: the timing loop moved into tinyserve/device.py).
_TIMED_THROUGH = {"tinyserve.roofline": ("tinyserve/roofline.py", "tinyserve/device.py"),
                  "tinyserve.device": ("tinyserve/device.py",),
                  "median_seconds": ("bench/common.py", "tinyserve/device.py"),
                  "interleaved_seconds": ("bench/common.py", "tinyserve/device.py"),
                  "in_turns": ("bench/common.py", "tinyserve/device.py")}


@pytest.mark.parametrize("suite", [s for s in SUITES
                                   if (ROOT / "bench" / "suites" / f"{s.suite}.py").exists()],
                         ids=lambda s: s.suite)
def test_a_suite_goes_stale_when_the_code_that_times_it_changes(suite) -> None:
    text = (ROOT / "bench" / "suites" / f"{suite.suite}.py").read_text()
    needed = {p for name, paths in _TIMED_THROUGH.items()
              if re.search(rf"\b{re.escape(name)}\b", text) for p in paths}
    missing = sorted(needed - set(suite.sources))
    assert not missing, f"bench {suite.suite} times through {missing}, not among its sources"


# ---- the rendering, on fixture reports in a throwaway repository -----------------------

def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def spec_report(commit: str | None, **extra: object) -> dict:
    return {"suite": "spec", "quick": False, "git_commit": commit,
            "date": "2026-12-01T07:08:30+00:00",
            "ratios": {"spec_speedup_k4": 1.34, "ngram_speedup_k4": 2.1, "spec_acceptance_k4": 0.85},
            "measurements": {"runs": {"spec_k4": {"speedup": 1.34}},
                             "pass_costs_by_batch": [{"batch": 1, "spec_predicted_speedup_k4": 2.0}]},
            "load": {"before": 0.42, "after": 1.31, "busy_above": 1.5, "busy": False}, **extra}


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    """A git repository holding the spec suite's sources, one commit."""
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    for path in ("bench/suites/spec.py", "tinyserve/speculative.py", "tinyserve/generate.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("def step(x):\n    return x + 1  # why\n")
    (tmp_path / "bench/results").mkdir(parents=True)
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "sources")
    return tmp_path


def write_spec(repo: Path, report: dict) -> None:
    (repo / "bench/results/spec.json").write_text(json.dumps(report))


def spec_rows(repo: Path) -> dict[str, ledger.Row]:
    rows, _ = ledger.ledger_rows(repo)
    return {r.ratio.strip("`"): r for r in rows if r.suite == "spec"}


def test_a_row_shows_value_goal_met_commit_date_and_load(repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    write_spec(repo, spec_report(head))
    rows = spec_rows(repo)
    assert list(rows) == ["spec_speedup_k4", "spec_measured_vs_predicted_k4",
                          "spec_acceptance_k4", "ngram_speedup_k4"]
    r = rows["spec_speedup_k4"]
    assert (r.value, r.goal, r.met) == ("1.34x", ">= 1.50x", "no")
    assert (r.commit, r.date, r.load) == (head[:7], "2026-12-01 07:08", "0.4 / 1.3")
    assert r.host == "not recorded"                              # the fixture has no machine
    assert rows["spec_measured_vs_predicted_k4"].value == "0.67"   # 1.34 / 2.0, from measurements
    assert rows["ngram_speedup_k4"].met == "yes"
    assert rows["spec_acceptance_k4"].goal == "-" and rows["spec_acceptance_k4"].met == "-"


def test_changed_code_makes_a_row_stale_and_a_comment_does_not(repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    write_spec(repo, spec_report(head + "-dirty"))
    assert spec_rows(repo)["spec_speedup_k4"].commit == f"{head[:7]}-dirty"
    source = repo / "tinyserve/speculative.py"
    source.write_text('"""A docstring."""\ndef step(x):\n    return x + 1  # reworded\n')
    assert spec_rows(repo)["spec_speedup_k4"].commit == f"{head[:7]}-dirty"
    source.write_text("def step(x):\n    return x + 2\n")
    assert spec_rows(repo)["spec_speedup_k4"].commit == f"{head[:7]}-dirty, stale"


def test_a_commit_git_does_not_know_is_shown_as_unknown(repo: Path) -> None:
    write_spec(repo, spec_report("0123456789abcdef0123456789abcdef01234567"))
    assert spec_rows(repo)["spec_speedup_k4"].commit == "0123456, unknown"


@pytest.mark.parametrize("report, note", [
    (spec_report(None), "spec.json has no commit"),
    (spec_report("abc", quick=True), "spec.json is a --quick run"),
])
def test_reports_without_provenance_are_not_rendered(repo: Path, report: dict, note: str) -> None:
    write_spec(repo, report)
    text = ledger.render_ledger(repo)
    assert "| spec |" not in text
    assert note in text.split("Not rendered: ", 1)[1]


def test_busy_runs_say_so_and_old_reports_say_n_a(repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    busy = spec_report(head, load={"before": 3.0, "after": 4.2, "busy_above": 1.5, "busy": True})
    write_spec(repo, busy)
    assert spec_rows(repo)["spec_speedup_k4"].load == "3.0 / 4.2, busy"
    write_spec(repo, {k: v for k, v in spec_report(head).items() if k != "load"})
    assert spec_rows(repo)["spec_speedup_k4"].load == "n/a"


def test_write_replaces_only_the_marked_sections(repo: Path) -> None:
    write_spec(repo, spec_report(_git(repo, "rev-parse", "HEAD")))
    (repo / "README.md").write_text("intro\n<!-- bench-ledger:begin -->\nold\n"
                                    "<!-- bench-ledger:end -->\nprose\n")
    (repo / "bench/results/README.md").write_text(
        "# ledger\n<!-- bench-ledger:begin -->\n<!-- bench-ledger:end -->\n"
        "<!-- bench-runs:begin -->\n<!-- bench-runs:end -->\nwhy one thread\n")
    assert ledger.differences(repo)
    ledger.write(repo)
    assert ledger.differences(repo) == []
    readme = (repo / "README.md").read_text()
    assert readme.startswith("intro\n") and readme.endswith("prose\n") and "| spec |" in readme
    assert "| `spec.json` | spec |" in (repo / "bench/results/README.md").read_text()


# ---- hosts (issue 50) ----------------------------------------------------------------------

def machine(model: str, isa: list[str]) -> dict:
    """A machine block as machine_info() writes it since issue 50."""
    return {"cpu_model": model, "cpu_vendor": "AuthenticAMD", "cpu_isa": isa,
            "cache_l2_bytes": 2**20, "cache_l3_bytes": 2**25, "cpu_arch": "x86_64",
            "torch_cpu_capability": "AVX2", "torch_blas": "MKL", "onednn": True,
            "cpu_count": 2, "torch_threads": 1, "torch": "2.13.0"}


AVX2 = machine("AMD EPYC 7B13", ["avx2", "fma"])
AVX512 = machine("AMD EPYC 9B45", ["avx2", "avx512bw", "avx512f", "fma"])
OLD = {"cpu_count": 2, "torch_threads": 1, "torch": "2.13.0", "processor": "x86_64"}


def test_a_row_names_its_host_and_the_legend_gives_it_in_full(repo: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    write_spec(repo, spec_report(head, machine=AVX2))
    assert {r.host for r in spec_rows(repo).values()} == {"AMD EPYC 7B13, AVX2"}
    text = ledger.render_ledger(repo)
    assert text.splitlines()[0].endswith("| load | host |")
    assert ("Hosts: *AMD EPYC 7B13, AVX2*: AMD EPYC 7B13 (AuthenticAMD), AVX2 (FMA), L2 1 MiB, "
            "L3 32 MiB, torch CPU capability AVX2, BLAS MKL, oneDNN on, 2 cores, 1 thread, "
            "torch 2.13.0.") in text
    write_spec(repo, spec_report(head, machine=OLD))            # a report from before the keys
    assert {r.host for r in spec_rows(repo).values()} == {"not recorded"}
    assert "Hosts:" not in ledger.render_ledger(repo)
    assert "| no | not recorded |" in ledger.render_runs(repo)


def test_two_blocks_of_one_host_key_get_numbered_labels() -> None:
    hosts = ledger.HostLabels()
    other_torch = {**AVX2, "torch": "2.14.0"}
    labels = [hosts.label({"machine": m}) for m in (AVX2, other_torch, AVX2, OLD)]
    assert labels == ["AMD EPYC 7B13, AVX2", "AMD EPYC 7B13, AVX2 (2)", "AMD EPYC 7B13, AVX2",
                      "not recorded"]
    assert hosts.legend().count("AMD EPYC 7B13 (AuthenticAMD)") == 2


def test_compare_refuses_hosts_of_different_isa_classes(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    old, new = spec_report("a" * 40, machine=AVX2), spec_report("b" * 40, machine=AVX512)
    with pytest.raises(HostMismatch, match=r"REFUSED: different hosts\. the old run's host is "
                                           r"AVX2, the new run's AVX-512"):
        render(old, new)
    text, _ = render(old, new, across_hosts=True)
    assert text.startswith("WARNING: ACROSS HOSTS") and text.splitlines()[-1].startswith("WARNING")
    assert "AMD EPYC 7B13" in text and "AMD EPYC 9B45" in text
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    paths = [str(tmp_path / "old.json"), str(tmp_path / "new.json")]
    assert main(["bench", "compare", *paths]) == 2
    err = capsys.readouterr().err
    assert "REFUSED" in err and "AMD EPYC 7B13" in err and "--across-hosts" in err
    assert main(["bench", "compare", *paths, "--across-hosts"]) == 0
    assert "WARNING: ACROSS HOSTS" in capsys.readouterr().out


def test_compare_goes_on_loudly_where_a_host_is_not_recorded() -> None:
    text, _ = render(spec_report("a" * 40, machine=OLD), spec_report("b" * 40, machine=AVX512))
    assert text.startswith("WARNING: the old run's host is not recorded")
    assert "| spec_speedup_k4 |" in text or "spec_speedup_k4" in text
    same, _ = render(spec_report("a" * 40, machine=AVX2), spec_report("b" * 40, machine=AVX2))
    assert "WARNING" not in same and "note:" not in same.split("\n", 1)[0]


def test_make_bench_does_not_compare_across_isa_classes_but_replaces(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, scratch = tmp_path / "results", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    (out / "spec.json").write_text(json.dumps(spec_report("a" * 40, machine=AVX2)))
    (scratch / "spec.json").write_text(json.dumps(spec_report("b" * 40, machine=AVX512)))
    replace_results("spec", scratch, out)
    printed = capsys.readouterr().out
    assert "bench spec: not compared with the report it replaces. REFUSED" in printed
    assert json.loads((out / "spec.json").read_text())["git_commit"] == "b" * 40


# ---- compare -----------------------------------------------------------------------------

def test_compare_marks_what_moved_against_its_goal_beyond_noise() -> None:
    old, new = spec_report("a" * 40), spec_report("b" * 40)
    old["ratios"] = {"spec_speedup_k4": 1.78, "ngram_speedup_k4": 2.0,
                     "spec_acceptance_k4": 0.85, "spec_speedup_k2": 1.4}
    new["ratios"] = {"spec_speedup_k4": 1.34, "ngram_speedup_k4": 2.5,
                     "spec_acceptance_k4": 0.853, "spec_speedup_k2": 1.1}
    verdicts = {c.name: c.verdict() for c in changes(old, new)}
    assert verdicts["spec_speedup_k4"] == "worse"          # -25% against a 15% band
    assert verdicts["ngram_speedup_k4"] == "better"
    assert verdicts["spec_acceptance_k4"] == "noise"       # +0.4% within 1%
    assert verdicts["spec_speedup_k2"] == "-"               # not a headline: no direction
    text, worse = render(old, new)
    assert worse == 1 and "-24.7%" in text and "1 ratio(s) moved the wrong way" in text


def test_compare_judges_a_within_goal_by_distance_from_its_centre() -> None:
    goal = Goal("within", 0.2)
    assert goal.met(0.85) and not goal.met(0.75) and goal.text("{:.2f}") == "0.80 to 1.20"
    old = {"suite": "decode", "measurements": {"engine_vs_cost_model": [
        {"rows": 16, "measured_over_model": 0.9}]}}
    new = {"suite": "decode", "measurements": {"engine_vs_cost_model": [
        {"rows": 16, "measured_over_model": 1.1}]}}
    assert {c.name: c.verdict() for c in changes(old, new)}["engine_vs_cost_model_16"] == "noise"
    new["measurements"]["engine_vs_cost_model"][0]["measured_over_model"] = 0.6
    assert {c.name: c.verdict() for c in changes(old, new)}["engine_vs_cost_model_16"] == "worse"


def test_compare_reads_a_report_as_a_commit_stored_it(repo: Path) -> None:
    write_spec(repo, spec_report("a" * 40))
    _git(repo, "add", "bench/results/spec.json")
    _git(repo, "commit", "-q", "-m", "results")
    write_spec(repo, spec_report("b" * 40))
    assert load_report("HEAD:bench/results/spec.json", repo)["git_commit"] == "a" * 40
    with pytest.raises(ValueError, match="cannot read HEAD:nope.json from git"):
        load_report("HEAD:nope.json", repo)


def test_compare_refuses_two_suites_and_notes_busy_runs() -> None:
    with pytest.raises(ValueError, match="different suites"):
        changes({"suite": "spec"}, {"suite": "hf"})
    busy = spec_report("c" * 40, load={"before": 5.0, "after": 6.0, "busy_above": 1.5, "busy": True})
    text, _ = render(spec_report("a" * 40), busy)
    assert "the new run was on a busy machine" in text


def test_compare_command_exits_1_on_a_regression(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    old, new = spec_report("a" * 40), spec_report("b" * 40)
    new["ratios"] = {**old["ratios"], "spec_speedup_k4": 0.9}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert main(["bench", "compare", str(tmp_path / "old.json"), str(tmp_path / "new.json")]) == 1
    assert "worse" in capsys.readouterr().out
    assert main(["bench", "compare", str(tmp_path / "old.json")]) == 2
    assert "two reports" in capsys.readouterr().err


# ---- load --------------------------------------------------------------------------------

def test_load_is_judged_against_a_stated_threshold() -> None:
    assert busy_threshold(2) == 1.5 and busy_threshold(1) == 1.0 and busy_threshold(16) == 12.0
    quiet = stamp(0.3, 1.2)             # after: the suite's own thread, judged less it
    assert quiet["busy"] is False and busy_warning(quiet, "bench x") is None
    loaded = stamp(0.3, 1.2 + 99)
    assert loaded["busy"] is True
    assert "not comparable" in (busy_warning(loaded, "bench x") or "")


def test_bench_all_refuses_to_put_quick_figures_in_the_results(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "all", "--quick", "--suites", "paged"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["bench", "all", "--suites", "nope", "--out", "x"]) == 2
    assert "unknown bench suite(s) nope" in capsys.readouterr().err


def test_ledger_command_prints_the_table_and_suites_refuse_verb_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ledger"]) == 0
    assert capsys.readouterr().out.startswith("| suite | ratio | value | goal | met |")
    assert main(["bench", "paged", "--write"]) == 2
    assert "belong to: all, ledger, compare" in capsys.readouterr().err


def test_a_report_written_by_an_earlier_suite_does_not_make_the_tree_dirty(tmp_path) -> None:
    """make bench writes bench/results/ one suite after another: the later suites still run
    HEAD's code, so they are recorded clean; any other tracked change marks a run dirty."""
    import subprocess
    from tinyserve.provenance import git_commit
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True,  # noqa: E731
                                    capture_output=True)
    run("init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "kv.json").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    run("add", ".")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    head = git_commit(tmp_path)
    assert head and not head.endswith("-dirty")
    (tmp_path / "bench" / "results" / "kv.json").write_text('{"ratios": {}}\n')
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"
