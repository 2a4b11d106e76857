"""The picture of a rate sweep: latency percentiles and goodput against offered load."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .generator import knee


def plot_sweep(points: Sequence[dict[str, Any]], path: str | None = None,
               title: str = "") -> Any:
    """Left: TTFT p50/p99, TPOT p50 and ITL p99 (ms, log scale) per offered rate. Right:
    request throughput and goodput against the offered rate, with the line where served
    equals offered. The knee (most goodput) is marked on both."""
    import logging

    import matplotlib
    # Log-scale tick labels ask for math fonts this install may lack; the fallback is fine.
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rates = [p["rate"] for p in points]
    m = [p["metrics"] for p in points]
    k = knee(points)
    fig, (lat, good) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("p50_ttft_ms", "TTFT p50", "o-"), ("p99_ttft_ms", "TTFT p99", "o--"),
                              ("p50_tpot_ms", "TPOT p50", "s-"), ("p99_itl_ms", "ITL p99", "s--")):
        lat.plot(rates, [x.get(key, float("nan")) for x in m], style, label=label)
    lat.set_yscale("log")
    lat.set_xlabel("offered load (requests/s)")
    lat.set_ylabel("latency (ms, log scale)")
    lat.set_title("latency percentiles")
    good.plot(rates, [x["request_throughput"] for x in m], "o-", label="completed requests/s")
    good.plot(rates, [x["goodput"] for x in m], "o-", label="goodput (met the SLOs)")
    good.plot(rates, rates, ":", color="grey", label="served = offered")
    good.set_ylim(0, max(max(x["request_throughput"] for x in m), 1e-9) * 1.3)
    good.set_xlabel("offered load (requests/s)")
    good.set_ylabel("requests/s")
    good.set_title("throughput and goodput")
    for ax in (lat, good):
        ax.axvline(rates[k], color="red", alpha=0.4, label=f"knee ({rates[k]:g} req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig
