"""int8 weights and KV cache: the quantizer's error bound, every kernel equal to the plain
dequantize-then-matmul reference, the int8 KV cache keeping the float cache's bookkeeping,
bytes really saved, and the shipped target's quality within stated bounds.

Quality bounds (measured on the first two held-out validation windows, 1,024 tokens, fp32
CPU: about 0.35 max logit error, 1.8% relative RMS error, 99.6% greedy agreement and a
validation-loss change under 0.01% for int8 weights; 0.22, 0.4%, 100% and under 0.001% for
the int8 KV cache). The thresholds below leave a margin of a few times those figures. One
scale per matrix instead of per row is measurably worse on the target (the test shows it).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompt, sharp_model
from tinyserve.config import ModelConfig
from tinyserve.kv_cache import CacheFullError, KVCache
from tinyserve import quant
from tinyserve.model import TinyLlama
from tinyserve.quant import (FUSED_ROWS, Int8Embedding, Int8KVCache, Int8Linear,
                             QuantizedTinyLlama, dequantize_groups, dequantize_rows,
                             grouped_matvec, quality, quantize_groups, quantize_model,
                             quantize_per_tensor, quantize_rows, reduction_pieces,
                             tensor_bytes, validation_windows, weight_bytes)

SMALL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48)


@pytest.fixture(scope="module")
def target() -> TinyLlama:
    from tinyserve.checkpoint import load_model
    return load_model("target", device="cpu", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return validation_windows(2)


# ------------------------------------------------------------------ the quantizer

@pytest.mark.parametrize("shape", [(7, 33), (4, 2, 9, 32), (1, 1)])
def test_round_trip_error_is_at_most_half_a_step(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 10
    x[..., 0] = 50.0 if x.numel() > 1 else x[..., 0]  # an outlier in every row
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and s.shape == x.shape[:-1]
    err = (dequantize_rows(q, s) - x).abs()
    assert bool((err <= s[..., None] / 2 * (1 + 1e-5)).all())
    assert int(q.abs().max()) <= 127
    # The largest entry of each row lands on +-127: the grid's whole range is used.
    assert bool((q.abs().amax(-1) == 127).all())


def test_zero_rows_and_signs_are_exact() -> None:
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [-3.0, 3.0, 0.0]])
    q, s = quantize_rows(x)
    assert s[0] == 1.0 and bool((q[0] == 0).all())       # no division by zero, zeros stay 0
    assert torch.equal(quantize_rows(-x)[0], -q)          # symmetric grid: -x -> -q
    assert torch.equal(q[1], torch.tensor([64, -127, 32], dtype=torch.int8))
    assert bool(torch.isfinite(dequantize_rows(q, s)).all())


def test_per_channel_beats_per_tensor_when_rows_differ_in_scale() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=g)
    w[0] *= 100  # one loud output channel
    per_row = (dequantize_rows(*quantize_rows(w)) - w)[1:].abs().max()
    q, s = quantize_per_tensor(w)
    per_tensor = (q.float() * s - w)[1:].abs().max()
    assert s.shape == () and per_tensor > 20 * per_row


def test_quantizer_rejects_integers() -> None:
    with pytest.raises(TypeError, match="float tensor"):
        quantize_rows(torch.ones(2, 2, dtype=torch.int64))


def test_a_scale_per_group_bounds_each_groups_error_by_its_own_step() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 96, generator=g)
    w[:, 5] = 40.0                                     # an outlier in the first group of each row
    q, s = quantize_groups(w, 32)
    assert q.shape == w.shape and q.dtype == torch.int8 and s.shape == (6, 3)
    err = (dequantize_groups(q, s) - w).abs().reshape(6, 3, 32)
    assert bool((err <= s[..., None] / 2 * (1 + 1e-5)).all())
    # The outlier coarsens its own group only: the other groups keep a step 10x finer than
    # the row's one scale would give them.
    row_q, row_s = quantize_rows(w)
    assert bool((s[:, 1:] * 10 < row_s[:, None]).all())
    assert (dequantize_rows(row_q, row_s) - w)[:, 32:].abs().max() > 5 * err[:, 1:].max()
    # One group per row is the per-row quantizer.
    assert torch.equal(quantize_groups(w, 96)[0], row_q)
    assert torch.equal(dequantize_groups(*quantize_groups(w, 96)), dequantize_rows(row_q, row_s))
    with pytest.raises(ValueError, match="group_size 40 must divide the last dimension \\(96\\)"):
        quantize_groups(w, 40)


@pytest.mark.parametrize("chunk", [4096, 32])     # one reduction a row; two pieces of 2 groups
@pytest.mark.parametrize("rows", [(1,), (2, 3), (FUSED_ROWS,)])
def test_the_fused_grouped_matvec_equals_dequantize_then_matmul(
        rows, chunk, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "REDUCTION_CHUNK", chunk)
    g = torch.Generator().manual_seed(5)
    q, s = quantize_groups(torch.randn(40, 64, generator=g), 16)
    x = torch.randn(*rows, 64, generator=g)
    want = F.linear(x, dequantize_groups(q, s))
    torch.testing.assert_close(grouped_matvec(x, q, s), want, rtol=1e-5, atol=1e-5)
    q, s = quantize_rows(torch.randn(40, 64, generator=g))      # a scale per row: one group
    torch.testing.assert_close(grouped_matvec(x, q, s), F.linear(x, dequantize_rows(q, s)),
                               rtol=1e-5, atol=1e-5)


def test_a_row_is_summed_in_the_fewest_pieces_of_whole_groups_within_the_chunk() -> None:
    assert quant.REDUCTION_CHUNK == 4096
    assert reduction_pieces(2048, 64) == 1            # the scale model's 2048-wide projections
    assert reduction_pieces(5504, 172) == 2           # its down_proj: 2 x 86 groups of 32
    assert reduction_pieces(4096, 128) == 1 and reduction_pieces(8192, 256) == 2
    assert reduction_pieces(12288, 384) == 3
    assert reduction_pieces(32 * 131, 131) == 1       # a prime count of groups: a cascade
    assert reduction_pieces(5504, 1) == 1             # one scale per row: a single group
    assert reduction_pieces(32 * 4096, 4096) == 1     # more than 8 pieces would not unroll


def test_realized_is_the_tensor_itself_outside_a_compile() -> None:
    x = torch.randn(2, 8)
    assert quant.realized(x) is x


def test_inductor_sums_a_long_row_without_a_cascade_and_normalizes_its_input_once() -> None:
    # What grouped_matvec is written for, read in the C++ inductor generates on a CPU: a row
    # of 5504 int8 weights (the scale model's down_proj) is summed by plain vector adds, not
    # inductor's cascade helper (which keeps its sum in memory above 4,096 terms), and an
    # RMSNorm before it is computed once, outside the loop that loads the weights.
    from torch._inductor.utils import run_and_get_code
    g = torch.Generator().manual_seed(8)
    q, s = quantize_groups(torch.randn(256, 5504, generator=g), 32)

    def projection(x: torch.Tensor) -> torch.Tensor:
        return grouped_matvec(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), q, s)
    x = torch.randn(1, 5504, generator=g)
    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(projection, backend="inductor"), x)
    torch.testing.assert_close(got, projection(x), rtol=1e-4, atol=1e-4)   # 5504 terms a sum
    code = "\n".join(codes)
    load = code.index("Vectorized<int8_t>::loadu")             # the first load of a weight
    outer = code.rindex("for(int64_t x0", 0, code.rindex("for(", 0, load))
    per_output = code[outer:code.index("vec_reduce_all", load)]   # one output's reduction
    assert "CascadeSumHelper" not in per_output and "sqrt" not in per_output
    assert "sqrt" in code[:outer]                                 # the norm: once, before


# ------------------------------------------------------------------ int8 linear layers

@pytest.mark.parametrize("kernel", ["scale_after", "int8pack", "compiled", "grouped", "auto"])
@pytest.mark.parametrize("batch_shape", [(1,), (3, 5)])
def test_every_kernel_equals_the_dequantize_then_matmul_reference(kernel, batch_shape) -> None:
    g = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(48, 80, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=g))
    x = torch.randn(*batch_shape, 48, generator=g)
    ref = Int8Linear.from_linear(linear, "reference")
    fast = Int8Linear(ref.qweight, ref.scale, kernel)
    want = ref(x)
    assert torch.equal(want, F.linear(x, dequantize_rows(ref.qweight, ref.scale)))
    torch.testing.assert_close(fast(x), want, rtol=1e-5, atol=1e-4)


def test_bad_kernel_and_bias_are_named() -> None:
    with pytest.raises(ValueError, match="unknown kernel 'fp4'.*reference, scale_after, int8pack"):
        Int8Linear(torch.zeros(2, 2, dtype=torch.int8), torch.ones(2), "fp4")
    with pytest.raises(ValueError, match="bias-free"):
        Int8Linear.from_linear(torch.nn.Linear(4, 4))


def test_group_scales_run_only_on_the_kernels_written_for_them() -> None:
    q, s = quantize_groups(torch.randn(8, 64), 32)
    layer = Int8Linear(q, s)
    assert layer.kernel_for(torch.randn(1, 64)) == "grouped" and layer.group_size == 32
    assert "a scale per 32" in repr(layer)
    with pytest.raises(ValueError, match="kernel 'fbgemm' takes one scale per output row"):
        Int8Linear(q, s, "fbgemm")
    with pytest.raises(ValueError, match="group_size=32 runs on the kernels reference, grouped"):
        quantize_model(sharp_model(SMALL, seed=0), kernel="scale_after", group_size=32)


def test_a_grouped_model_quantizes_every_matrix_and_its_tie_in_groups() -> None:
    model = sharp_model(SMALL, seed=6)
    qm = quantize_model(model, group_size=16)
    layers = [qm.model.layers[0].self_attn.q_proj, qm.model.layers[1].mlp.down_proj, qm.lm_head]
    assert all(m.group_size == 16 and m.kernel == "auto" for m in layers)
    assert qm.lm_head.qweight is qm.model.embed_tokens.qweight
    assert qm.model.embed_tokens.scale.shape == (SMALL.vocab_size, SMALL.hidden_size // 16)
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 12, seed=7)])
    table = dequantize_groups(qm.model.embed_tokens.qweight, qm.model.embed_tokens.scale)
    assert torch.equal(qm.model.embed_tokens(ids), table[ids])
    with torch.no_grad():   # eagerly the grouped kernel is the reference, exactly
        assert torch.equal(qm(ids), quantize_model(model, kernel="reference", group_size=16)(ids))


def test_quantize_model_copies_ties_and_leaves_the_original_alone() -> None:
    model = sharp_model(SMALL, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qm = quantize_model(model)
    assert isinstance(qm, QuantizedTinyLlama) and not isinstance(model, QuantizedTinyLlama)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert all(isinstance(m, (Int8Linear, Int8Embedding)) for m in
               (qm.model.layers[1].mlp.down_proj, qm.model.embed_tokens, qm.lm_head))
    # Tied: one int8 table (and one set of scales) serves the lookup and the LM head.
    assert qm.lm_head.qweight is qm.model.embed_tokens.qweight
    assert qm.dtype == torch.float32 and qm.device == model.device
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(qm)
    kept = quantize_model(model, embeddings=False)
    assert isinstance(kept.model.embed_tokens, torch.nn.Embedding)
    assert kept.lm_head.weight is kept.model.embed_tokens.weight


def test_kernels_agree_on_a_whole_model() -> None:
    model = sharp_model(SMALL, seed=1)
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 20, seed=3)])
    with torch.no_grad():
        ref = quantize_model(model, kernel="reference")(ids)
        for kernel in ("scale_after", "int8pack", "auto"):
            torch.testing.assert_close(quantize_model(model, kernel=kernel)(ids), ref,
                                       rtol=1e-4, atol=1e-3)


def test_weight_memory_is_really_smaller(target: TinyLlama) -> None:
    fp32 = weight_bytes(target)
    # The tied matrix is counted once: 5.2M parameters x 4 bytes.
    assert fp32 == 4 * target.num_parameters()
    qm = quantize_model(target)
    int8 = weight_bytes(qm)
    scales = sum(m.scale.nbytes for m in qm.modules() if isinstance(m, Int8Linear))
    norms = sum(p.nbytes for p in qm.parameters())
    linear = sum(m.qweight.nbytes for m in qm.modules() if isinstance(m, Int8Linear))
    assert int8 == linear + scales + norms  # nothing else is stored
    assert 3.8 < fp32 / int8 < 4.0
    assert 2.3 < fp32 / weight_bytes(quantize_model(target, embeddings=False)) < 2.6


def test_tensor_bytes_counts_a_shared_storage_once() -> None:
    a = torch.zeros(10)
    assert tensor_bytes([a, a, a[:5]]) == 40


# ------------------------------------------------------------------ int8 KV cache

def test_int8_cache_matches_the_float_cache_step_by_step() -> None:
    model = sharp_model(SMALL, seed=4)
    prompt = torch.tensor([random_prompt(SMALL.vocab_size, 12, seed=5)])
    ref, q8 = KVCache.for_model(model, 1, 30), Int8KVCache.for_model(model, 1, 30)
    with torch.no_grad():
        a, b = model(prompt, torch.arange(12)[None], ref), model(prompt, torch.arange(12)[None], q8)
        for pos in range(12, 30):
            torch.testing.assert_close(b, a, rtol=0, atol=0.05 * float(a.abs().max()))
            assert int(b[0, -1].argmax()) == int(a[0, -1].argmax())
            token = a[:, -1].argmax(-1, keepdim=True)
            a, b = model(token, torch.tensor([[pos]]), ref), model(token, torch.tensor([[pos]]), q8)
    assert q8.lengths == ref.lengths == [30]
    assert q8.k.dtype == torch.int8 and q8.k.shape == ref.k.shape


def test_int8_cache_keeps_rewind_and_ragged_writes() -> None:
    """Right-padded prefill, rewind, then rows writing at different positions (the advanced
    index path): the same tokens as the float cache, and the same errors at the limit."""
    model = sharp_model(SMALL, seed=6)
    ids = torch.tensor([random_prompt(SMALL.vocab_size, 9, seed=7),
                        random_prompt(SMALL.vocab_size, 9, seed=8)])
    outs = {}
    for cls in (KVCache, Int8KVCache):
        cache = cls.for_model(model, 2, 16)
        with torch.no_grad():
            model(ids, torch.arange(9).expand(2, 9), cache)
            cache.rewind([9, 5])
            last = torch.tensor([[9], [5]])
            tokens = []
            for _ in range(4):
                logits = model(torch.tensor([[3], [4]]), last, cache)
                tokens.append(logits[:, -1].argmax(-1).tolist())
                last = last + 1
        outs[cls] = (tokens, list(cache.lengths))
        with pytest.raises(CacheFullError, match="holds 16 tokens"):
            model(torch.tensor([[1], [1]]), torch.tensor([[16], [9]]), cache)
    assert outs[KVCache] == outs[Int8KVCache]
    assert outs[Int8KVCache][1] == [13, 9]


def test_int8_cache_memory_is_about_3_6x_smaller(target: TinyLlama) -> None:
    ref, q8 = KVCache.for_model(target, 4, 512), Int8KVCache.for_model(target, 4, 512)
    cfg = target.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.head_dim + 4)
    assert q8.nbytes == 4 * 512 * per_token
    assert ref.nbytes / q8.nbytes == pytest.approx(128 / 36)


# ------------------------------------------------------------------ the shipped target's quality

def test_validation_windows_are_the_model_cards(windows: torch.Tensor) -> None:
    from tinyserve.corpus import build_corpus
    from tinyserve.train import eval_windows, token_stream
    _, val = build_corpus(seed=0)
    assert windows.shape == (2, 513)
    assert torch.equal(windows, eval_windows(token_stream(val[:20]), 512, 65_536)[:2])


def test_int8_weights_keep_the_target_within_bounds(target, windows) -> None:
    q = quality(target, quantize_model(target), windows)
    print(q)  # the figures, for the record: pytest -s
    assert q["max_abs_logit_error"] < 1.0
    assert q["rel_rms_logit_error"] < 0.05
    assert q["greedy_agreement"] >= 0.98
    assert abs(q["val_loss_delta"]) < 0.01       # under 1% either way
    per_tensor = quantize_model(target)
    for m in per_tensor.modules():  # the classic mistake: one scale for a whole matrix
        if isinstance(m, Int8Linear):
            w = dequantize_rows(m.qweight, m.scale)
            qt, st = quantize_per_tensor(w)
            m.qweight, m.scale = qt, st.expand(m.out_features).clone()
    worse = quality(target, per_tensor, windows)
    # Measured: 3.2% relative RMS error, 96.9% agreement, +0.14% val loss.
    assert worse["rel_rms_logit_error"] > 1.5 * q["rel_rms_logit_error"]
    assert worse["greedy_agreement"] < q["greedy_agreement"]
    assert worse["val_loss_delta"] > q["val_loss_delta"]


def test_int8_kv_cache_keeps_the_target_within_bounds(target, windows) -> None:
    q = quality(target, target, windows, cache_cls=Int8KVCache)
    print(q)
    assert q["max_abs_logit_error"] < 0.75
    assert q["rel_rms_logit_error"] < 0.02
    assert q["greedy_agreement"] >= 0.99
    assert abs(q["val_loss_delta"]) < 0.005
    same = quality(target, target, windows, cache_cls=KVCache)  # the float cache: ~exact
    assert same["max_abs_logit_error"] < 1e-3 < q["max_abs_logit_error"]


def test_a_bf16_model_quantizes_and_generates() -> None:
    """The GPU path's dtype (bf16 activations) on the CPU: scales and lookups follow the
    model's dtype, and the engine's generate() runs the int8 model with either cache."""
    from tinyserve.generate import generate
    model = sharp_model(SMALL, seed=9)
    bf16 = quantize_model(TinyLlama(SMALL).to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16
    assert bf16(torch.tensor([[1, 2, 3]])).dtype == torch.float32  # logits are always fp32
    assert KVCache.for_model(bf16).k.dtype == torch.bfloat16
    prompt = random_prompt(SMALL.vocab_size, 6, seed=10)
    ref = generate(quantize_model(model, kernel="reference"), prompt, 12).tokens
    assert generate(quantize_model(model), prompt, 12).tokens == ref
    assert len(ref) == 12
