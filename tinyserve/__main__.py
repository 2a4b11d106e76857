"""One command line for the course: ``python -m tinyserve COMMAND``.

  generate    continue a prompt with a shipped model
  bench       run a benchmark suite (python -m tinyserve bench --help lists them)
  serve       an OpenAI-compatible HTTP server (streaming, /metrics) on 127.0.0.1:8000
  loadgen     load-test an OpenAI-compatible server: latency percentiles, goodput, cost
  calibrate   fit the scheduling simulator's cost model to the real model on this machine
  train       train a preset (target or draft) and ship its weights
  export-hf   write a Hugging Face Llama folder
  model-card  recompute the figures the README's model card quotes
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from .paths import MODEL_NAMES
from .serving.options import ServeOptions

#: How many held-out sample tickets ``generate --example`` offers.
EXAMPLES = 100
#: ``add_parser``'s return type (argparse does not export a name for it).
SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _cmd_generate(args: argparse.Namespace) -> int:
    from .checkpoint import load_model
    from .generate import clock, generate_stream
    from .metrics import RequestTrace, summary_line
    from .sampling import SamplingParams
    from .tokenizer import load_tokenizer

    if args.prompt is None and args.example is None:
        raise ValueError("give a prompt with --prompt TEXT, or --example N for a sample ticket.")
    if args.example is not None:
        from .corpus import example_prompts
        if not 0 <= args.example < EXAMPLES:
            raise ValueError(f"--example takes a ticket number from 0 to {EXAMPLES - 1}, "
                             f"got {args.example}.")
        prompt = example_prompts(args.example + 1)[args.example]
    else:
        prompt = args.prompt
    if not prompt.strip():
        raise ValueError("the prompt is empty; give some text with --prompt.")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}.")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    tok = load_tokenizer()
    model = load_model(args.model)
    ids = tok.encode(prompt)
    max_tokens, cut = _fit_window(len(ids), args.max_tokens, model.config.max_position_embeddings,
                                  args.truncate)
    if args.echo or args.example is not None:
        print(prompt, end="", flush=True)
    trace = RequestTrace(prompt_tokens=len(ids), arrival=clock(model.device))
    out: list[int] = []
    shown = ""
    for token in generate_stream(model, ids, max_tokens, sampling=sampling,
                                 stop_ids=(tok.eos_id,), use_cache=not args.no_cache,
                                 trace=trace,
                                 path="compiled" if args.compile else "auto"):
        out.append(token)
        if args.stream:
            # Decode everything so far and print the new suffix: one token can be half of a
            # multi-byte character, which only decodes once its other half arrives.
            text = tok.decode(out, skip_special=True)
            if not text.endswith("\ufffd"):
                print(text[len(shown):], end="", flush=True)
                shown = text
    text = tok.decode(out, skip_special=True)
    print(text[len(shown):] if args.stream else text)
    print(summary_line(trace) + cut, file=sys.stderr)
    return 0


def _fit_window(prompt_tokens: int, max_tokens: int, window: int, truncate: bool) -> tuple[int, str]:
    """``max_tokens`` if the request fits the context window; else the server's 400 message as
    an error, or with ``truncate`` the tokens that fit and a note for the summary line."""
    from .serving.api_schema import context_window_message
    if prompt_tokens + max_tokens <= window:
        return max_tokens, ""
    message = context_window_message(window, prompt_tokens, max_tokens)
    if not truncate or prompt_tokens >= window:
        hint = "" if prompt_tokens >= window else "; or pass --truncate to stop at the window"
        raise ValueError(message.replace("max_tokens", "--max-tokens") + hint)
    fit = window - prompt_tokens
    return fit, f" (--max-tokens {max_tokens} cut to {fit}: the {window}-token context window)"


def _cmd_bench(args: argparse.Namespace) -> int:
    from bench.cli import run  # the suites ship as their own package next to tinyserve
    return run(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    import socket

    from .engine import EngineConfig
    from .serving.server import serve
    opts = ServeOptions(**{f.name: getattr(args, f.name) for f in fields(ServeOptions)})
    opts.check()
    with socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET) as probe:
        try:
            probe.bind((opts.host, opts.port))
        except OSError as err:
            raise ValueError(f"cannot listen on {opts.host}:{opts.port} ({err.strerror}); "
                             f"is another server running there? Pick another --port") from None
    serve(opts.host, opts.port, engine_config=EngineConfig(**opts.engine_sizes()),
          **opts.app_kwargs())
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import os
    from datetime import datetime, timezone

    import torch

    from .checkpoint import load_model
    from .provenance import git_commit, machine_info
    from .simulator import calibrate, measure_steps, save_cost_model
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    # The chapters and the bench run the engine on one thread: fit the engine they run.
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    records = measure_steps(model, repeats=args.repeats)
    cost, fit = calibrate(records)
    print(f"{cost}\nfit: R^2 {fit['r2']:.3f}, median |relative error| "
          f"{fit['median_abs_rel_error']:.1%} over {fit['steps']} steps")
    if args.write:
        meta = {"model": args.model, "threads": torch.get_num_threads(),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "load": os.getloadavg()[0], "machine": machine_info(),
                "git_commit": git_commit()}
        save_cost_model(cost, fit, meta, args.write)
        print(f"wrote {args.write}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .train import train
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}.")
    report = train(args.preset, steps=args.steps, save=not args.no_save)
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))
    return 0


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from .hf_export import export_hf
    out = export_hf(args.out_dir, args.model)
    print(f"wrote a Hugging Face Llama checkpoint to {out}")
    return 0


def _cmd_model_card(args: argparse.Namespace) -> int:
    from .workbook.model_card import model_card
    card = model_card()
    print(card["markdown"])
    if args.update_readme:
        from .workbook.model_card import update_readme
        update_readme(Path(args.update_readme), card["markdown"])
        print(f"updated the model card in {args.update_readme}")
    if args.json:
        Path(args.json).write_text(json.dumps(card["figures"], indent=2) + "\n")
    return 0


def add_model_argument(p: argparse.ArgumentParser, help: str = "which shipped model") -> None:
    p.add_argument("--model", default="target", choices=MODEL_NAMES, help=help)


def add_generate_parser(sub: SubParsers) -> None:
    g = sub.add_parser("generate", help="continue a prompt")
    g.add_argument("--prompt", help="text to continue (ticket markers like <|ticket|> allowed)")
    g.add_argument("--example", type=int, metavar="N",
                   help=f"use the N-th held-out sample ticket as the prompt (0 to {EXAMPLES - 1})")
    g.add_argument("--max-tokens", type=int, default=200,
                   help="tokens to generate at most; prompt + this must fit the context window")
    g.add_argument("--truncate", action="store_true",
                   help="stop at the context window instead of refusing a longer request")
    add_model_argument(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    g.add_argument("--top-p", type=float, default=None, help="sample within probability mass p")
    g.add_argument("--echo", action="store_true", help="print the prompt before the output")
    g.add_argument("--stream", action="store_true", help="print tokens as they are made")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence every step (the reference loop)")
    g.add_argument("--compile", action="store_true",
                   help="decode with a torch.compile-d step (CUDA graphs on a GPU); compiles first")
    g.set_defaults(func=_cmd_generate)


def add_bench_parser(sub: SubParsers) -> None:
    import bench  # the CLI's door to the suites; no library module imports bench
    from bench.cli import VERBS
    b = sub.add_parser("bench", help="run a benchmark suite and report ratios",
                       description="suites:\n" + "\n".join(f"  {k:9s} {v}" for k, v in
                                                            bench.SUITES.items())
                       + "\nand:\n" + "\n".join(f"  {k:9s} {v}" for k, v in VERBS.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("suite", help="one of: " + ", ".join([*bench.SUITES, *VERBS]))
    b.add_argument("paths", nargs="*", help="compare: OLD.json NEW.json")
    b.add_argument("--json", help="also write the report as JSON to this path")
    b.add_argument("--quick", action="store_true",
                   help="tiny sizes, seconds: checks the suite runs, figures mean nothing")
    b.add_argument("--suites", help="all: a comma-separated subset (default: every CPU suite)")
    b.add_argument("--out", help="all: the results folder (default bench/results)")
    b.add_argument("--write", action="store_true",
                   help="ledger: write it into README.md and bench/results/README.md")
    b.add_argument("--compile", action="store_true",
                   help="time our side with the compiled decode step (suites: hf)")
    b.add_argument("--across-hosts", action="store_true",
                   help="compare: reports from hosts of different ISA classes too (warned)")
    b.set_defaults(func=_cmd_bench)


def add_serve_parser(sub: SubParsers) -> None:
    d = ServeOptions()   # every default below comes from here
    s = sub.add_parser("serve", help="an OpenAI-compatible server over the engine")
    s.add_argument("--host", default=d.host)
    s.add_argument("--port", type=int, default=d.port)
    s.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")
    add_model_argument(s, "the shipped model to serve")
    s.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks in the pool")
    s.add_argument("--block-size", type=int, default=d.block_size,
                   help="token slots per KV block")
    s.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="running requests at most")
    s.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per step")
    s.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false")
    s.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    s.add_argument("--policy", default=d.policy, choices=["fcfs", "spf", "size-aware"])
    s.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="queued requests beyond which new ones get 429")
    s.add_argument("--queue-timeout", dest="queue_timeout_s", type=float, metavar="SECONDS",
                   default=d.queue_timeout_s,
                   help="seconds a request may wait for admission before it gets 429")
    s.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, metavar="SECONDS",
                   default=d.drain_timeout_s,
                   help="seconds in-flight requests get to finish at shutdown")
    s.add_argument("--compile", action="store_true",
                   help="torch.compile the engine's MLPs (dynamic token count); compiles first")
    s.add_argument("--fast", action="store_true",
                   help="the fastest decode steps here: CUDA graphs on a GPU; on a CPU one "
                        "compiled step for --max-num-seqs rows over the whole window, made "
                        "before the server listens (a minute or more; kept in .cache/)")
    s.set_defaults(func=_cmd_serve)


def add_calibrate_parser(sub: SubParsers) -> None:
    k = sub.add_parser("calibrate", help="fit the simulator's cost model on this machine")
    add_model_argument(k)
    k.add_argument("--repeats", type=int, default=60,
                   help="timings per batch shape, round the grid (fastest kept; 60 takes tens of "
                        "seconds on one thread)")
    k.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1, as the chapters and the bench run)")
    k.add_argument("--write", metavar="PATH",
                   help="save the fit (the shipped one: tinyserve/assets/cost_model.json)")
    k.set_defaults(func=_cmd_calibrate)


def add_train_parser(sub: SubParsers) -> None:
    t = sub.add_parser("train", help="train a preset and ship its weights")
    t.add_argument("--preset", required=True, choices=MODEL_NAMES)
    t.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    t.add_argument("--no-save", action="store_true", help="do not overwrite shipped weights")
    t.set_defaults(func=_cmd_train)


def add_export_hf_parser(sub: SubParsers) -> None:
    e = sub.add_parser("export-hf", help="write a Hugging Face Llama folder")
    e.add_argument("out_dir")
    add_model_argument(e)
    e.set_defaults(func=_cmd_export_hf)


def add_model_card_parser(sub: SubParsers) -> None:
    c = sub.add_parser("model-card", help="recompute the model card's figures")
    c.add_argument("--json", help="also write the figures as JSON to this path")
    c.add_argument("--update-readme", metavar="README",
                   help="rewrite the card between the model-card markers of this file")
    c.set_defaults(func=_cmd_model_card)


def build_parser() -> argparse.ArgumentParser:
    from .loadgen.cli import add_parser as add_loadgen_parser
    parser = argparse.ArgumentParser(prog="python -m tinyserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_generate_parser, add_bench_parser, add_serve_parser, add_loadgen_parser,
                add_calibrate_parser, add_train_parser, add_export_hf_parser,
                add_model_card_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        # A user-facing error: one clear line, no traceback.
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
