"""bench llamacpp's pure parts, without llama.cpp: the token agreement count, the ratios from
per-round times, the notes on missed goals, and what the suite says (and does not write) when
``make peers`` has not built the peer. Seconds; nothing is timed or converted."""
from __future__ import annotations

import json

import pytest

from bench.headlines import BY_SUITE
from bench.suites import llamacpp

RATIOS = ("scale_fast_vs_llamacpp_f32_decode", "scale_int8_vs_llamacpp_q8_decode",
          "scale_prefill_vs_llamacpp_f32")


def test_agreement_counts_leading_tokens_only() -> None:
    assert llamacpp.leading_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert llamacpp.leading_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 1   # later matches: noise
    assert llamacpp.leading_agreement([1, 2], [7, 2]) == 0
    assert llamacpp.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 0], [4, 5, 6]]) == 5
    with pytest.raises(ValueError, match="2 reference runs against 1"):
        llamacpp.agreement([[1], [2]], [[1]])


def _times() -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    decode = {"fast": [8.0, 9.0, 30.0], "eager": [12.0, 12.0, 12.0], "int8": [5.0, 5.0, 5.0],
              "int8_rowwise": [4.0, 4.0, 4.0],
              "llamacpp_f32": [10.0, 10.0, 10.0], "llamacpp_q8_0": [4.0, 5.0, 2.0]}
    prefill = {"fast": [2.0, 2.0, 2.0], "fp32": [4.0, 4.0, 4.0], "int8": [1.0, 1.0, 1.0],
               "int8_rowwise": [0.5, 0.5, 0.5],
               "llamacpp_f32": [1.0, 4.0, 2.0], "llamacpp_q8_0": [1.0, 1.0, 1.0]}
    return decode, prefill


def test_ratios_are_ours_over_theirs_median_of_same_round_pairs() -> None:
    decode, prefill = _times()
    ratios = llamacpp.compute_ratios(decode, prefill)
    assert set(RATIOS) <= set(ratios)
    assert ratios["scale_fast_vs_llamacpp_f32_decode"] == pytest.approx(0.9)   # 0.8 0.9 3.0
    assert ratios["scale_int8_vs_llamacpp_q8_decode"] == pytest.approx(1.25)   # 1.25 1 2.5
    assert ratios["scale_prefill_vs_llamacpp_f32"] == pytest.approx(1.0)       # 2 0.5 1
    # the goal's prefill is the fast path's; plain eager's beside it
    assert ratios["scale_eager_prefill_vs_llamacpp_f32"] == pytest.approx(2.0)  # 4 1 2
    # the per-row fbgemm model beside it, under its own names
    assert ratios["scale_int8_rowwise_vs_llamacpp_q8_decode"] == pytest.approx(1.0)  # 1 .8 2
    assert ratios["scale_int8_rowwise_prefill_vs_llamacpp_q8"] == pytest.approx(0.5)
    assert llamacpp.median_pair_ratio([1.0, 3.0], [1.0, 1.0]) == 2.0           # even: the mean
    # issue 52 (M5): the scale model's tokens kept count near-ties on random weights, so no
    # agreement ratio is taken from them (quality is bench trained_quality's)
    assert not [name for name in ratios if "agreement" in name]


def test_the_ledger_declares_the_three_ratios_with_goals() -> None:
    entry = BY_SUITE["llamacpp"]
    assert [h.name for h in entry.headlines] == list(RATIOS)
    assert all(h.goal is not None for h in entry.headlines)
    goals = {h.name: h.goal for h in entry.headlines}
    assert goals["scale_fast_vs_llamacpp_f32_decode"].met(0.9)
    assert not goals["scale_fast_vs_llamacpp_f32_decode"].met(0.91)
    assert "bench/suites/llamacpp.py" in entry.sources
    assert "tinyserve/hf_export.py" in entry.sources


def test_notes_explain_missed_goals_and_a_busy_machine() -> None:
    decode, prefill = _times()
    kept = {"int8": 30, "int8_rowwise": 20, "llamacpp_q8_0": 40, "llamacpp_f32": 128}
    ratios = llamacpp.compute_ratios(decode, prefill)
    m = {"decode_s": decode, "prefill_s": prefill,
         "tokens": {"leading_tokens_kept": kept, "possible": 128}}
    notes = llamacpp.explain(ratios, m, [1.8, 2.1])
    assert set(notes) == {"scale_int8_vs_llamacpp_q8_decode", "load"}   # no tokens-kept note
    assert "not a quiet machine" in notes["load"]
    assert "load" not in llamacpp.explain(ratios, m, [0.2, 0.4])
    # after the run the average holds the run's own thread: not someone else's work
    assert "load" not in llamacpp.explain(ratios, m, [0.1, 1.6])
    assert "load" in llamacpp.explain(ratios, m, [0.1, 2.7])
    assert "read rates" not in notes["scale_int8_vs_llamacpp_q8_decode"]   # no bytes: none


def test_a_missed_decode_goal_names_each_sides_read_rate() -> None:
    decode, prefill = _times()
    ratios = llamacpp.compute_ratios(decode, prefill)
    m = {"decode_s": decode, "prefill_s": prefill,
         "tokens": {"leading_tokens_kept": {"int8": 40, "llamacpp_q8_0": 40}, "possible": 128},
         "weight_bytes": {"fp32": 4 * 10**9 * min(decode["fast"]),           # 4 GB/s
                          "int8": 10**9 * min(decode["int8"])},              # 1 GB/s
         "gguf": {"files": {"q8_0": {"bytes": 2 * 10**9 * min(decode["llamacpp_q8_0"])},
                            "f32": {"bytes": 1}}}}
    note = llamacpp.explain(ratios, m, [0.1, 0.1])["scale_int8_vs_llamacpp_q8_decode"]
    assert "ours 1.0 GB/s" in note and "llama.cpp 2.0" in note
    assert "our fp32 fast step 4.0" in note and "arithmetic" in note
    assert "the read probe" not in note                      # no probe in this report
    m["read_probe_bytes_per_s"] = [5e9, 8e9, 6e9]            # the best round: 8 GB/s
    note = llamacpp.explain(ratios, m, [0.1, 0.1])["scale_int8_vs_llamacpp_q8_decode"]
    assert "the memory 8.0" in note and "ours at 0.12 of it, llama.cpp at 0.25" in note


def test_a_missed_fp32_decode_goal_holds_both_against_the_memory_not_our_own_step() -> None:
    decode, prefill = _times()
    decode["fast"] = [20.0, 20.0, 20.0]                      # 2x llama.cpp f32's 10
    ratios = llamacpp.compute_ratios(decode, prefill)
    size = 8 * 10**10                                        # both read it: 4 and 8 GB/s
    m = {"decode_s": decode, "prefill_s": prefill,
         "tokens": {"leading_tokens_kept": {"int8": 40, "llamacpp_q8_0": 40}, "possible": 128},
         "weight_bytes": {"fp32": size, "int8": size // 4},
         "gguf": {"files": {"f32": {"bytes": size}, "q8_0": {"bytes": size // 4}}},
         "read_probe_bytes_per_s": [8e9, 7e9]}
    note = llamacpp.explain(ratios, m, [0.1, 0.1])["scale_fast_vs_llamacpp_f32_decode"]
    assert "ours 4.0 GB/s" in note and "llama.cpp 8.0" in note
    assert "ours at 0.50 of it, llama.cpp at 1.00" in note
    assert "same fp32 bytes" in note and "arithmetic" not in note
    assert "streams better on this core" in note
    decode["fast"] = [10.5, 10.5, 10.5]                      # 7.6 GB/s against 8.0: both near
    m["read_probe_bytes_per_s"] = [8.2e9]                    # the memory (0.93 and 0.98 of it)
    ratios = llamacpp.compute_ratios(decode, prefill)
    note = llamacpp.explain(ratios, m, [0.1, 0.1])["scale_fast_vs_llamacpp_f32_decode"]
    assert "at about the memory's rate" in note and "asks for more than the memory gives" in note


def test_prefill_flops_count_the_matmuls_run_one_head_row_and_causal_attention() -> None:
    from tinyserve.config import PRESETS
    cfg = PRESETS["target"]
    head = 2 * cfg.hidden_size * cfg.vocab_size
    mlp = 2 * 3 * cfg.hidden_size * cfg.intermediate_size
    # one token: a decode step's FLOPs at context 1 (it attends to itself)
    assert llamacpp.prefill_flops(cfg, 1) == cfg.flops_per_token(1)
    # each further token adds its matmuls without the LM head and without the last layer's
    # MLP (only the last position's runs), and attends to one more position
    three = llamacpp.prefill_flops(cfg, 3)
    body = cfg.flops_per_token(0) - head
    assert three == 3 * body - 2 * mlp + head + sum(
        cfg.flops_per_token(c) - cfg.flops_per_token(0) for c in (1, 2, 3))
    assert three < 3 * cfg.flops_per_token(3)


def test_a_missed_prefill_goal_names_each_sides_flop_rate_beside_torchs_kernels() -> None:
    decode, prefill = _times()
    prefill["fast"] = [2.0, 5.0, 1.5]            # against 1, 4, 2: 2.0, 1.25, 0.75
    ratios = llamacpp.compute_ratios(decode, prefill)
    assert ratios["scale_prefill_vs_llamacpp_f32"] == pytest.approx(1.25)
    m = {"decode_s": decode, "prefill_s": prefill,
         "tokens": {"leading_tokens_kept": {"int8": 40, "llamacpp_q8_0": 40}, "possible": 128},
         "prefill_flops": 3 * 10**9,
         "kernel_probes": {"probe_mkl": {"flops": 4 * 10**9, "seconds": [2.0, 1.0, 4.0]},
                           "probe_onednn": {"flops": 4 * 10**9, "seconds": [0.5, 0.8]}},
         "kernel_probe_shape": "the prefill's up_proj"}
    note = llamacpp.explain(ratios, m, [0.1, 0.1])["scale_prefill_vs_llamacpp_f32"]
    assert "ours (fast) 2 GFLOP/s, llama.cpp 3" in note              # 3 GFLOP / 1.5 s, / 1 s
    assert "MKL's sgemm, what the eager prefill runs) 4" in note     # its best: 4 GFLOP / 1 s
    assert "measured faster) 8" in note                              # 4 GFLOP / 0.5 s
    assert "at the prefill's up_proj in the same rounds" in note
    assert "ran 0.75-2.00, 1 of 3 at or under 1.0" in note
    del m["kernel_probes"]                                           # an older report: no rates
    assert "FLOP rates" not in llamacpp.explain(ratios, m, [0.1, 0.1])[
        "scale_prefill_vs_llamacpp_f32"]


def test_the_kernel_probes_time_torchs_linear_kernels_at_the_prefills_shape() -> None:
    from tinyserve.config import PRESETS
    cfg = PRESETS["draft"]
    probes = llamacpp.kernel_probes(cfg, 4)
    assert set(probes) <= set(llamacpp.KERNEL_PROBES) and "probe_mkl" in probes
    for run in probes.values():
        flops, seconds = run()
        assert flops == 2 * 4 * cfg.hidden_size * cfg.intermediate_size and seconds > 0


def test_without_the_peer_the_suite_says_make_peers_and_writes_nothing(
        tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TINYSERVE_PEERS_DIR", str(tmp_path / "peers"))
    out = tmp_path / "llamacpp.json"
    out.write_text(json.dumps({"suite": "llamacpp", "kept": True}))
    with pytest.raises(SystemExit) as stop:
        llamacpp.run(json_path=str(out))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "make peers" in err and "no venv at" in err and "Nothing was measured" in err
    assert json.loads(out.read_text()) == {"suite": "llamacpp", "kept": True}   # lost nothing


def test_a_venv_without_the_converter_is_named() -> None:
    message = llamacpp.missing_message("no converter at X")
    assert "no converter at X" in message and "15-35 minutes" in message


def test_llamacpp_runs_at_its_defaults_unless_this_host_has_amx() -> None:
    # Issue 52, I5: extra buffer types (AMX, repacked CPU layouts) stay at llama.cpp's default
    # where they work, go off only on an AMX CPU, and the report says which and why per host.
    plain = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
    amx = "flags\t\t: fpu avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
    assert llamacpp.extra_buffers_off_reason(plain) is None
    assert llamacpp.extra_buffers_off_reason("") is None
    reason = llamacpp.extra_buffers_off_reason(amx)
    assert reason.startswith("off: this CPU has AMX (amx_bf16, amx_int8, amx_tile)")
    assert "20824" in reason
    assert llamacpp.extra_buffers_text(None).startswith("on (llama.cpp's default")
    assert llamacpp.extra_buffers_text(reason) == reason


def test_the_converters_log_gives_each_tensors_type() -> None:
    # conversion/base.py logs one line per tensor, after its F16 fallback for a row that
    # q8_0's block of 32 does not divide (the trained target's down_proj: 688 inputs)
    log = ("INFO:hf-to-gguf:blk.0.ffn_down.weight,       torch.float32 --> F16, shape = {688, 256}\n"
           "WARNING:hf-to-gguf:Quantized tensor row size (688) is not a multiple of Q8_0 ..., "
           "falling back to F16\n"
           "INFO:hf-to-gguf:blk.0.ffn_up.weight,         torch.float32 --> Q8_0, shape = {256, 688}\n"
           "INFO:hf-to-gguf:output_norm.weight,          torch.float32 --> F32, shape = {256}\n")
    assert llamacpp.tensor_types(log) == {"blk.0.ffn_down.weight": "F16",
                                          "blk.0.ffn_up.weight": "Q8_0",
                                          "output_norm.weight": "F32"}
    assert llamacpp.tensor_types("") == {}


def test_without_the_peer_a_caller_that_goes_on_says_what_it_measured(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TINYSERVE_PEERS_DIR", str(tmp_path / "peers"))
    message = llamacpp.missing("Ours were measured.")
    assert "no venv at" in message and message.endswith("Ours were measured.")
    assert "Nothing was measured" not in message
