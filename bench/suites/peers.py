"""Our load generator and our server, each held against a peer no one here wrote.

``python -m tinyserve bench peers`` runs both comparisons; ``python -m bench.suites.peers --peer
guidellm`` (or ``transformers``) runs one. The peers live in their own venvs under
``.venv-peers/`` (``make peers`` installs them from the package index, CPU torch first); at
run time nothing leaves loopback and no weights are downloaded: every tool reads the folder
``python -m tinyserve export-hf`` writes.

**Load generator vs guidellm.** One server of ours (its own process, one torch thread), the
same requests (Harbor-shaped tickets with exact output lengths: ``ignore_eos``) sent by our
load generator and by guidellm (``guidellm run``, its ``concurrent`` profile), completions
and chat, at each concurrency in ``CONCURRENCY``. The server is warmed before each; our run
is taken before *and* after guidellm's and the two averaged, so a machine that gets busier
or quieter during the comparison does not read as a difference between the tools.
Figures compared like for like (guidellm's names in ``guidellm/schemas/base/request_stats.py``):

- TTFT p50: ours vs guidellm's ``time_to_first_token_ms`` p50 (both clocks start at httpcore's
  ``send_request_headers`` event, see :mod:`tinyserve.loadgen.generator`);
- output throughput: output tokens / run time, vs guidellm's ``output_tokens_per_second`` mean;
- decode gaps: our ``mean_itl_ms`` (pooled gaps) vs guidellm's ``inter_token_latency_ms`` mean,
  which is (last token - first token) / (output tokens - 1) weighted by tokens: the same
  quantity. guidellm's ``time_per_output_token_ms`` is *not* our TPOT (it includes the first
  token), so it is recorded but not compared.

On a shared machine the server itself runs faster or slower from one minute to the next, and
that moves both tools' raw figures more than any difference between them. So each run is also
referred to **the server's own view of the same requests** (its ``/metrics`` histograms,
snapshotted just before and after the run): the **TTFT excess** (client mean TTFT - server
mean TTFT: what the client adds, from its send to the server's arrival stamp and from the
server's first token to the client's read) and the **occupancy** (summed server E2E / run
time: how many requests the client kept in the server on average, which is what sets
throughput; at concurrency c a client that loses no time between requests reaches c).
``*_ttft_excess_ms_diff_*`` and ``*_server_occupancy_*`` compare these; they hold under load
where the raw ones do not.

**Our server vs transformers serve.** ``transformers serve --continuous-batching`` on the
exported folder (CPU, fp32, one torch thread) and our server with prefix caching on and off,
the same requests from our load generator (completions), at each concurrency; ratios are
ours / theirs (throughput: above 1 we serve more; latency: below 1 we are faster). Sent
without ``ignore_eos``, which ``transformers serve`` refuses (422, "Unexpected fields"): both
servers decode greedily with the same weights, so both stop at the same token, and each
side's mean output length is in the report to show it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tinyserve.loadgen.generator import Result, run_load, run_metrics
from tinyserve.loadgen.prompts import Prompt, harbor_prompts
from tinyserve.serving.local_servers import free_port, local_server, server_processes, wait_healthy

from ..common import report, table, write_json

REPO = Path(__file__).resolve().parents[2]
PEERS = ("guidellm", "transformers")
#: Not in ``bench all``: it needs ``make peers`` (two more venvs) and runs its own servers for
#: many minutes; run it on its own.
BENCH_ALL = False
MODES = ("completions", "chat")
CONCURRENCY = (1, 4)
REQUESTS = 16                      # per run: enough for a stable median at concurrency 1
MODEL = "target"
WINDOW, TEMPLATE_ROOM = 512, 16    # context window; tokens the chat template may add
# Offline for every Hugging Face library the peers use: the exported folder is all they get.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "OMP_NUM_THREADS": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}


def peers_dir() -> Path:
    """Where the peers' venvs live (``TINYSERVE_PEERS_DIR`` overrides, e.g. in tests)."""
    return Path(os.environ.get("TINYSERVE_PEERS_DIR", REPO / ".venv-peers"))


def peer_executable(name: str) -> Path | None:
    """The peer's command in its venv, or None when ``make peers`` has not installed it."""
    exe = peers_dir() / name / "bin" / name
    return exe if exe.is_file() and os.access(exe, os.X_OK) else None


def missing_message(name: str) -> str:
    return (f"{name} is not installed in {peers_dir() / name}: run `make peers` (it installs "
            f"guidellm and transformers serve in their own venvs under .venv-peers/, CPU torch "
            f"first), then rerun")


def workload(quick: bool) -> list[Prompt]:
    """Harbor-shaped tickets that fit the window with room for the chat template (the scaled
    HT-0014 fills all 512 tokens as a completion and would get a 400 as a chat);
    ``quick``: three of them with 4-token outputs."""
    prompts = [p for p in harbor_prompts(2 * REQUESTS)
               if p.prompt_tokens + p.max_tokens <= WINDOW - TEMPLATE_ROOM][:REQUESTS]
    if quick:
        return [Prompt(p.text, p.prompt_tokens, 4, p.tag) for p in prompts[:3]]
    return prompts


def _our_figures(results: Sequence[Result]) -> dict[str, float]:
    m = run_metrics(results)
    keep = ("failed", "duration_s", "request_throughput", "output_throughput", "p50_ttft_ms",
            "p99_ttft_ms", "mean_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
            "p99_itl_ms", "mean_output_tokens")
    return {k: m[k] for k in keep if k in m}


def _ours(url: str, prompts: Sequence[Prompt], mode: str, concurrency: int,
          ignore_eos: bool = True) -> dict[str, float]:
    return _our_figures(run_load(url, MODEL, prompts, concurrency=concurrency, endpoint=mode,
                                 ignore_eos=ignore_eos))


def _ours_seen(url: str, prompts: Sequence[Prompt], mode: str, c: int) -> dict[str, float]:
    """Our run, with the server's view of it."""
    before = server_counters(url)
    f = _ours(url, prompts, mode, c)
    return with_server_view(f, before, server_counters(url), f["mean_ttft_ms"])


def server_counters(url: str) -> dict[str, float]:
    """Our server's own TTFT and E2E histogram sums and counts (``/metrics``): the difference
    of two snapshots is what the server measured for the requests sent in between."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("tinyserve_time_to_first_token_seconds",
                           "tinyserve_e2e_request_latency_seconds"):
            short = "ttft" if "first_token" in family.name else "e2e"
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    out[f"{short}{sample.name[sample.name.rindex('_'):]}"] = sample.value
    return out


def with_server_view(figures: dict[str, float], before: dict[str, float],
                     after: dict[str, float], client_mean_ttft_ms: float) -> dict[str, float]:
    """A client's figures plus what the server saw of the same requests: its mean TTFT, the
    client's TTFT excess over it (the client's own share, whatever the machine's load), and
    the server's occupancy (summed server E2E / run time: the mean number of requests the
    client kept in the server; at most the concurrency)."""
    n = after["ttft_count"] - before["ttft_count"]
    server_ttft = 1e3 * (after["ttft_sum"] - before["ttft_sum"]) / max(n, 1)
    busy = after["e2e_sum"] - before["e2e_sum"]
    return {**figures, "server_mean_ttft_ms": server_ttft,
            "ttft_excess_ms": client_mean_ttft_ms - server_ttft,
            "server_occupancy": busy / figures["duration_s"]}


def _bracketed(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The mean of our run before and after the peer's (the drift of a shared machine)."""
    return {k: (before[k] + after[k]) / 2 for k in before if k in after}


# ---- guidellm ----------------------------------------------------------------------------

def guidellm_command(exe: Path, url: str, hf_dir: Path, data: Path, out: Path, mode: str,
                     concurrency: Sequence[int], requests: int) -> list[str]:
    """``guidellm run`` (0.8 CLI): one benchmark per concurrency, each ``requests`` long."""
    fmt = "/v1/chat/completions" if mode == "chat" else "/v1/completions"
    return [str(exe), "run",
            "--backend", f"kind=openai_http,target={url},model={MODEL},request_format={fmt}",
            "--tokenizer", f"kind=huggingface_auto,model={hf_dir}",
            "--data", f"kind=json_file,path={data}",
            "--profile", f"kind=concurrent,streams={concurrency[0]}",
            "--override", "profile.streams", ",".join(str(c) for c in concurrency),
            "--constraint", f"kind=max_requests,count={requests}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


def write_guidellm_data(prompts: Sequence[Prompt], path: Path) -> None:
    """The workload as guidellm's JSON-lines dataset: its column mapper reads ``prompt`` and
    ``output_tokens_count`` (which makes it send ``max_tokens`` and ``ignore_eos``)."""
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.text, "output_tokens_count": p.max_tokens,
                                "prompt_tokens_count": p.prompt_tokens}) + "\n")


def guidellm_figures(report_json: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per concurrency, guidellm's own figures from its JSON report, plus its per-request TTFTs
    through our percentile (to tell a clock difference from a percentile-method one)."""
    out: dict[int, dict[str, float]] = {}
    for bench in report_json["benchmarks"]:
        streams = int(bench["config"]["strategy"]["streams"])
        m = bench["metrics"]
        ok = lambda name: m[name]["successful"]  # noqa: E731
        ttfts = [1e3 * (r["info"]["timings"]["first_token_iteration"]
                        - r["info"]["timings"]["request_start"])
                 for r in bench["requests"]["successful"]]
        out[streams] = {
            "completed": ok("request_latency")["count"],
            "failed": m["request_totals"]["errored"],
            "duration_s": bench["duration"],
            "request_throughput": ok("requests_per_second")["mean"],
            "output_throughput": ok("output_tokens_per_second")["mean"],
            "p50_ttft_ms": ok("time_to_first_token_ms")["percentiles"]["p50"],
            "mean_ttft_ms": ok("time_to_first_token_ms")["mean"],
            "p99_ttft_ms": ok("time_to_first_token_ms")["percentiles"]["p99"],
            "p50_ttft_ms_our_percentile": float(np.percentile(ttfts, 50)) if ttfts else None,
            "mean_itl_ms": ok("inter_token_latency_ms")["mean"],
            "p50_itl_ms": ok("inter_token_latency_ms")["percentiles"]["p50"],
            "p50_time_per_output_token_ms": ok("time_per_output_token_ms")["percentiles"]["p50"],
        }
    return out


def _run_guidellm(exe: Path, url: str, hf_dir: Path, prompts: Sequence[Prompt], mode: str,
                  concurrency: int, work: Path) -> dict[str, float]:
    data, out = work / f"data-{mode}.jsonl", work / f"guidellm-{mode}-c{concurrency}.json"
    write_guidellm_data(prompts, data)
    cmd = guidellm_command(exe, url, hf_dir, data, out, mode, [concurrency], len(prompts))
    before = server_counters(url)
    proc = subprocess.run(cmd, env={**os.environ, **OFFLINE_ENV}, cwd=work, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise RuntimeError(f"guidellm exited with {proc.returncode}:\n{tail}")
    f = guidellm_figures(json.loads(out.read_text()))[concurrency]
    return with_server_view(f, before, server_counters(url), f["mean_ttft_ms"])


def vs_guidellm(prompts: Sequence[Prompt], hf_dir: Path, work: Path, quick: bool,
                exe: Path | None) -> dict[str, Any]:
    """Both load generators against one server of ours, per mode and concurrency; our run
    just before and just after guidellm's."""
    out: dict[str, Any] = {"requests": len(prompts), "concurrency": list(CONCURRENCY)}
    servers = local_server() if quick else server_processes(1)
    with servers as handle:
        url = handle[0]
        for mode in MODES:
            run_load(url, MODEL, prompts[:2], endpoint=mode)          # warm-up: first calls
            out[mode] = {}
            for c in CONCURRENCY:
                before = _ours_seen(url, prompts, mode, c)
                if exe is None:
                    out[mode][str(c)] = {"ours": before}
                    continue
                theirs = _run_guidellm(exe, url, hf_dir, prompts, mode, c, work)
                after = _ours_seen(url, prompts, mode, c)
                out[mode][str(c)] = {"ours": _bracketed(before, after), "ours_before": before,
                                     "ours_after": after, "guidellm": theirs}
    return out


def guidellm_ratios(cmp: dict[str, Any]) -> dict[str, float]:
    ratios: dict[str, float] = {}
    for mode in MODES:
        for c in CONCURRENCY:
            row = cmp[mode][str(c)]
            if "guidellm" not in row:
                continue
            ours, theirs = row["ours"], row["guidellm"]
            key = f"{mode}_c{c}"
            ratios[f"loadgen_vs_guidellm_ttft_p50_ms_diff_{key}"] = \
                ours["p50_ttft_ms"] - theirs["p50_ttft_ms"]
            ratios[f"loadgen_vs_guidellm_throughput_{key}"] = \
                ours["output_throughput"] / theirs["output_throughput"]
            ratios[f"loadgen_vs_guidellm_mean_itl_{key}"] = \
                ours["mean_itl_ms"] / theirs["mean_itl_ms"]
            # The same two, referred to the server's own view of each run (robust to load).
            ratios[f"loadgen_vs_guidellm_ttft_excess_ms_diff_{key}"] = \
                ours["ttft_excess_ms"] - theirs["ttft_excess_ms"]
            ratios[f"loadgen_vs_guidellm_server_occupancy_{key}"] = \
                ours["server_occupancy"] / theirs["server_occupancy"]
    return ratios


# ---- transformers serve ------------------------------------------------------------------

@contextlib.contextmanager
def transformers_server(exe: Path, hf_dir: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """``transformers serve --continuous-batching`` on the exported folder, CPU, fp32."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(exe), "serve", str(hf_dir), "--continuous-batching", "--device", "cpu",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env={**os.environ, **OFFLINE_ENV}, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        try:
            wait_healthy(url, timeout_s, proc)
        except RuntimeError as e:
            log.seek(0)
            raise RuntimeError(f"{e}; its log ends:\n"
                               f"{log.read().decode(errors='replace')[-2000:]}") from None
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def vs_transformers(prompts: Sequence[Prompt], hf_dir: Path, exe: Path) -> dict[str, Any]:
    """Our load generator against their server and ours (prefix caching on and off)."""
    out: dict[str, Any] = {"requests": len(prompts), "concurrency": list(CONCURRENCY),
                           "endpoint": "completions"}
    servers = {"ours_prefix_on": lambda: server_processes(1),
               "ours_prefix_off": lambda: server_processes(1, ["--no-prefix-caching"]),
               "transformers": lambda: _one_url(transformers_server(exe, hf_dir))}
    for name, start in servers.items():
        model = str(hf_dir) if name == "transformers" else MODEL
        with start() as urls:
            run_load(urls[0], model, prompts[:2])                      # warm-up: first calls
            # No ignore_eos: transformers serve answers 422 to it; both run greedy on the same
            # weights, and the report keeps each side's mean output length to show they match.
            out[name] = {str(c): _our_figures(run_load(urls[0], model, prompts, concurrency=c))
                         for c in CONCURRENCY}
    return out


@contextlib.contextmanager
def _one_url(server: Any) -> Iterator[list[str]]:
    with server as url:
        yield [url]


def transformers_ratios(cmp: dict[str, Any]) -> dict[str, float]:
    ratios: dict[str, float] = {}
    for ours in ("ours_prefix_on", "ours_prefix_off"):
        tag = "prefix_on" if ours.endswith("on") else "prefix_off"
        for c in CONCURRENCY:
            a, b = cmp[ours][str(c)], cmp["transformers"][str(c)]
            for fig in ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms",
                        "p99_tpot_ms"):
                if fig in a and fig in b:
                    ratios[f"server_vs_transformers_{fig}_{tag}_c{c}"] = a[fig] / b[fig]
    return ratios


# ---- the suite ---------------------------------------------------------------------------

GUIDELLM_COLUMNS = ("mode", "users", "tool", "TTFT p50 ms", "TTFT p99 ms", "out tok/s",
                    "mean ITL ms", "server TTFT ms", "TTFT excess ms", "occupancy", "failed")


def _guidellm_rows(cmp: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for mode in MODES:
        for c in CONCURRENCY:
            for tool, f in cmp[mode][str(c)].items():
                if tool in ("ours", "guidellm"):
                    rows.append([mode, c, "loadgen" if tool == "ours" else tool, f["p50_ttft_ms"],
                                 f["p99_ttft_ms"], f["output_throughput"],
                                 f.get("mean_itl_ms", "-"), f["server_mean_ttft_ms"],
                                 f["ttft_excess_ms"], f["server_occupancy"], f["failed"]])
    return rows


def _transformers_rows(cmp: dict[str, Any]) -> list[list[Any]]:
    return [[name, c, f["output_throughput"], f["p50_ttft_ms"], f["p99_ttft_ms"],
             f.get("p50_tpot_ms", "-"), f.get("p99_tpot_ms", "-"), f["mean_output_tokens"],
             f["failed"]]
            for name in ("ours_prefix_on", "ours_prefix_off", "transformers")
            for c in CONCURRENCY for f in [cmp[name][str(c)]]]


def run(json_path: str | None = None, quick: bool = False,
        peers: Sequence[str] = PEERS) -> dict[str, Any]:
    """The comparisons for ``peers``; a missing peer is named (with ``make peers``) in the
    report's ``missing`` and its side left out, our side still measured."""
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
    load_before = round(os.getloadavg()[0], 2)
    exes = {p: peer_executable(p) for p in peers}
    missing = {p: missing_message(p) for p, exe in exes.items() if exe is None}
    for msg in missing.values():
        print(f"note: {msg}", file=sys.stderr, flush=True)
    prompts = workload(quick)
    measurements: dict[str, Any] = {"missing": missing}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tinyserve-peers-") as tmp:
        work = Path(tmp)
        hf_dir = work / "hf"
        if any(exe is not None for exe in exes.values()):   # the peers' model and tokenizer
            from tinyserve.hf_export import export_hf
            export_hf(hf_dir, MODEL)
        if "guidellm" in peers:
            print("our load generator and guidellm against one server of ours:", flush=True)
            cmp = vs_guidellm(prompts, hf_dir, work, quick, exes["guidellm"])
            measurements["vs_guidellm"] = cmp
            ratios.update(guidellm_ratios(cmp))
            print(table(GUIDELLM_COLUMNS, _guidellm_rows(cmp)))
        if "transformers" in peers and exes["transformers"] is not None and not quick:
            print("\nour server and transformers serve --continuous-batching, our load generator:",
                  flush=True)
            cmp = vs_transformers(prompts, hf_dir, exes["transformers"])
            measurements["vs_transformers"] = cmp
            ratios.update(transformers_ratios(cmp))
            print(table(["server", "users", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50",
                         "TPOT p99", "mean out tokens", "failed"], _transformers_rows(cmp)))
    data = report("peers", ratios, measurements,
                  {"server": "separate process, 1 torch thread" if not quick
                   else "thread of this process", "requests": len(prompts),
                   "ignore_eos": "guidellm comparison only", "concurrency": list(CONCURRENCY), "peers": list(peers),
                   "peer_versions": _peer_versions(exes),
                   "load_average_1min": [load_before, round(os.getloadavg()[0], 2)]}, quick)
    write_json(data, json_path)
    return data


def _peer_versions(exes: dict[str, Path | None]) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name, exe in exes.items():
        if exe is None:
            versions[name] = None
            continue
        code = f"import importlib.metadata as m; print(m.version({name!r}))"
        proc = subprocess.run([str(exe.parent / "python"), "-c", code], capture_output=True,
                              text=True, timeout=60)
        versions[name] = proc.stdout.strip() or None
    return versions


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suites.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", choices=[*PEERS, "all"], default="all",
                        help="which comparison to run (default: both)")
    parser.add_argument("--json", help="write the report here (bench/results/peers.json)")
    parser.add_argument("--quick", action="store_true",
                        help="three short requests, our server in this process: checks the "
                             "suite runs, figures mean nothing (transformers serve is skipped)")
    args = parser.parse_args(argv)
    peers = PEERS if args.peer == "all" else (args.peer,)
    data = run(args.json, args.quick, peers)
    if data["measurements"]["missing"]:
        print("missing peer(s): " + "; ".join(data["measurements"]["missing"].values()),
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
