"""The model's invariants: shapes, grouped-query attention, causality, rotary positions."""
from __future__ import annotations

import pytest
import torch

from tinyserve.config import PRESETS, ModelConfig
import torch.nn.functional as F

import tinyserve.model as model_module
from tinyserve.model import (RMSNorm, TinyLlama, apply_rope, apply_rope_qk, causal_mask,
                             rope_cos_sin)

SMALL = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama(SMALL).eval()


def test_logits_shape_and_dtype(model: TinyLlama) -> None:
    ids = torch.randint(0, SMALL.vocab_size, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, SMALL.vocab_size)
    assert logits.dtype == torch.float32


def test_grouped_query_attention_has_fewer_kv_heads(model: TinyLlama) -> None:
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == SMALL.num_attention_heads * SMALL.head_dim
    assert attn.k_proj.out_features == SMALL.num_key_value_heads * SMALL.head_dim
    assert attn.v_proj.out_features == SMALL.num_key_value_heads * SMALL.head_dim
    assert SMALL.n_rep == 2


def test_embeddings_are_tied_and_counted_once(model: TinyLlama) -> None:
    assert model.lm_head.weight is model.model.embed_tokens.weight
    h, v, L, f = SMALL.hidden_size, SMALL.vocab_size, SMALL.num_hidden_layers, SMALL.intermediate_size
    kv = SMALL.num_key_value_heads * SMALL.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # projections, MLP, two norms
    assert model.num_parameters() == v * h + L * per_layer + h


def test_shipped_presets_sizes() -> None:
    target, draft = TinyLlama(PRESETS["target"]), TinyLlama(PRESETS["draft"])
    assert 5_000_000 <= target.num_parameters() <= 10_000_000
    ratio = PRESETS["target"].flops_per_token(256) / PRESETS["draft"].flops_per_token(256)
    assert 8 <= ratio <= 12, f"draft should cost ~10x fewer FLOPs per token, got {ratio:.1f}x"
    assert draft.config.num_key_value_heads < draft.config.num_attention_heads


def test_future_tokens_do_not_change_past_logits(model: TinyLlama) -> None:
    ids = torch.randint(0, SMALL.vocab_size, (1, 12))
    changed = ids.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % SMALL.vocab_size
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_explicit_positions_match_fused_causal_path(model: TinyLlama) -> None:
    ids = torch.randint(0, SMALL.vocab_size, (2, 16))
    fused = model(ids)                                # positions=None: is_causal kernel
    masked = model(ids, torch.arange(16))             # explicit positions: boolean mask
    torch.testing.assert_close(fused, masked, rtol=1e-5, atol=1e-5)


def test_rows_of_a_batch_are_independent(model: TinyLlama) -> None:
    ids = torch.randint(0, SMALL.vocab_size, (4, 9))
    batched = model(ids)
    for i in range(4):
        torch.testing.assert_close(batched[i: i + 1], model(ids[i: i + 1]), rtol=1e-5, atol=1e-5)


def test_rope_makes_attention_depend_only_on_relative_position(model: TinyLlama) -> None:
    # RoPE is the model's only source of position, so shifting every position by the same
    # amount must leave the logits unchanged.
    ids = torch.randint(0, SMALL.vocab_size, (1, 10))
    base = model(ids, torch.arange(10))
    shifted = model(ids, torch.arange(10) + 37)
    torch.testing.assert_close(base, shifted, rtol=1e-4, atol=1e-4)


def test_rope_rotation_preserves_norm_and_relative_dot_product() -> None:
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def rotated(x: torch.Tensor, pos: int) -> torch.Tensor:
        cos, sin = rope_cos_sin(torch.tensor([[pos]]), 16, 10000.0, torch.float32)
        return apply_rope(x, cos, sin)

    torch.testing.assert_close(rotated(q, 5).norm(), q.norm())
    d1 = (rotated(q, 9) * rotated(k, 4)).sum()
    d2 = (rotated(q, 25) * rotated(k, 20)).sum()
    torch.testing.assert_close(d1, d2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T", [(1, 1), (3, 5)])
def test_one_rotary_pass_for_q_and_k_equals_two_calls(dtype, B, T) -> None:
    # q and k as Attention makes them: transposed views of one projection's output.
    g = torch.Generator().manual_seed(5)
    H, KV, d = 4, 2, 8
    qk = torch.randn(B, T, (H + KV) * d, generator=g).to(dtype)
    q = qk[..., :H * d].view(B, T, H, d).transpose(1, 2)
    k = qk[..., H * d:].view(B, T, KV, d).transpose(1, 2)
    cos, sin = rope_cos_sin(torch.arange(T).expand(B, T) + 3, d, 10000.0, dtype)
    q1, k1 = apply_rope_qk(q, k, cos, sin)
    assert torch.equal(q1, apply_rope(q, cos, sin)) and torch.equal(k1, apply_rope(k, cos, sin))
    assert q1.shape == (B, H, T, d) and k1.shape == (B, KV, T, d)


def test_the_model_with_one_rotary_pass_gives_the_two_call_logits(model, monkeypatch) -> None:
    ids = torch.randint(0, SMALL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        one = model(ids, torch.arange(9) + 2)
        monkeypatch.setattr(model_module, "apply_rope_qk", lambda q, k, cos, sin: (
            apply_rope(q, cos, sin), apply_rope(k, cos, sin)))
        assert torch.equal(model(ids, torch.arange(9) + 2), one)


def test_rms_norm_on_the_cpu_casts_around_an_fp32_norm() -> None:
    # The CPU path stays the plain one in bf16: normalise in fp32, round, then the gain.
    norm = RMSNorm(16, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    x = (torch.randn(3, 16, generator=torch.Generator().manual_seed(7)) * 1e-3).bfloat16()
    want = norm.weight * F.rms_norm(x.float(), (16,), eps=1e-5).to(torch.bfloat16)
    assert torch.equal(norm(x), want)


@pytest.mark.gpu
def test_rms_norm_on_cuda_is_one_fused_call_within_a_bf16_step() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    norm = RMSNorm(256, 1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 256))
    x = (torch.randn(4, 256, device="cuda") * 1e-3).bfloat16()   # tiny: bf16 squares underflow
    with torch.no_grad(), Ops() as ops:
        out = norm(x)
    # One operator call, no casts around it (a mode sees rms_norm or the op it sends to).
    assert ops.names in (["aten.rms_norm"], ["aten._fused_rms_norm"]), ops.names
    want = F.rms_norm(x.float(), (256,), norm.weight.float(), 1e-5)   # fp32 throughout
    # rounded once to bf16: within half a bf16 step (2^-9 relative), plus slack for the order
    torch.testing.assert_close(out.float(), want, rtol=2 ** -8, atol=0)


def test_causal_mask_hides_future_and_empty_slots() -> None:
    q_pos = torch.tensor([[2, 3]])
    k_pos = torch.tensor([[0, 1, 2, 3, -1]])            # -1: an empty slot
    mask = causal_mask(q_pos, k_pos)[0, 0]
    assert mask.tolist() == [[True, True, True, False, False],
                             [True, True, True, True, False]]


def test_position_outside_context_window_is_a_clear_error(model: TinyLlama) -> None:
    ids = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="context window of 64 tokens"):
        model(ids, torch.tensor([64]))


@pytest.mark.parametrize("kwargs, fragment", [
    ({"hidden_size": 30, "num_attention_heads": 4}, "divisible"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
])
def test_invalid_configs_are_rejected(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ModelConfig(**kwargs)


@pytest.mark.gpu
def test_model_runs_in_bf16_on_cuda() -> None:
    torch.manual_seed(0)
    m = TinyLlama(SMALL).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 8), device="cuda")
    ref = TinyLlama(SMALL).eval()
    ref.load_state_dict({k: v.float().cpu() for k, v in m.state_dict().items()})
    torch.testing.assert_close(m(ids).cpu(), ref(ids.cpu()), rtol=0.05, atol=0.05)


def test_fused_projections_equal_separate_ones_and_follow_weight_changes() -> None:
    # Inference stacks q/k/v (and gate/up) into one matmul; training and the reference keep
    # separate layers. Both must give the same logits, and an in-place weight change (an
    # optimizer step, load_state_dict) must reach the stacked copy.
    torch.manual_seed(3)
    model = TinyLlama(SMALL).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 7))
    separate = model(ids)                     # autograd on: the plain per-layer path
    with torch.no_grad():
        torch.testing.assert_close(model(ids), separate, rtol=1e-5, atol=1e-5)
        attn = model.model.layers[0].self_attn
        assert "_fused_weight" in attn.__dict__
        attn.k_proj.weight.mul_(2)            # in place: same storage, new version
        fused_after = model(ids)
    changed = model(ids)                      # autograd on again: separate layers
    torch.testing.assert_close(fused_after, changed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, separate)
    assert all("_fused" not in k for k in model.state_dict())   # names unchanged for export


def test_wide_outputs_are_stored_transposed_and_give_the_same_logits() -> None:
    # The stacked copy of a layer whose output is wider than its input (q/k/v, gate/up, the
    # LM head) is kept (in, out) for a faster one-row matmul; the logits must not change.
    torch.manual_seed(4)
    model = TinyLlama(SMALL).eval()
    ids = torch.randint(0, SMALL.vocab_size, (3, 6))
    separate = model(ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), separate, rtol=1e-5, atol=1e-5)
    _, head, sizes, transposed = model.__dict__["_fused_weight"]
    assert transposed and sizes == [SMALL.vocab_size]
    assert head.shape == (SMALL.hidden_size, SMALL.vocab_size) and head.is_contiguous()
    mlp = model.model.layers[0].mlp.__dict__["_fused_weight"]
    assert mlp[3] and mlp[1].shape == (SMALL.hidden_size, 2 * SMALL.intermediate_size)


def test_a_model_that_ran_inference_can_cross_to_another_process() -> None:
    # The stacked copy is made outside inference mode, where autograd is on again: it must
    # not require grad, or multiprocessing refuses to send the model (chapter 7's ranks).
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 (registers torch's tensor reducers)
    model = TinyLlama(SMALL).eval()
    with torch.inference_mode():
        model(torch.randint(0, SMALL.vocab_size, (1, 5)))
    copies = [m.__dict__["_fused_weight"][1] for m in model.modules() if "_fused_weight" in m.__dict__]
    assert copies and not any(c.requires_grad for c in copies)
    ForkingPickler.dumps(model)


def test_rope_table_rows_equal_rope_cos_sin_and_follow_the_dtype() -> None:
    # At inference the rotary cos/sin come from a table of every position; it must hold
    # exactly what rope_cos_sin computes, and be rebuilt when the model changes dtype.
    model = TinyLlama(SMALL).eval()
    positions = torch.tensor([[0, 5, 63], [7, 7, 1]])
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype)
            cos, sin = model.rope(positions)
            ref_cos, ref_sin = rope_cos_sin(positions, SMALL.head_dim, SMALL.rope_theta, dtype)
            assert cos.dtype == dtype and cos.shape == ref_cos.shape == (2, 1, 3, SMALL.head_dim)
            torch.testing.assert_close(cos, ref_cos, rtol=0, atol=0)
            torch.testing.assert_close(sin, ref_sin, rtol=0, atol=0)
    assert all("rope" not in k for k in model.state_dict())     # nothing new to export
