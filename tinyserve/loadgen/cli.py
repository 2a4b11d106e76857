"""``python -m tinyserve loadgen``: drive an OpenAI-compatible endpoint and report.

Examples::

    python -m tinyserve loadgen --rate 2 4 8 --num-requests 60 --slo-ttft-ms 1000 \\
        --json serve.json --plot serve.png          # starts our server, sweeps three rates
    python -m tinyserve loadgen --url http://gpu-box:8000 --model meta-llama/Llama-3.1-8B \\
        --rate 4 --ignore-eos --price-per-hour 2.5  # a vLLM server elsewhere
    python -m tinyserve loadgen --replicas 2 --route shape --rate 3   # two of ours, routed
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("loadgen", help="load-test an OpenAI-compatible server (ours by default)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=None,
                   help="base URL of a server (repeat for replicas); none: start ours on loopback")
    p.add_argument("--model", default="target", help="model name the server serves")
    p.add_argument("--replicas", type=int, default=1, help="servers of ours to start (no --url)")
    p.add_argument("--route", default="round-robin", choices=["round-robin", "least-loaded", "shape"],
                   help="how requests are spread across several URLs")
    p.add_argument("--long-prompt", type=int, default=256, help="'long' for --route shape (tokens)")
    p.add_argument("--rate", type=float, nargs="+", default=[float("inf")],
                   help="offered requests/s (several: a sweep); inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 Poisson, below 1 bursty")
    p.add_argument("--concurrency", type=int, default=None,
                   help="at most this many requests in flight (with --rate inf: fixed users)")
    p.add_argument("--num-requests", type=int, default=50)
    p.add_argument("--dataset", default="harbor", choices=["harbor", "tickets", "uniform"],
                   help="harbor: the Harbor fixtures scaled to the window; tickets: whole "
                        "tickets; uniform: ticket text cut to --prompt-len, caps --output-len")
    p.add_argument("--max-tokens", type=int, default=64, help="output cap for --dataset tickets")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("LOW", "HIGH"),
                   help="prompt tokens for --dataset uniform (inclusive range)")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("LOW", "HIGH"),
                   help="output caps for --dataset uniform (inclusive range)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="/v1/completions (the prompt text) or /v1/chat/completions (the prompt "
                        "as one user message, under the server's chat template)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM's extension, which our server honours too): run "
                        "every request to its max_tokens, for exact output lengths")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2el-ms", type=float, default=None)
    p.add_argument("--price-per-hour", type=float, default=None,
                   help="machine price per hour: adds cost per million input/output tokens")
    p.add_argument("--input-weight", type=float, default=1.0,
                   help="an input token's share of cost relative to an output token's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the one untimed request each server gets first")
    p.add_argument("--json", help="write the figures (a 'metrics' object, every point) here")
    p.add_argument("--plot", help="write the latency/goodput-vs-load plot here (PNG)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..tables import table
    from .prompts import Prompt, corpus_prompts, harbor_prompts, ticket_prompts
    from .generator import TABLE_COLUMNS, knee, run_load, run_metrics, table_rows
    from ..metrics import SLO
    from ..serving.local_servers import server_processes
    from ..serving.routing import make_router, prompt_router
    from ..workload import Uniform

    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if any(r <= 0 for r in args.rate):
        raise ValueError(f"--rate takes positive requests/s (or inf), got {args.rate}")
    if args.url and args.replicas != 1:
        raise ValueError("--replicas starts our own servers; with --url give one --url per replica")
    if args.dataset == "harbor":
        prompts = harbor_prompts(args.num_requests)
    elif args.dataset == "tickets":
        prompts = corpus_prompts(args.num_requests, args.max_tokens)
    else:
        for name, (low, high) in (("--prompt-len", args.prompt_len),
                                  ("--output-len", args.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} takes LOW HIGH with 1 <= LOW <= HIGH, got {low} {high}")
        prompts = ticket_prompts(args.num_requests, Uniform(*args.prompt_len),
                                 Uniform(*args.output_len), seed=args.seed)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    with contextlib.ExitStack() as stack:
        urls = args.url or stack.enter_context(server_processes(args.replicas))
        print(f"{len(prompts)} requests to {', '.join(urls)} (model {args.model})", flush=True)
        if not args.no_warmup:   # one short request per server first: first-call costs
            warm = [Prompt(prompts[0].text, prompts[0].prompt_tokens, 2)]
            for url in urls:
                run_load(url, args.model, warm, endpoint=args.endpoint)
        points = []
        for rate in args.rate:
            router = prompt_router(make_router(args.route, args.long_prompt)) if len(urls) > 1 else None
            results = run_load(urls, args.model, prompts, rate=rate, burstiness=args.burstiness,
                               concurrency=args.concurrency, seed=args.seed, router=router,
                               ignore_eos=args.ignore_eos, endpoint=args.endpoint)
            points.append({"rate": rate, "metrics": run_metrics(results, slo, args.price_per_hour,
                                                              args.input_weight),
                           "errors": sorted({r.error for r in results if not r.ok})[:3]})
    print(table(TABLE_COLUMNS, table_rows(points)))
    for p in points:
        for e in p["errors"]:
            print(f"  at {p['rate']:g} req/s a request failed: {e}")
    k = knee(points)
    m = points[k]["metrics"]
    if args.price_per_hour is not None:
        for p in points:
            c = p["metrics"]
            print(f"  {p['rate']:g} req/s: {c['cost_per_m_input_tokens']:.3f} per million input, "
                  f"{c['cost_per_m_output_tokens']:.3f} per million output tokens")
    if args.json:
        clean = lambda x: None if isinstance(x, float) and math.isinf(x) else x  # noqa: E731
        data = {"metrics": {"rate": clean(points[k]["rate"]), **m},
                "points": [{**p, "rate": clean(p["rate"])} for p in points],
                "knee_index": k, "slo": slo.__dict__, "model": args.model,
                "urls": list(urls), "route": args.route, "dataset": args.dataset,
                "endpoint": args.endpoint}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        if any(math.isinf(p["rate"]) for p in points):
            raise ValueError("--plot draws against offered rate; give finite --rate values")
        from .plot import plot_sweep
        plot_sweep(points, args.plot)
        print(f"wrote {args.plot}")
    return 0
