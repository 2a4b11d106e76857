"""The fast CPU int8 kernel, ``kernel="fbgemm"``: W8A8 dynamic, so it is checked against the
plain ``reference`` kernel within a bound derived from what it rounds, not to float rounding.

The bound. The weights reach FBGEMM as our int8 values and scales, exactly (zero point 0), so
the only new error is the activations' rounding. Each row of ``x`` is divided by its largest
``|x|`` (so it lies in [-1, 1]); the kernel then quantizes the whole tensor affinely to 7 bits
(``reduce_range``) with step ``d = (max(xn.max(), 0) - min(xn.min(), 0)) / 127`` and rounds to
the nearest level, so each entry is off by at most ``d / 2``, that is ``r_i * d / 2`` in the
row's own units; an output ``y_ij = sum_k x_ik W_jk`` is then off by at most
``r_i * d / 2 * sum_k |W_jk|``. The int32 accumulation is exact and the final rescale is one
float multiply, hence the small relative slack.

On the shipped target (fp32, CPU, the first two held-out windows, 1,024 tokens, measured): about
1.3 max logit error, 4.2% relative RMS logit error, 98.8% greedy agreement, +0.14% validation
loss, against 0.35, 1.8%, 99.6% and under 0.01% for the weight-only kernels
(tests/test_quant.py). The thresholds leave about 2x on the errors.
"""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from conftest import random_prompt, sharp_model
from tinyserve.config import ModelConfig
from tinyserve.model import TinyLlama
from tinyserve.quant import (KERNEL_NOTES, KERNELS, Int8Linear, fbgemm_engine, quality,
                             quantize_model, validation_windows)

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)


def activation_rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The largest error the kernel's activation rounding can make, per output (module doc)."""
    r = x.abs().amax(-1, keepdim=True)
    xn = x / r
    step = (xn.max().clamp(min=0) - xn.min().clamp(max=0)) / 127
    return r * step / 2 * weight.abs().sum(1) * (1 + 1e-4) + 1e-5


def layer(in_features: int, out_features: int, seed: int) -> tuple[Int8Linear, Int8Linear]:
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g))
    ref = Int8Linear.from_linear(linear, "reference")
    return ref, Int8Linear(ref.qweight, ref.scale, "fbgemm")


@pytest.mark.parametrize("batch_shape", [(1,), (3, 5), (2, 1, 4)])
@pytest.mark.parametrize("in_features", [48, 33])
def test_fbgemm_is_within_the_activation_rounding_bound(batch_shape, in_features) -> None:
    ref, fast = layer(in_features, 80, seed=in_features)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*batch_shape, in_features, generator=g)
    x[..., 0] *= torch.linspace(0.1, 30, x[..., 0].numel()).reshape(batch_shape)  # ranges differ
    with torch.no_grad():
        want, got = ref(x), fast(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got - want).abs()
    bound = activation_rounding_bound(x, ref.dequantized_weight())
    assert bool((err <= bound).all()), float((err / bound).max())
    # It really quantizes the activations: far from float rounding, unlike the weight-only
    # kernels (equal to the reference within 1e-4).
    assert float(err.max()) > 1e-3


def test_one_loud_token_does_not_coarsen_the_others() -> None:
    """Per-token scaling: a quiet row keeps its own step next to a row 1,000x louder."""
    ref, fast = layer(64, 40, seed=3)
    g = torch.Generator().manual_seed(4)
    quiet = torch.randn(1, 64, generator=g)
    both = torch.cat([quiet, 1000 * torch.randn(1, 64, generator=g)])
    with torch.no_grad():
        alone, together, want = fast(quiet)[0], fast(both)[0], ref(quiet)[0]
    scale = float(want.abs().max())
    assert float((alone - want).abs().max()) < 0.02 * scale
    assert float((together - want).abs().max()) < 0.04 * scale  # not 1,000x the step


def test_fbgemm_packs_once_outside_the_state_dict_and_repacks_on_change() -> None:
    ref, fast = layer(48, 16, seed=5)
    x = torch.randn(2, 48)
    with torch.no_grad():
        first = fast(x)
        packed = fast._packed[1]
        assert fast(x) is not None and fast._packed[1] is packed  # kept, not rebuilt
        assert set(fast.state_dict()) == {"qweight", "scale"}
        fast.qweight.neg_()  # written in place: the packed copy must follow
        torch.testing.assert_close(fast(x), -first, rtol=1e-5, atol=1e-5)
    for clone in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert clone._packed is None
        torch.testing.assert_close(clone(x), fast(x))


def test_fbgemm_whole_model_ties_the_head_and_follows_bf16() -> None:
    model = sharp_model(SMALL, seed=1)
    qm = quantize_model(model, kernel="fbgemm")
    assert qm.lm_head.kernel == "fbgemm" and qm.lm_head.qweight is qm.model.embed_tokens.qweight
    assert all(m.kernel == "fbgemm" for m in qm.modules() if isinstance(m, Int8Linear))
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 20, seed=3)])
    with torch.no_grad():
        ref = quantize_model(model, kernel="reference")(ids)
        got = qm(ids)
        # 7-bit activations at every one of 15 layers compound: on this 32-wide toy, 4-5%
        # relative RMS logit error and 85-100% same argmax over 20 positions (seeds 0-3,
        # measured); the shipped model's bounds are the test below.
        rel_rms = float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
        assert 1e-3 < rel_rms < 0.1
        assert float((got[0].argmax(-1) == ref[0].argmax(-1)).float().mean()) >= 0.8
        bf16 = quantize_model(TinyLlama(SMALL).to(torch.bfloat16), kernel="fbgemm")
        assert bf16(ids).dtype == torch.float32 and bf16.dtype == torch.bfloat16


def test_fbgemm_raises_no_deprecation_warning() -> None:
    ref, fast = layer(16, 8, seed=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            fast(torch.randn(1, 16))


def test_fbgemm_names_the_alternatives_off_the_cpu_and_without_the_engine() -> None:
    assert "fbgemm" in KERNELS and "W8A8" in KERNEL_NOTES["fbgemm"]
    ref, fast = layer(16, 8, seed=7)
    with pytest.raises(RuntimeError, match="fbgemm kernel is a PyTorch CPU kernel.*scale_after"):
        fast(torch.randn(1, 16, device="meta"))
    assert fbgemm_engine(["qnnpack", "x86"]) == "x86"
    with pytest.raises(RuntimeError, match="FBGEMM.*only \\['qnnpack'\\].*int8pack"):
        fbgemm_engine(["qnnpack"])


def test_fbgemm_keeps_the_shipped_target_within_bounds() -> None:
    from tinyserve.checkpoint import load_model
    target = load_model("target", device="cpu", dtype=torch.float32).eval()
    q = quality(target, quantize_model(target, kernel="fbgemm"), validation_windows(2))
    print(q)  # the figures, for the record: pytest -s
    assert q["max_abs_logit_error"] < 2.5
    assert q["rel_rms_logit_error"] < 0.08
    assert q["greedy_agreement"] >= 0.97
    assert abs(q["val_loss_delta"]) < 0.01
