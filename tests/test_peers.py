"""The peers bench (bench/suites/peers.py) without its peers: argument handling, the message that
names ``make peers``, the report's shape, and how guidellm's JSON report is read. The real
comparisons need ``make peers`` and minutes; they stay out of the test suite (their results
are in bench/results/peers.*)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.suites import peers


def _stats(p50: float, mean: float, count: int = 2) -> dict:
    return {"successful": {"mean": mean, "count": count, "percentiles": {"p50": p50, "p99": p50 * 2}}}


def _guidellm_report(streams: int) -> dict:
    """The fields of a guidellm 0.8 JSON report that bench.suites.peers reads, one benchmark."""
    timings = [{"request_start": 10.0, "first_token_iteration": 10.012},
               {"request_start": 20.0, "first_token_iteration": 20.016}]
    return {"benchmarks": [{
        "config": {"strategy": {"streams": streams}},
        "duration": 4.0,
        "requests": {"successful": [{"info": {"timings": t}} for t in timings]},
        "metrics": {
            "request_totals": {"successful": 2, "errored": 0},
            "request_latency": _stats(1.0, 1.0),
            "requests_per_second": _stats(0.5, 0.5),
            "output_tokens_per_second": _stats(20.0, 20.0),
            "time_to_first_token_ms": _stats(14.0, 14.0),
            "inter_token_latency_ms": _stats(9.0, 9.5),
            "time_per_output_token_ms": _stats(9.4, 9.8),
        }}]}


def test_missing_peer_is_named_with_its_make_target(tmp_path: Path, monkeypatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TINYSERVE_PEERS_DIR", str(tmp_path / "no-peers"))
    out = tmp_path / "peers.json"
    assert peers.main(["--peer", "guidellm", "--quick", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "guidellm is not installed" in err and "make peers" in err
    data = json.loads(out.read_text())
    assert data["suite"] == "peers" and data["quick"] is True and data["ratios"] == {}
    assert set(data["measurements"]["missing"]) == {"guidellm"}
    assert data["conditions"]["peer_versions"] == {"guidellm": None}
    cmp = data["measurements"]["vs_guidellm"]
    # Our side still ran, both endpoints, every concurrency; no peer column was made up.
    for mode in peers.MODES:
        for c in peers.CONCURRENCY:
            row = cmp[mode][str(c)]
            assert set(row) == {"ours"} and row["ours"]["failed"] == 0
            assert row["ours"]["p50_ttft_ms"] > 0 and row["ours"]["output_throughput"] > 0
            # the server's own view of the same requests: it stamps arrival after our send
            assert 0 < row["ours"]["server_mean_ttft_ms"] < row["ours"]["mean_ttft_ms"]
            assert 0 < row["ours"]["server_occupancy"] <= c


def test_bad_arguments_get_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        peers.main(["--peer", "vllm"])
    assert e.value.code == 2 and "choose from" in capsys.readouterr().err
    with pytest.raises(ValueError, match="choose from guidellm, transformers"):
        peers.run(peers=("vllm",))


def test_guidellm_report_is_read_like_for_like() -> None:
    figures = peers.guidellm_figures(_guidellm_report(streams=4))
    f = figures[4]
    assert f["p50_ttft_ms"] == 14.0 and f["output_throughput"] == 20.0
    assert f["mean_itl_ms"] == 9.5 and f["failed"] == 0 and f["completed"] == 2
    # Its per-request TTFTs (12 and 16 ms) through our percentile: the median is 14 ms.
    assert f["p50_ttft_ms_our_percentile"] == pytest.approx(14.0)
    # The server saw 10 ms of TTFT and 3.6 s of E2E over guidellm's 4 s run.
    f = peers.with_server_view(f, {"ttft_sum": 1.0, "ttft_count": 5, "e2e_sum": 2.0},
                               {"ttft_sum": 1.02, "ttft_count": 7, "e2e_sum": 5.6},
                               f["mean_ttft_ms"])
    assert f["server_mean_ttft_ms"] == pytest.approx(10.0)
    assert f["ttft_excess_ms"] == pytest.approx(4.0) and f["server_occupancy"] == pytest.approx(0.9)
    ours = {"p50_ttft_ms": 15.5, "output_throughput": 19.0, "mean_itl_ms": 9.5,
            "ttft_excess_ms": 5.0, "server_occupancy": 0.99}
    cmp = {mode: {str(c): {"ours": ours, "guidellm": f} for c in peers.CONCURRENCY}
           for mode in peers.MODES}
    r = peers.guidellm_ratios(cmp)
    assert r["loadgen_vs_guidellm_ttft_p50_ms_diff_chat_c1"] == pytest.approx(1.5)
    assert r["loadgen_vs_guidellm_throughput_completions_c4"] == pytest.approx(0.95)
    assert r["loadgen_vs_guidellm_mean_itl_completions_c1"] == pytest.approx(1.0)
    assert r["loadgen_vs_guidellm_ttft_excess_ms_diff_chat_c4"] == pytest.approx(1.0)
    assert r["loadgen_vs_guidellm_server_occupancy_chat_c1"] == pytest.approx(1.1)


def test_guidellm_gets_the_same_workload(tmp_path: Path) -> None:
    prompts = peers.workload(quick=True)
    data = tmp_path / "data.jsonl"
    peers.write_guidellm_data(prompts, data)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert [(r["prompt"], r["output_tokens_count"]) for r in rows] == \
        [(p.text, p.max_tokens) for p in prompts]
    cmd = peers.guidellm_command(Path("/x/guidellm"), "http://127.0.0.1:9", tmp_path, data,
                                 tmp_path / "o.json", "chat", (1, 4), len(prompts))
    assert "request_format=/v1/chat/completions" in " ".join(cmd)
    assert cmd[cmd.index("--override") + 1:cmd.index("--override") + 3] == ["profile.streams", "1,4"]
    assert f"kind=huggingface_auto,model={tmp_path}" in cmd   # our folder, never a download
