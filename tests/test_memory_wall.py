"""The memory-wall helpers of the roofline lab that chapters 1 and 6b share: regimes named from bounds, the cache a model must
outgrow, prefill's bytes and FLOPs, and the roofline plot. No timings are asserted."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tinyserve.config import ModelConfig  # noqa: E402
from tinyserve.model import TinyLlama  # noqa: E402
from tinyserve.roofline import DecodeCost, decode_cost  # noqa: E402
from tinyserve.workbook.roofline_lab import (NEAR, cache_bytes, plot_roofline,  # noqa: E402
                                            prefill_cost, prefill_seconds, regime, regime_of,
                                            roofline_point)

SMALL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_regime_names_the_larger_bound_when_the_step_is_near_it() -> None:
    assert regime(1.5, 1.0, 0.1).name == "memory-bound"
    assert regime(1.5, 0.1, 1.0).name == "compute-bound"
    assert regime(0.5, 1.0, 0.1).name == "memory-bound"      # faster than the bound: still it
    r = regime(3.0, 1.0, 0.1)
    assert r.name == "overhead-bound" and r.of_roofline == pytest.approx(3.0)
    assert "3.0x" in r.reason
    assert regime(NEAR * 1.0, 1.0, 0.5).name == "memory-bound"   # the edge counts as near
    assert regime(2.5, 1.0, 0.1, near=3).name == "memory-bound"


def test_regime_refuses_non_positive_times() -> None:
    with pytest.raises(ValueError, match="positive"):
        regime(0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        regime(1.0, -1.0, 1.0)
    with pytest.raises(ValueError, match="one of them positive"):
        regime(1.0, 0.0, 0.0)
    assert regime(0.15, 0.0, 0.1).name == "compute-bound"   # bytes in the cache: no memory floor


def test_regime_of_uses_the_cost_and_the_machine() -> None:
    cost = DecodeCost(weight_bytes=1000, kv_bytes=0, flops=500.0)
    # memory bound 1000/1000 = 1 s, compute bound 500/1000 = 0.5 s
    assert regime_of(cost, 1.2, bandwidth=1000, flop_rate=1000).name == "memory-bound"
    assert regime_of(cost, 0.8, bandwidth=1e6, flop_rate=1000).name == "compute-bound"
    assert regime_of(cost, 30.0, bandwidth=1000, flop_rate=1000).name == "overhead-bound"


def test_cache_bytes_is_a_positive_size_with_a_name() -> None:
    size, name = cache_bytes("cpu")
    assert size > 0 and "cache" in name


def test_prefill_cost_reads_the_weights_once_and_counts_every_token() -> None:
    model = TinyLlama(SMALL).eval()
    one, many = prefill_cost(model, 1), prefill_cost(model, 16)
    step = decode_cost(model, 1, 0)
    assert one.weight_bytes == many.weight_bytes == step.weight_bytes
    assert one.flops == pytest.approx(step.flops)              # one token, nothing cached
    assert many.flops > 16 * one.flops                         # attention grows with position
    assert many.kv_bytes == 16 * one.kv_bytes
    assert many.flops / many.bytes > one.flops / one.bytes     # intensity grows with the prompt


def test_prefill_seconds_times_a_real_prefill() -> None:
    torch.manual_seed(0)
    model = TinyLlama(SMALL).eval()
    prompts = torch.randint(0, SMALL.vocab_size, (2, 8))
    assert prefill_seconds(model, prompts, repeats=1) > 0


def test_roofline_point_and_plot() -> None:
    cost = DecodeCost(weight_bytes=100, kv_bytes=0, flops=50.0)
    assert roofline_point(cost, 0.5) == (0.5, 100.0)
    fig, ax = plt.subplots()
    plot_roofline(ax, bandwidth=1e10, flop_rate=1e11,
                  points={"a": [(0.5, 4e9, "B=1"), (2.0, 1.5e10, "B=4")], "b": [(0.5, 1e8, "B=1")]})
    assert ax.get_xlabel().startswith("arithmetic intensity") and "GFLOP/s" in ax.get_ylabel()
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    labels = [line.get_label() for line in ax.get_lines()]
    assert "a" in labels and "b" in labels and any(lb.startswith("roofline") for lb in labels)
    plt.close(fig)
