"""Speculative decoding vs plain greedy decode on the target, measured side by side.

For each drafter (the shipped 0.59M draft model; an n-gram drafter doing prompt lookup over
the context plus an index of past replies) and k in {2, 4, 6}: wall time to generate the
replies of a few support prompts at batch 1, the acceptance rate (accepted / proposed
drafts), target passes per generated token, and the speed-up over plain cached greedy decode
of the same prompts. Every speculative output is checked token for token against the plain
output before any figure is reported. Times are, per prompt, the fastest of 5 runs with plain
and speculative alternating (see ``paired_seconds``), summed over the prompts.

Then the cost model behind the figures: the time of one target pass over 1 token (decode)
and over k + 1 tokens (verify), and of one draft pass, at batch sizes 1 to 64. The k draft
passes of a step are priced as they run: k - 1 one-token steps and a catch-up pass that
feeds 2 tokens after a step that kept all k drafts (probability a^k), 1 otherwise. The predicted
speed-up is ``E[tokens per pass] / (k * draft + verify)`` in units of one decode pass, with
E = (1 - a^(k+1)) / (1 - a). At batch 1 a verify pass costs about one decode pass; as the
batch grows the pass stops being overhead-bound and verifying k extra tokens per row costs
real compute, so the predicted gain shrinks.

Ratios: ``spec_speedup_k{2,4,6}`` (draft model), ``ngram_speedup_k{2,4,6}``: plain time /
speculative time (> 1: speculation is faster); ``spec_acceptance_k4`` and
``ngram_acceptance_k4``: acceptance rates (not speed ratios);
``{spec,ngram}_measured_vs_predicted_k4``: the measured k=4 speed-up over the formula's
(1: the code delivers all the formula promises; printed with one pass as run next to the
formula's k draft passes + one verify pass). A table then splits one k=4 pass as run into
its parts (the prefills spread over the passes, the draft passes, the verify pass with the
acceptance test and rewinds), each next to what the formula prices it at, and repeats the
comparison with the prefills left out of both loops (reported, never a headline: the
speed-up stays end to end). ``--quick`` runs the same code
on tiny random models, to check the report's shape in seconds; its figures mean nothing.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from tinyserve.config import ModelConfig
from tinyserve.device import default_device
from tinyserve.generate import extend, generate, prefill
from tinyserve.kv_cache import KVCache
from tinyserve.model import TinyLlama
from tinyserve.sampling import SamplingParams
from tinyserve.speculative import (Drafter, ModelDrafter, NGramDrafter, expected_tokens_per_pass,
                                   predicted_speedup, speculative_generate)

from ..common import (in_turns, interleaved_seconds, median_seconds, report, sync, table,
                     write_json)

KS = (2, 4, 6)
COST_CONTEXT = 100  # cached tokens before each pass the cost model times
QUICK_TARGET = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)


def _random(cfg: ModelConfig, seed: int, device: torch.device) -> TinyLlama:
    torch.manual_seed(seed)
    model = TinyLlama(cfg).eval()
    with torch.no_grad():  # away from the near-uniform init, so greedy has no near-ties
        for p in model.parameters():
            p.mul_(3)
    return model.to(device)


def setup(quick: bool, device: torch.device) -> dict[str, Any]:
    """Models, prompts, stop ids and the n-gram drafter's corpus of past replies."""
    if quick:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (8, 12)]
        target = _random(QUICK_TARGET, 0, device)
        # Random models never agree; the target drafting for itself and a corpus holding
        # the outputs keep every code path busy (acceptance > 0) in the shape check.
        corpus = [p + generate(target, p, 24).tokens for p in prompts]
        return {"target": target, "draft": target, "prompts": prompts, "stop_ids": (),
                "corpus": corpus, "max_tokens": 24, "name": "random tiny (quick)"}
    from tinyserve.checkpoint import load_model
    from tinyserve.corpus import example_prompts, generate_tickets, render
    from tinyserve.tokenizer import load_tokenizer
    tok = load_tokenizer()
    # Past replies a support desk has sent: 200 tickets from the training stream (seed 0);
    # the example prompts come from another seed, so no prompt is in the corpus.
    corpus = [tok.encode(render(t)) for t in generate_tickets(200, seed=0)]
    return {"target": load_model("target", device=device, dtype=torch.float32),
            "draft": load_model("draft", device=device, dtype=torch.float32),
            "prompts": [tok.encode(p) for p in example_prompts(6)],
            "stop_ids": (tok.eos_id,), "corpus": corpus, "max_tokens": 128,
            "name": "target + draft (shipped)"}


def run_drafter(env: dict[str, Any], drafter: Drafter, k: int,
                plain: list[list[int]]) -> dict[str, float]:
    """Generate every prompt speculatively; check it equals plain decode; sum the stats."""
    proposed = accepted = rejected = passes = tokens = 0
    for prompt, want in zip(env["prompts"], plain):
        got, stats = speculative_generate(env["target"], drafter, prompt, env["max_tokens"],
                                          k=k, stop_ids=env["stop_ids"])
        if got != want:
            raise RuntimeError(f"speculative output differs from plain greedy (k={k}); "
                               f"verification is wrong")
        proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
        rejected += stats.rejected
        passes, tokens = passes + stats.target_passes, tokens + len(got)
    # The first token comes from prefill in both loops; passes count the decode phase only.
    # acceptance: accepted / proposed (what servers report); acceptance_prob: accepted /
    # checked drafts, the per-draft probability a of the tokens-per-pass formula.
    return {"acceptance": accepted / max(proposed, 1), "proposed": proposed,
            "acceptance_prob": accepted / max(accepted + rejected, 1),
            "target_passes": passes, "tokens": tokens,
            "passes_per_token": passes / max(tokens - len(plain), 1)}


def pass_costs(model: TinyLlama, batch: int, widths: list[int], context: int,
               repeats: int) -> dict[int, float]:
    """Milliseconds of one cached pass feeding ``width`` tokens per row after ``context``
    cached tokens, for each width (1 = a decode step, k + 1 = a verify pass). Timed on
    :func:`~tinyserve.generate.extend` with positions from the cache (width 1 is then
    :func:`~tinyserve.generate.decode_step`'s pass), the step both loops run, so the formula
    and the runs price the same code."""
    device = model.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context + max(widths)), generator=g)
    ids = ids.to(device)
    cache = KVCache.for_model(model, batch, context + max(widths))
    prefill(model, ids[:, :context], cache)

    def once(w: int) -> float:
        # positions=None, as both loops call it: positions from the cache's host lengths (an
        # explicit tensor would add its read-back and range check, which the runs never pay).
        seconds = median_seconds(lambda: extend(model, ids[:, context:context + w], None, cache),
                                 device, repeats=1, warmup=0)
        cache.rewind([context] * batch)  # forget the pass, so each run measures the same one
        return seconds

    # Widths take turns, and each keeps its fastest run: a pass lasts milliseconds, so on a
    # shared machine a run is either clean or pre-empted, and the minimum is the clean cost.
    runs = in_turns({str(w): functools.partial(once, w) for w in widths}, repeats)
    return {w: 1e3 * min(runs[str(w)]) for w in widths}


class TimedDrafter:
    """A drafter whose calls are timed (seconds summed per method, the device synchronised
    around each): what one speculative pass spends drafting, as run."""

    def __init__(self, inner: Drafter, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self.seconds = dict.fromkeys(("start", "propose", "commit"), 0.0)

    def _timed(self, name: str, *args: Any) -> Any:
        sync(self.device)
        start = time.perf_counter()
        out = getattr(self.inner, name)(*args)
        sync(self.device)
        self.seconds[name] += time.perf_counter() - start
        return out

    def start(self, prompt_ids: list[int], max_total: int) -> None:
        self._timed("start", prompt_ids, max_total)

    def propose(self, context: list[int], k: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        return self._timed("propose", context, k, sampling, generator)

    def commit(self, n_committed: int) -> None:
        self._timed("commit", n_committed)


def pass_parts(env: dict[str, Any], drafter: Drafter, k: int, rounds: int) -> dict[str, float]:
    """One speculative pass as run, in parts (seconds summed over the prompts): per prompt
    the fastest of ``rounds`` runs (plain decoding taking turns with it), its drafter's
    calls timed inside it, the target's prefill (the same call on a fresh cache) timed
    apart. The verify pass is what the run took besides: the target's pass over the last
    token and the drafts, the acceptance test and the rewinds."""
    target, device = env["target"], env["target"].device
    out = dict.fromkeys(("total", "target_prefill", "draft_prefill", "draft", "passes",
                         "plain_total", "plain_prefill", "plain_tokens"), 0.0)
    for p in env["prompts"]:
        def spec_once(p: list[int] = p) -> tuple[float, dict[str, float], int, float]:
            timed = TimedDrafter(drafter, device)
            sync(device)
            start = time.perf_counter()
            _, stats = speculative_generate(target, timed, p, env["max_tokens"], k=k,
                                            stop_ids=env["stop_ids"])
            sync(device)
            total = time.perf_counter() - start
            return total, timed.seconds, stats.target_passes, _prefill_seconds(target, p)

        def plain_once(p: list[int] = p) -> tuple[float, float, int]:
            sync(device)
            start = time.perf_counter()
            trace = generate(target, p, env["max_tokens"], stop_ids=env["stop_ids"])
            return (time.perf_counter() - start, trace.prefill_end - trace.prefill_start,
                    len(trace.tokens))
        runs = in_turns({"spec": spec_once, "plain": plain_once}, rounds)
        total, drafted, passes, _ = min(runs["spec"], key=lambda r: r[0])
        plain_total, plain_prefill, tokens = min(runs["plain"], key=lambda r: r[0])
        out["total"] += total
        out["target_prefill"] += min(r[3] for r in runs["spec"])
        out["draft_prefill"] += drafted["start"]
        out["draft"] += drafted["propose"]
        out["passes"] += passes
        out["plain_total"] += plain_total
        out["plain_prefill"] += plain_prefill
        out["plain_tokens"] += tokens
    return out


def _prefill_seconds(target: TinyLlama, prompt: list[int]) -> float:
    """The speculative decoder's target prefill, alone: a fresh cache, the prompt scored at
    its last position."""
    device = target.device
    sync(device)
    start = time.perf_counter()
    cache = KVCache.for_model(target, 1, len(prompt) + 1)
    ids = torch.tensor([prompt], device=device)
    prefill(target, ids, cache, logits_at=torch.tensor([len(prompt) - 1], device=device))
    sync(device)
    return time.perf_counter() - start


def paired_seconds(env: dict[str, Any], spec_one: Callable[[list[int]], None], repeats: int,
                   device: torch.device) -> tuple[float, float]:
    """Speculative and plain seconds for all prompts: per prompt, the two take turns for
    ``repeats`` rounds (:func:`~bench.common.interleaved_seconds`) and each keeps its fastest
    run; the sums are returned.

    Why the fastest: a generation is a fixed amount of work, and on a shared machine every
    slower run is another process holding the core. Timing the pair back to back, prompt by
    prompt, keeps a busy spell from landing on one side of the ratio only."""
    def plain_one(p: list[int]) -> None:
        generate(env["target"], p, env["max_tokens"], stop_ids=env["stop_ids"])
    spec_s = plain_s = 0.0
    for p in env["prompts"]:
        runs = interleaved_seconds({"spec": functools.partial(spec_one, p),
                                    "plain": functools.partial(plain_one, p)},
                                   device, repeats, warmup=0)
        spec_s, plain_s = spec_s + min(runs["spec"]), plain_s + min(runs["plain"])
    return spec_s, plain_s


def run(json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    device = default_device()
    env = setup(quick, device)
    target, draft = env["target"], env["draft"]
    repeats = 1 if quick else 5
    print(f"bench spec: {env['name']} on {device}, fp32, batch 1, greedy, "
          f"{len(env['prompts'])} prompts, up to {env['max_tokens']} tokens", flush=True)
    plain: list[list[int]] = []

    def plain_once() -> None:
        plain[:] = [generate(target, p, env["max_tokens"], stop_ids=env["stop_ids"]).tokens
                    for p in env["prompts"]]
    plain_s = median_seconds(plain_once, device, repeats)
    n_tokens = sum(map(len, plain))
    drafters = {"spec": ModelDrafter(draft), "ngram": NGramDrafter(corpus=env["corpus"])}
    rows, results = [], {}
    for name, drafter in drafters.items():
        for k in KS:
            stats = run_drafter(env, drafter, k, plain)  # also the warm-up

            def spec_one(p: list[int]) -> None:
                speculative_generate(target, drafter, p, env["max_tokens"], k=k,
                                     stop_ids=env["stop_ids"])
            seconds, plain_here = paired_seconds(env, spec_one, repeats, device)
            stats.update(seconds=seconds, plain_seconds=plain_here, speedup=plain_here / seconds)
            results[f"{name}_k{k}"] = stats
            rows.append([name, k, stats["acceptance"], stats["acceptance_prob"],
                         stats["passes_per_token"],
                         1 / stats["passes_per_token"], seconds, plain_here, stats["speedup"]])
            print(f"  {name} k={k}: {seconds:.3f} s", flush=True)
    print(f"\nplain greedy decode: {plain_s:.3f} s for {n_tokens} tokens "
          f"({1e3 * plain_s / n_tokens:.2f} ms/token); every output below is identical to it; "
          f"speed-up = plain s / seconds; per prompt, each side's fastest of {repeats} runs, "
          f"timed back to back")
    print(table(["drafter", "k", "acceptance", "a", "passes/token", "tokens/pass", "seconds",
                 "plain s", "speed-up"], rows), flush=True)

    sweep = cost_model(env, results, quick)
    parts = {name: pass_parts(env, drafter, 4, repeats) for name, drafter in drafters.items()}
    per_pass = formula_check(results, sweep[0], parts)
    ratios = {f"{name}_speedup_k{k}": results[f"{name}_k{k}"]["speedup"]
              for name in drafters for k in KS}
    ratios.update({f"{name}_acceptance_k4": results[f"{name}_k4"]["acceptance"]
                   for name in drafters})
    ratios.update({f"{name}_measured_vs_predicted_k4": per_pass[name]["measured_vs_predicted"]
                   for name in drafters})
    data = report(
        "spec", ratios=ratios,
        measurements={"plain_s": plain_s, "plain_tokens": n_tokens, "runs": results,
                      "pass_costs_by_batch": sweep, "k4_per_pass_vs_formula": per_pass},
        conditions={"model": env["name"], "device": str(device), "dtype": "float32",
                    "batch": 1, "sampling": "greedy", "prompts": len(env["prompts"]),
                    "max_tokens": env["max_tokens"], "repeats": repeats, "ks": list(KS),
                    "ngram": "max_n 4, min_n 2, context + 200 past tickets",
                    "cost_context_tokens": cost_context(target)},
        quick=quick)
    write_json(data, json_path)
    return data


def cost_context(target: TinyLlama) -> int:
    """Cached tokens before each pass the cost model times (fewer in a small window)."""
    return min(COST_CONTEXT, target.config.max_position_embeddings - 8)


def cost_model(env: dict[str, Any], results: dict[str, dict[str, float]],
               quick: bool) -> list[dict[str, Any]]:
    """Pass times by width and batch (each model alone, after ``COST_CONTEXT`` cached
    tokens), and the k=4 speed-up they predict with the measured acceptance of each run."""
    target, draft = env["target"], env["draft"]
    context = cost_context(target)
    widths = [1] + [k + 1 for k in KS]
    sweep = []
    for b in (1, 2) if quick else (1, 4, 16, 32, 64):
        t_cost = pass_costs(target, b, widths, context, 3 if quick else 21)
        d_cost = pass_costs(draft, b, [1, 2], context, 3 if quick else 21)
        entry: dict[str, Any] = {"batch": b, "decode_ms": t_cost[1], "draft_ms": d_cost[1],
                                 "draft_catchup2_ms": d_cost[2],
                                 "verify_ms": {k: t_cost[k + 1] for k in KS}}
        # The k draft passes as ModelDrafter runs them: k - 1 one-token steps and a catch-up
        # that feeds 2 tokens after a step that accepted all k drafts (probability a^k: the
        # last guess was never fed), 1 otherwise.
        a = results["spec_k4"]["acceptance_prob"]
        entry["spec_draft_pass_ms_k4"] = 4 * d_cost[1] + a ** 4 * (d_cost[2] - d_cost[1])
        for name in ("spec", "ngram"):
            a = results[f"{name}_k4"]["acceptance_prob"]
            c_draft = entry["spec_draft_pass_ms_k4"] / (4 * t_cost[1]) if name == "spec" else 0.0
            entry[f"{name}_predicted_speedup_k4"] = predicted_speedup(
                a, 4, c_draft, t_cost[5] / t_cost[1])
        sweep.append(entry)
    print(f"\ncost of one pass after {context} cached tokens (fastest of 21, ms), and the speed-up the "
          "formula predicts for k=4 with the measured per-draft acceptance probability a")
    print(table(["batch", "decode ms", "verify k=4 ms", "verify/decode", "draft ms",
                 "pred. spec k=4", "pred. ngram k=4"],
                [[e["batch"], e["decode_ms"], e["verify_ms"][4], e["verify_ms"][4] / e["decode_ms"],
                  e["draft_ms"], e["spec_predicted_speedup_k4"], e["ngram_predicted_speedup_k4"]]
                 for e in sweep]))
    return sweep


def formula_check(results: dict[str, dict[str, float]], batch1: dict[str, Any],
                  parts: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The k=4 runs against the formula at batch 1: the speed-up measured over the one
    predicted, and one speculative pass as run (seconds / target passes, prefills included,
    then without them) next to the formula's k draft passes + one verify pass, each model
    timed alone; ``parts`` (:func:`pass_parts`) says where a pass as run spends its time."""
    out = {}
    for name in ("spec", "ngram"):
        r, q = results[f"{name}_k4"], parts[name]
        predicted = batch1[f"{name}_predicted_speedup_k4"]
        draft_ms = batch1["spec_draft_pass_ms_k4"] if name == "spec" else 0.0
        formula_ms = batch1["verify_ms"][4] + draft_ms
        n, ms = q["passes"], lambda seconds: 1e3 * seconds / q["passes"]
        spec_decode = q["total"] - q["target_prefill"] - q["draft_prefill"]
        plain_decode = q["plain_total"] - q["plain_prefill"]
        o = out[name] = {
            "predicted_speedup": predicted, "measured_speedup": r["speedup"],
            "measured_vs_predicted": r["speedup"] / predicted,
            "pass_ms": 1e3 * r["seconds"] / r["target_passes"], "formula_pass_ms": formula_ms,
            "plain_token_ms": 1e3 * r["plain_seconds"] / r["tokens"],
            "decode_ms": batch1["decode_ms"],
            # the parts run (fastest of N per prompt, drafter timed inside the run)
            "parts_passes": n, "parts_pass_ms": ms(q["total"]),
            "parts_target_prefill_ms": ms(q["target_prefill"]),
            "parts_draft_prefill_ms": ms(q["draft_prefill"]),
            "parts_draft_ms": ms(q["draft"]), "formula_draft_ms": draft_ms,
            "parts_verify_and_rest_ms": ms(q["total"] - q["target_prefill"] - q["draft_prefill"]
                                           - q["draft"]),
            "formula_verify_ms": batch1["verify_ms"][4],
            "parts_pass_prefill_out_ms": ms(spec_decode),
            "plain_decode_token_ms_prefill_out": 1e3 * plain_decode / (q["plain_tokens"] - 1),
            "measured_speedup_prefill_out": plain_decode / spec_decode}
        o["measured_vs_predicted_prefill_out"] = o["measured_speedup_prefill_out"] / predicted
        print(f"\n{name} k=4 at batch 1: E[tokens/pass] = "
              f"{expected_tokens_per_pass(r['acceptance_prob'], 4):.2f} at a = "
              f"{r['acceptance_prob']:.2f} (measured {1 / r['passes_per_token']:.2f}); speed-up "
              f"predicted {predicted:.2f}, measured {r['speedup']:.2f} "
              f"({o['measured_vs_predicted']:.2f} of it); a pass {o['pass_ms']:.2f} ms as run, "
              f"{formula_ms:.2f} ms in the formula; plain {o['plain_token_ms']:.2f} ms per token "
              f"as run, decode {o['decode_ms']:.2f} ms in the formula")
        print(table(["part of one pass", "ms as run", "ms in formula"], [
            ["target prefill / passes", o["parts_target_prefill_ms"], 0.0],
            ["draft prefill / passes", o["parts_draft_prefill_ms"], 0.0],
            ["draft passes (catch-up + k-1 steps)", o["parts_draft_ms"], draft_ms],
            ["verify pass, acceptance, rewinds", o["parts_verify_and_rest_ms"], formula_ms - draft_ms],
            ["pass, prefills out", o["parts_pass_prefill_out_ms"], formula_ms],
            ["pass", o["parts_pass_ms"], formula_ms],
            ["plain decode per token, prefill out", o["plain_decode_token_ms_prefill_out"],
             batch1["decode_ms"]]]))
        print(f"prefills out: speed-up {o['measured_speedup_prefill_out']:.2f}, "
              f"{o['measured_vs_predicted_prefill_out']:.2f} of the prediction "
              f"(the headline ratios above stay end to end, prefills in)")
    return out
