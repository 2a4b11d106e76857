"""Eager against graph decode, measured: ``python -m tinyserve.graph_check`` (gpu-check's
graph-decode step). Measurement sits above the loops it times: :mod:`tinyserve.backends.cuda_graph`
captures and replays, this module only clocks it against the eager step."""
from __future__ import annotations

import torch
from torch import Tensor

from .checkpoint import load_model
from .backends.cuda_graph import graph_decoder
from .device import default_device, timings
from .model import TinyLlama
from .roofline import decode_cost, eager_step_seconds, mbu, read_bandwidth

@torch.no_grad()
def graph_step_seconds(model: TinyLlama, prompts: Tensor, n: int = 16, repeats: int = 3,
                       *, capture: bool | None = None) -> float:
    """Seconds per decode step through a :class:`GraphDecoder` after ``prompts`` (B, T),
    the fastest of ``repeats`` runs of ``n`` steps (greedy; positions from the host, so
    nothing in the loop waits on the device until the clock stops). Compare with
    :func:`tinyserve.roofline.eager_step_seconds` on the same prompts."""
    B, T = prompts.shape
    decoder = graph_decoder(model, B, tokens=T + n, capture=capture)
    try:
        first = decoder.prefill(prompts, [T] * B).argmax(-1)

        def run() -> None:
            tokens = first
            for i in range(n):                  # the same slots each run: no reset needed
                tokens = decoder.step(tokens, [T + i] * B).argmax(-1)
        return min(timings(run, model.device, repeats)) / n   # after one untimed run
    finally:
        decoder.release()


def compare(model: TinyLlama, batch: int = 1, prompt: int = 128, n: int = 16,
            repeats: int = 3, bandwidth: float | None = None) -> dict[str, float]:
    """Eager and graph decode steps of ``model`` at ``batch`` rows after ``prompt`` tokens:
    seconds each, their ratio, the graph's capture time and, given the device's read
    ``bandwidth`` (bytes/s), each step's model bandwidth utilisation."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=g)
    prompts = prompts.to(model.device)
    eager = eager_step_seconds(model, prompts, n, repeats)
    graph = graph_step_seconds(model, prompts, n, repeats)
    decoder = graph_decoder(model, batch, tokens=prompt + n)
    decoder.release()
    out = {"eager_step_s": eager, "graph_step_s": graph, "graph_vs_eager": eager / graph,
           "captured": float(decoder.graph is not None),
           "capture_s": float(decoder.capture_seconds or 0.0)}
    if bandwidth:
        cost = decode_cost(model, batch, prompt + n // 2)
        out.update(eager_mbu=mbu(cost, bandwidth, eager), graph_mbu=mbu(cost, bandwidth, graph))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tinyserve.graph_check``: eager vs graph decode per model, one JSON report
    (``ratios``: graph_vs_eager_<model>, and <way>_mbu_<model> on CUDA)."""
    import argparse
    import json
    p = argparse.ArgumentParser(prog="python -m tinyserve.graph_check", description=main.__doc__)
    p.add_argument("--models", default="target,bandwidth",
                   help="comma-separated load_model names (default: target,bandwidth)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    device = default_device()
    bandwidth = None
    if device.type == "cuda":
        bandwidth = read_bandwidth(device).best
    report: dict = {"suite": "graph-decode", "device": str(device), "batch": args.batch,
                    "prompt": args.prompt, "read_bandwidth": bandwidth,
                    "measurements": {}, "ratios": {}}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = load_model(name, device)
        row = compare(model, args.batch, args.prompt, args.steps, bandwidth=bandwidth)
        report["measurements"][name] = row
        report["ratios"][f"graph_vs_eager_{name}"] = round(row["graph_vs_eager"], 3)
        for way in ("eager", "graph"):
            if f"{way}_mbu" in row:
                report["ratios"][f"{way}_mbu_{name}"] = round(row[f"{way}_mbu"], 3)
        print(f"{name}: eager {row['eager_step_s'] * 1e3:.2f} ms, graph "
              f"{row['graph_step_s'] * 1e3:.2f} ms per step: {row['graph_vs_eager']:.2f}x"
              + ("" if row["captured"] else " (no capture here: the same step, eagerly)"),
              flush=True)
        del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
