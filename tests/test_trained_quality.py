"""bench trained_quality (issue 52, M5): the 8-bit schemes' quality measured on a trained
model, not the scale model's random weights. Its measurement's shape and invariants on a tiny
model (fp32 against itself is exact; each int8 scheme's error is small and not zero), the
q8_0 layout, the ratios and notes, and the report without llama.cpp (ours measured, q8_0 said
absent). Seconds; nothing is timed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import bench
from bench.common import load_bench_model
from bench.headlines import BY_SUITE, SUITES
from bench.suites import trained_quality as tq
from tinyserve.config import ModelConfig
from tinyserve.model import TinyLlama
from tinyserve.quant import Int8Linear, quality


@pytest.fixture(scope="module")
def tiny() -> tuple[TinyLlama, torch.Tensor]:
    """The quick model (seeded, weights scaled away from near-ties) and random windows."""
    model, _ = load_bench_model(True)
    windows, _ = tq.windows_for(True, model)
    return model, windows


def test_fp32_against_itself_is_exact(tiny) -> None:
    model, windows = tiny
    want = tq.logits(model, windows[:, :-1])
    q = tq.logit_quality(want, want.clone(), windows[:, 1:])
    assert q["max_abs_logit_error"] == q["mean_abs_logit_error"] == 0.0
    assert q["rel_rms_logit_error"] == 0.0 and q["loss_delta"] == 0.0
    assert q["top1_agreement"] == 1.0 and q["top1_agreed"] == q["tokens"] == windows[:, 1:].numel()
    assert q["cross_entropy"] == q["reference_cross_entropy"] > 0
    assert q["perplexity"] == pytest.approx(torch.tensor(q["cross_entropy"]).exp().item())


def test_logits_of_other_positions_are_refused(tiny) -> None:
    model, windows = tiny
    want = tq.logits(model, windows[:, :-1])
    with pytest.raises(ValueError, match="the same positions on both sides"):
        tq.logit_quality(want, want[:, :-1], windows[:, 1:])


def test_each_int8_scheme_errs_a_little_and_not_at_all_zero(tiny) -> None:
    model, windows = tiny
    ids, targets = windows[:, :-1], windows[:, 1:]
    want = tq.logits(model, ids)
    schemes = tq.our_schemes(model)
    assert {"int8_q8_layout", "int8_row", "int8_kv"} <= set(schemes) <= set(tq.SCHEMES)
    for label, (m, cache) in schemes.items():
        q = tq.logit_quality(want, tq.logits(m, ids, cache), targets)
        assert 0 < q["mean_abs_logit_error"] <= q["max_abs_logit_error"], label
        assert 0 < q["rel_rms_logit_error"] < 0.1, label          # 8 bits: a few percent
        assert q["top1_agreement"] >= 0.8, label
        assert abs(q["loss_delta"]) < 0.02, label
    # a scale per 32 weights is finer than one per row: closer to fp32 on the same weights
    by = {label: tq.logit_quality(want, tq.logits(m, ids, c), targets)
          for label, (m, c) in schemes.items()}
    assert by["int8_q8_layout"]["rel_rms_logit_error"] < by["int8_row"]["rel_rms_logit_error"]
    assert torch.equal(tq.logits(model, ids), want)               # the fp32 model untouched


def test_the_figures_are_the_course_quality_measures(tiny) -> None:
    # one definition: the suite's logit error, agreement and loss are tinyserve.quant.quality's
    model, windows = tiny
    m, _ = tq.our_schemes(model)["int8_row"]
    ours = tq.logit_quality(tq.logits(model, windows[:, :-1]), tq.logits(m, windows[:, :-1]),
                            windows[:, 1:])
    course = quality(model, m, windows)
    for key, theirs in (("max_abs_logit_error", "max_abs_logit_error"),
                        ("rel_rms_logit_error", "rel_rms_logit_error"),
                        ("top1_agreement", "greedy_agreement"), ("loss_delta", "val_loss_delta"),
                        ("cross_entropy", "val_loss")):
        assert ours[key] == pytest.approx(course[theirs], rel=1e-5, abs=1e-7), key


def test_the_q8_layout_quantizes_what_llamacpps_q8_0_file_quantizes() -> None:
    # 48 inputs to down_proj: 32 does not divide them, so llama.cpp's converter keeps that
    # matrix F16 and ours keeps it float; every other matrix gets a scale per 32
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = TinyLlama(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q8 = tq.q8_layout(model)
    assert tq.float_matrices(q8) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    layer = q8.model.layers[0]
    for linear in (layer.self_attn.q_proj, layer.mlp.up_proj, q8.lm_head):
        assert isinstance(linear, Int8Linear) and linear.group_size == 32
    assert q8.lm_head.qweight is q8.model.embed_tokens.qweight         # still tied
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="not a multiple of 32"):
        tq.q8_layout(TinyLlama(ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           num_key_value_heads=1, max_position_embeddings=32)))


def _q(agreement: float, rms: float, agreed: int = 0) -> dict[str, float]:
    return {"top1_agreement": agreement, "rel_rms_logit_error": rms, "top1_agreed": agreed,
            "tokens": 1000, "loss_delta": 0.0}


def test_ratios_set_ours_against_fp32_and_against_q8_0_where_it_ran() -> None:
    alone = tq.compute_ratios({"int8_q8_layout": _q(0.995, 0.01)})
    assert alone == {"trained_int8_agreement_vs_fp32": 0.995}
    both = tq.compute_ratios({"int8_q8_layout": _q(0.995, 0.01), "llamacpp_q8_0": _q(0.98, 0.04)})
    assert both["trained_int8_agreement_vs_llamacpp_q8"] == pytest.approx(0.995 / 0.98)
    assert both["trained_int8_logit_error_vs_llamacpp_q8"] == pytest.approx(0.25)
    none = tq.compute_ratios({"int8_q8_layout": _q(0.9, 0.01), "llamacpp_q8_0": _q(0.0, 0.0)})
    assert set(none) == {"trained_int8_agreement_vs_fp32"}          # nothing to divide by


def test_llamacpps_f32_must_reproduce_ours_before_q8_0_is_compared() -> None:
    tq.check_f32({"int8_q8_layout": _q(0.99, 0.01)})                    # no llama.cpp: nothing
    tq.check_f32({"llamacpp_f32": _q(1.0, 0.0002, 1000)})               # float rounding: fine
    with pytest.raises(RuntimeError, match="the export or the conversion is wrong"):
        tq.check_f32({"llamacpp_f32": _q(0.9, 0.05, 900)})
    with pytest.raises(RuntimeError, match="top-1 kept 900 of 1000"):
        tq.check_f32({"llamacpp_f32": _q(0.9, float("nan"), 900)})     # NaN logits stop too


def test_notes_explain_a_missed_goal_and_an_absent_q8_0() -> None:
    quality_ = {"int8_q8_layout": _q(0.97, 0.02, 970), "llamacpp_q8_0": _q(0.98, 0.03, 980),
                "llamacpp_f32": _q(1.0, 0.0, 1000)}
    notes = tq.explain(tq.compute_ratios(quality_), quality_, None)
    assert set(notes) == {"trained_int8_agreement_vs_fp32", "trained_int8_agreement_vs_llamacpp_q8"}
    assert "kept 970 of 1000" in notes["trained_int8_agreement_vs_fp32"]
    assert "q8_0 980 (llama.cpp's f32 1000)" in notes["trained_int8_agreement_vs_llamacpp_q8"]
    good = {"int8_q8_layout": _q(0.999, 0.01, 999)}
    assert tq.explain(tq.compute_ratios(good), good, None) == {}
    absent = tq.explain(tq.compute_ratios(good), good, "llama.cpp is not ready: X")
    assert absent == {"llamacpp": "q8_0 not measured: llama.cpp is not ready: X"}


def test_the_ledger_reads_quality_from_the_trained_target_only() -> None:
    entry = BY_SUITE["trained_quality"]
    goals = {h.name: h.goal for h in entry.headlines}
    assert list(goals) == ["trained_int8_agreement_vs_fp32", "trained_int8_agreement_vs_llamacpp_q8",
                           "trained_int8_logit_error_vs_llamacpp_q8"]
    assert goals["trained_int8_agreement_vs_fp32"].met(0.99)
    assert not goals["trained_int8_agreement_vs_fp32"].met(0.989)
    assert goals["trained_int8_agreement_vs_llamacpp_q8"].met(1.0)
    assert not goals["trained_int8_agreement_vs_llamacpp_q8"].met(0.99)
    assert "tinyserve/assets/models/target" in entry.sources
    # retired (issue 52, M5): agreement on the scale model's random weights counts near-ties
    assert not [h.name for s in SUITES for h in s.headlines
                if h.name.startswith("scale_") and "agreement" in h.name]
    assert not tq.BENCH_ALL                   # a run without llama.cpp must not replace q8_0's


def test_quick_run_writes_ours_and_says_q8_0_was_not_run(tmp_path: Path) -> None:
    out = tmp_path / "trained_quality.json"
    bench.run_suite("trained_quality", json_path=str(out), quick=True)
    data = json.loads(out.read_text())
    assert data["quick"] and data["suite"] == "trained_quality"
    assert set(data["ratios"]) == {"trained_int8_agreement_vs_fp32"}
    assert not data["measurements"]["llamacpp_measured"]
    assert "q8_0 not measured" in data["notes"]["llamacpp"]
    assert {"int8_q8_layout", "int8_row", "int8_kv"} <= set(data["measurements"]["quality"])


def test_without_llamacpp_the_trained_target_is_measured_and_q8_0_named_absent(
        tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TINYSERVE_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.setattr(tq, "WINDOWS", 1)                 # one held-out window: seconds
    out = tmp_path / "trained_quality.json"
    data = tq.run(json_path=str(out), quick=False)
    err = capsys.readouterr().err
    assert "llama.cpp's q8_0: not measured here" in err and "make peers" in err
    assert "Our schemes were measured" in err and "Nothing was measured" not in err
    assert data["conditions"]["model"] == "target" and data["conditions"]["positions"] == 512
    q = data["measurements"]["quality"]
    assert "llamacpp_q8_0" not in q and set(data["ratios"]) == {"trained_int8_agreement_vs_fp32"}
    # the trained target's down_proj (688 inputs) stays float in q8_0's layout, as in its file
    assert data["measurements"]["float_in_q8_layout"] == [
        f"model.layers.{i}.mlp.down_proj" for i in range(6)]
    for label in ("int8_q8_layout", "int8_row", "int8_kv"):
        assert 0 < q[label]["rel_rms_logit_error"] < 0.05 and q[label]["top1_agreement"] > 0.97
    assert json.loads(out.read_text())["ratios"] == data["ratios"]
