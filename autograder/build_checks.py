"""How the build track's tests judge a piece (shared by every build_* assignment; no answers here).

``check_tensor`` compares a tensor with the reference and, when it differs, names the classic
mistake it matches. At grading (and Validate) a build assignment's kernel holds no reference
(``autograder.runner.publish``): these helpers run on the trusted side only. ``with_pieces`` runs a
learner's function with the earlier pieces bound to lent stand-ins of the reference pieces
below; ``called_with`` and ``changed_inputs`` call a piece twice on the very same arguments
(what it did to them shows in its second answer) and ``storage`` keeps an object's tensors for
a later read of their contents: every verdict rests on answers and on what the tests' side
observed, never on the kernel's account of the learner's code. ``check_own`` holds a piece to being
the learner's own PyTorch: where the kernel holds no reference, the submitted source is read
for review and only a name the exercise bans costs the piece; in a plain run of the notebook,
where tinyserve is importable, it looks twice:

* in the code: every name the function (and the helpers it calls, other graded pieces
  excepted) reads, and where each object comes from;
* at run time: the piece is called again with tinyserve unavailable (its modules hidden from
  ``import`` and every notebook name bound to it replaced); it must still work.
"""
from __future__ import annotations

import dis
import inspect
import sys
import types
from pathlib import Path

import torch
from torch import Tensor

from autograder.kernel.agent import code_globals
from autograder.kernel_helpers import trusted_runner as _trusted_runner
from autograder.testkit import check

_allclose, _isfinite, _Tensor = torch.allclose, torch.isfinite, Tensor
_REFERENCE = "tinyserve"
_GRADER_MODULES = (_REFERENCE, __name__.split(".")[0])  # the grader computes references too


def _reference_sources() -> set[str]:
    """Normalised lines of tinyserve's model code, to recognise a pasted copy."""
    import tinyserve.model as ref_model
    import tinyserve.kv_cache as ref_cache
    lines = set()
    for module in (ref_model, ref_cache):
        for line in Path(module.__file__).read_text().splitlines():
            line = line.split("#")[0].strip()
            if len(line) >= 24:
                lines.add(line)
    return lines


_REFERENCE_LINES = _reference_sources()


def _is_reference(obj: object) -> bool:
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        name = getattr(type(obj), "__module__", "") if not callable(obj) else ""
        name = getattr(obj, "__module__", None) or name
    return isinstance(name, str) and name.split(".")[0] in _GRADER_MODULES


def _names_in(code: types.CodeType) -> tuple[set[str], set[str], set[str]]:
    """(globals read, attributes read, modules imported) by ``code`` and the code nested in it."""
    globals_, attrs, imports, todo = set(), set(), set(), [code]
    while todo:
        c = todo.pop()
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                globals_.add(str(ins.argval))
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM", "LOAD_SUPER_ATTR"):
                attrs.add(str(ins.argval))
            elif ins.opname == "IMPORT_NAME":
                imports.add(str(ins.argval))
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return globals_, attrs, imports


def reference_uses(fn: object, pieces: tuple[str, ...], banned: tuple[str, ...] = ()) -> list[str]:
    """What ``fn`` and the notebook helpers it calls take from tinyserve (or the ``banned``
    names); the other graded ``pieces`` are judged on their own and not followed."""
    found: set[str] = set()
    seen: set[int] = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if _is_reference(f):
            found.add(f"{getattr(f, '__module__', _REFERENCE)}.{getattr(f, '__qualname__', '')}".rstrip("."))
            continue
        f = getattr(f, "func", f)  # a functools.partial
        if isinstance(f, type):
            todo.extend(v for v in vars(f).values() if callable(v))
            continue
        code = getattr(f, "__code__", None)
        if code is None:
            continue
        names, attrs, imports = _names_in(code)
        found.update(m for m in imports if m.split(".")[0] == _REFERENCE)
        found.update(n for n in names | attrs if n == _REFERENCE or n in banned)
        scope = getattr(f, "__globals__", {})
        closure = [c.cell_contents for c in (getattr(f, "__closure__", None) or ())]
        # Default arguments hold objects too: `def f(x, norm=_tinyserve_norm)` uses it.
        defaults = list(getattr(f, "__defaults__", None) or ()) + list(
            (getattr(f, "__kwdefaults__", None) or {}).values())
        for obj in [scope.get(n) for n in names] + closure + defaults:
            if obj is None or obj is f:
                continue
            if _is_reference(obj) or getattr(obj, "__name__", None) in banned:
                found.add(getattr(obj, "__name__", None) or type(obj).__name__)
            elif getattr(obj, "__module__", None) == "__main__" \
                    and getattr(obj, "__name__", None) not in pieces:
                todo.append(obj)
        found.update(_copied_lines(f))
    return sorted(found)


def _copied_lines(fn: object) -> list[str]:
    """A function whose code lines are mostly tinyserve's, verbatim, is a copy."""
    from autograder.submitted.own_source import copied_lines
    try:
        source = inspect.getsource(fn)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return []
    return copied_lines(source, frozenset(_REFERENCE_LINES))


class _Unavailable(types.ModuleType):
    def __getattr__(self, name: str):
        raise ImportError(f"{_REFERENCE} is unavailable during this check")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{_REFERENCE} is unavailable during this check")


def error_without_reference(fn: object, call) -> BaseException | None:
    """Run ``call()`` with tinyserve hidden from ``fn``'s notebook; the error it raised, or
    None. Everything is put back however the call ends."""
    scope = code_globals(fn)
    scope = scope if isinstance(scope, dict) else {}
    modules = {k: v for k, v in sys.modules.items() if k.split(".")[0] == _REFERENCE}
    names = {k: v for k, v in list(scope.items()) if _is_reference(v)}
    try:
        for k in modules:
            sys.modules[k] = None  # type: ignore[assignment]  # `import` raises ImportError
        for k in names:
            scope[k] = _Unavailable(k)
        call()
        return None
    except Exception as err:  # noqa: BLE001 - any failure is the verdict
        return err
    finally:
        sys.modules.update(modules)
        scope.update(names)


def own_work(fn: object, pieces: tuple[str, ...], banned: tuple[str, ...] = (),
             args: tuple | None = None) -> list[str]:
    """Why ``fn`` is not the learner's own work (empty: nothing found).

    At grading (a trusted runner is running the test), ``fn`` is a handle on the learner's
    function and the verdict is read from the source of the learner's cells, which the grader
    holds (``autograder.submitted.own_source``): nothing the learner's kernel computes or binds takes
    part. Elsewhere (the learner's own kernel, a plain run of the notebook) it reads the code
    of ``fn`` and, given ``args``, calls ``fn(*args)`` once more with tinyserve unavailable."""
    runner = _trusted_runner()
    if runner is not None:
        from autograder.submitted.own_source import banned_in_candidates, problems, review_notes
        name = runner.ns.name_of(fn)
        if name is None:
            return [] if not callable(fn) else ["is not a function of your cells"]
        found = problems(runner.student_sources, name, pieces, runner.ns, banned,
                         frozenset(_REFERENCE_LINES))
        if not getattr(runner, "publishes", False):
            return [f"{'; '.join(found)[:300]}"] if found else []
        found += review_notes(runner.student_sources, name)
        # The kernel holds no reference: a piece that calls tinyserve fails on its own, so
        # what the source shows is for review. Only a name the exercise bans (torch's own
        # attention in the attention piece) still costs the piece.
        docked = [p for p in found if _bans(p, banned)]
        docked += [p for p in banned_in_candidates(runner.student_sources, name, banned)
                   if p not in docked]
        for p in found:
            if p not in docked:
                runner.flag(f"{name}: {p}")
        return [f"{'; '.join(docked)[:300]}"] if docked else []
    uses = reference_uses(fn, pieces, banned)
    problems = [f"uses {', '.join(uses)[:300]}"] if uses else []
    if args is not None and not problems:
        err = error_without_reference(fn, lambda: fn(*args))  # type: ignore[operator]
        if err is not None:
            problems.append(f"stops working when tinyserve is unavailable "
                            f"({type(err).__name__}: {str(err)[:200]})")
    return problems


def _bans(problem: str, banned: tuple[str, ...]) -> bool:
    """A finding of own_source that names one of the exercise's banned names."""
    return any(f"uses {b}" in problem or f"imports {b}" in problem for b in banned)


def with_pieces(fn: object, pieces: dict, args: tuple | list, count: str | None = None,
                lent: dict | None = None) -> tuple[object, list[int]]:
    """``call_with_pieces`` wherever the test runs: at grading the learner's ``fn`` runs in
    their kernel with the names in ``pieces`` bound, for that call only, to stand-ins of the
    reference pieces, which run and count here (the kernel never holds them: each call of one
    comes back here, and a stand-in kept from this call answers nothing later); elsewhere
    (a plain run of the notebook) the call is local. ``count``: the batch sizes of the calls
    of that piece, recorded here."""
    runner = _trusted_runner()
    if runner is None:
        return call_with_pieces(fn, pieces, args, count, lent)
    counter = None
    bound = {name: _reference_piece(spec, runner.ns) for name, spec in dict(pieces).items()}
    if count is not None:
        if count not in bound:
            raise ValueError("at grading only a reference piece's calls are counted")
        counter = bound[count] = CallSizes(bound[count])
    for obj in bound.values():
        runner.channel.lend(obj, ("__call__",), ())
    bound.update({str(k): v for k, v in dict(lent or {}).items()})
    result = runner.channel.call_with(fn, list(args), bind=bound)
    return result, (counter.sizes if counter is not None else [])


def called_with(fn: object, *args) -> tuple[object, object]:
    """(the first answer, the second answer) of ``fn`` called twice on the very same argument
    objects, in one request at grading: a piece that changes the lists or tensors it is given
    answers the second call differently (the answers show it, compared here; the kernel is
    never asked what became of the arguments, which would be its own account)."""
    runner = _trusted_runner()
    if runner is None:
        return fn(*args), fn(*args)  # type: ignore[operator]
    got = runner.channel.call_with(fn, list(args), repeat=2)
    return got[0], got[1]


def same_answer(a: object, b: object) -> bool:
    """Two answers of the same call are the same: tensors equal in shape, dtype and values
    (NaN never the same), lists and tuples item by item, anything else by ==."""
    if type(a) is _Tensor or type(b) is _Tensor:
        return type(a) is type(b) is _Tensor and a.shape == b.shape and a.dtype == b.dtype \
            and bool(_isfinite(a.float()).all()) and bool(torch.equal(a, b.to(a.device)))
    if type(a) in (list, tuple) or type(b) in (list, tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_answer, a, b))
    return type(a) is type(b) and a == b


def changed_inputs(fn: object, *args) -> list[int]:
    """Which tensor arguments ``fn(*args)`` may have changed in place, read from its answers:
    called twice on the very same arguments (``called_with``), a piece that changes one
    answers differently, and every tensor argument is listed (which one is not observed);
    empty when both answers are the same. Inputs where an in-place change shows in the
    answer are the test's to choose (rms_norm: vectors small enough for eps to matter)."""
    first, second = called_with(fn, *args)
    if same_answer(first, second):
        return []
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]


class Held:
    """Tensors of a learner's object kept as they were when ``storage`` was called (a cache's
    ``k`` and ``v`` right after ``__init__``): ``contents()`` reads them again later. A cache
    written in place holds its writes in those very tensors; one that copies on every write
    leaves them as they were. At grading the kernel keeps them and answers their contents
    (data, judged like any answer: nothing about where they live is asked)."""

    def __init__(self, tensors: list | None = None, number: int | None = None) -> None:
        self._tensors, self._number = tensors, number

    def contents(self) -> list:
        if self._tensors is not None:
            return [t.clone() if isinstance(t, torch.Tensor) else None for t in self._tensors]
        runner = _trusted_runner()
        got = runner.channel.request("held", number=self._number) if runner is not None else None
        return [t if type(t) is _Tensor else None for t in got] if type(got) is list else []


def storage(obj: object, names: tuple[str, ...] = ("k", "v")) -> Held:
    """``obj``'s tensor attributes ``names`` as they are now, kept for a later read
    (``Held.contents``). At grading the learner's object stays in the kernel, which keeps them."""
    runner = _trusted_runner()
    if runner is None or not getattr(type(obj), "_autograder_remote", False):
        return Held(tensors=[getattr(obj, n, None) for n in names])
    number = runner.channel.request("hold", ref=object.__getattribute__(obj, "_ref"), names=list(names))
    return Held(number=number if type(number) is int else -1)


def check_own(problems: object, piece: str) -> None:
    """No points for a piece that calls or copies the reference: ``problems`` is what
    ``own_work`` found for it."""
    check(type(problems) is list and all(type(p) is str for p in problems), name=f"{piece} is your own code",
          message="the check of your code did not answer; run the notebook from the top")
    check(not problems, name=f"{piece} is your own code",
          message=f"{piece} {'; '.join(problems)[:400]}: no points for this piece. The tests compare "
                  f"your code with tinyserve, so an answer that calls or copies it shows nothing; "
                  f"write the piece with torch operations.")


def dtype_message(got: torch.dtype, want: torch.dtype) -> str:
    """What a result of the wrong floating dtype is told: which came back, which was expected
    and where such a dtype usually comes from."""
    return (f"returned {got}, expected {want} (the dtype of the tensors it is given): a {got} "
            f"table or constant made it so (.double(), torch.tensor(..., dtype={got}), a NumPy "
            f"array turned into a tensor); keep the computation in {want}")


def check_tensor(got: object, want: Tensor, *, name: str, mistakes: tuple = (),
                 atol: float = 1e-5, rtol: float = 1e-4, what: str = "the reference",
                 same_dtype: bool = False) -> None:
    """``got`` is a tensor of ``want``'s shape and device, close to it; if not, the message
    names the first mistake in ``mistakes`` ((tensor a known slip gives, why) pairs) it matches.
    ``same_dtype``: it must also have ``want``'s dtype (where the notebook states it), checked
    before the values, so a float64 result is named rather than compared."""
    shape = tuple(getattr(got, "shape", ()))
    squeezed = type(got) is _Tensor and tuple(n for n in shape if n != 1) == tuple(
        n for n in want.shape if n != 1)
    check(type(got) is _Tensor and shape == tuple(want.shape), name=name,
          message=f"expected a tensor of shape {tuple(want.shape)}, got {type(got).__name__} {shape}" + (
              ": a dimension of size 1 was dropped or added (a .squeeze() breaks a single token)"
              if squeezed else ""))
    if same_dtype:
        check(got.dtype == want.dtype, name=name, message=dtype_message(got.dtype, want.dtype))
    # Compared on the reference's device: a trusted runner receives tensors on the CPU.
    got32, want32 = got.detach().to(want.device).float(), want.float()
    ok = bool(_allclose(got32, want32, atol=atol, rtol=rtol))
    largest = float((got32 - want32).abs().max())
    message = f"differs from {what} (largest difference {largest:.3g})"
    if not ok:
        if not bool(_isfinite(got32).all()):
            message = f"contains NaN or inf where {what} is finite"
        elif got.dtype != want.dtype:
            message += f": the result is {got.dtype}, {what} is {want.dtype}; compute in {want.dtype}"
        elif largest <= 1e-2 * (1.0 + float(want32.abs().max())):
            message += (": small everywhere, so the method is right and the arithmetic differs; look for "
                        "a lower precision (float16, bfloat16) or a constant (eps) other than the one given")
        for wrong, why in mistakes:
            if tuple(wrong.shape) == shape and bool(
                    _allclose(got32, wrong.to(want.device).float(), atol=atol, rtol=rtol, equal_nan=True)):
                message = why
                break
    check(ok, name=name, message=message)


# ------------------------------------------------------------------ shared test inputs

def random_model(device: torch.device | str, seed: int, **sizes):
    """A small random Llama in tinyserve (the reference) with every weight perturbed, so
    norms' gains and every projection matter; returns (model, weights dict, cfg dict) with
    the weights named as the shipped ones (no lm_head: the embedding is tied)."""
    from tinyserve.config import ModelConfig
    from tinyserve.model import TinyLlama
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(sizes)
    torch.manual_seed(seed)
    model = TinyLlama(ModelConfig(**cfg)).eval()
    with torch.no_grad():  # on the CPU, so every device gets the same weights from a seed
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model = model.to(device)
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()
               if n != "lm_head.weight"}
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return model, weights, cfg


def attention_variants(q: Tensor, k: Tensor, v: Tensor, qp: Tensor, kp: Tensor):
    """Causal grouped-query attention computed by torch (the reference) and what the classic
    slips give, as (reference, ((wrong, why), ...)). Shapes as in build_model's attention."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    group = q.shape[0] // k.shape[0]
    ki, vi = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    kr, vr = k.repeat(group, 1, 1), v.repeat(group, 1, 1)
    mask = kp[None, :] <= qp[:, None]
    strict = kp[None, :] < qp[:, None]  # an empty row gives NaN, as a learner's softmax does
    scores = (q @ ki.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~strict, float("-inf"))
    return sdpa(q, ki, vi, attn_mask=mask), (
        (sdpa(q, kr, vr, attn_mask=mask),
         "KV heads expanded with repeat (query head h reads KV head h % n_kv_heads); the "
         "shipped weights group consecutive query heads: h reads h // group (repeat_interleave)"),
        (sdpa(q, ki, vi), "no causal mask: a query must not see keys after its own position"),
        (torch.softmax(scores, dim=-1) @ vi,
         "mask off by one: a query must see its own key too (k_position <= q_position)"),
        (sdpa(q, ki, vi, attn_mask=kp[None, :] <= qp[:, None] + 1),
         "mask off by one: a query sees one key in its future"),
        (sdpa(q, ki, vi, attn_mask=torch.arange(k.shape[1], device=kp.device)[None, :]
              <= torch.arange(q.shape[1], device=qp.device)[:, None]),
         "the mask compares indices, not positions: a query at position 40 over 41 cached keys "
         "sees every key at positions <= 40; compare k_positions with q_positions"),
        (sdpa(q, ki, vi, attn_mask=torch.arange(k.shape[1], device=kp.device)[None, :]
              <= torch.arange(q.shape[1], device=qp.device)[:, None] + (k.shape[1] - q.shape[1])),
         "the mask is built from indices offset to the last keys (as if the queries were always "
         "the newest tokens): queries can sit anywhere; compare k_positions with q_positions"),
        (torch.softmax((q @ ki.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf")),
                       dim=-2) @ vi,
         "softmax over the queries: each query's weights run over the KEYS, the last dimension"),
        (torch.softmax((q @ ki.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, 0.0), dim=-1) @ vi,
         "masked scores set to 0: a score of 0 still gets weight exp(0) in the softmax; set them to -inf"),
        (sdpa(q, ki, vi, attn_mask=mask, scale=1 / q.shape[-1]),
         "scaled by head_dim: divide the scores by sqrt(head_dim)"),
        (sdpa(q, ki, vi, attn_mask=mask, scale=1.0),
         "the scores are not scaled: divide by sqrt(head_dim)"))


class ReferenceCache:
    """tinyserve's contiguous KV cache behind build_kv_cache's interface, so a test of the
    forward pass or the loops is not at the mercy of the learner's own cache class: ``write``
    stores one layer's keys and values (n_kv_heads, T, head_dim) at ``positions`` (T,) and
    returns every key and value of slots 0 .. the last one written; ``length`` is the number
    of slots in use. It records the positions of every write (``positions_written``): lent to
    the learner's code (``testkit.lend``), that record is the tests' own count of the tokens
    each forward pass fed, so a loop that ignores the cache or re-feeds it shows.
    ``flip_before``: the values of positions before it are stored (and returned) negated, so a
    loop whose tokens follow what the cache holds shows it reads the cache (a private
    recompute does not follow)."""

    def __init__(self, cfg: dict, max_seq: int, device: torch.device | str, flip_before: int = 0) -> None:
        from tinyserve.config import ModelConfig
        from tinyserve.kv_cache import KVCache
        names = ModelConfig.__dataclass_fields__
        config = ModelConfig(**{k: v for k, v in cfg.items() if k in names})
        self._cache = KVCache(config, 1, max_seq, device=device)
        self._writes: list[tuple[int, list[int]]] = []
        self._flip = int(flip_before)

    @property
    def length(self) -> int:
        return self._cache.lengths[0]

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        device = self._cache.k.device  # at grading the learner's tensors arrive as sent
        k, v, positions = k.to(device), v.to(device), positions.to(device)
        if self._flip:
            v = torch.where((positions < self._flip)[None, :, None], -v, v)
        keys, values, _ = self._cache.update(layer, k[None], v[None], positions[None])
        self._writes.append((int(layer), [int(p) for p in positions.tolist()]))
        return keys[0], values[0]

    def positions_written(self, layer: int = 0) -> list[list[int]]:
        """The positions of each write to ``layer``, in order: one list per forward pass."""
        return [list(p) for n, p in self._writes if n == layer]

    def stored(self, part: str) -> Tensor:
        """Every slot of the keys ("k") or values ("v"), (layers, n_kv_heads, max_seq, head_dim):
        what a preallocated cache holds after the same writes."""
        return (self._cache.k if part == "k" else self._cache.v)[:, 0]

    def prefill_with(self, spec: tuple, prompt: list[int]) -> None:
        """Fill positions 0..T-1 with tinyserve's model named by ``spec`` (see model_from_spec)."""
        model = model_from_spec(spec, self._cache.k.device)
        ids = torch.tensor([prompt], device=self._cache.k.device)
        with torch.no_grad():
            model(ids, torch.arange(len(prompt), device=ids.device)[None], self._cache)

    def keys(self, layer: int) -> Tensor:
        """(n_kv_heads, length, head_dim) keys of ``layer`` (for the tests' comparisons)."""
        return self._cache.k[layer, 0, :, :self.length]


def model_from_spec(spec: tuple, device: torch.device | str):
    """A tinyserve model both sides of a trusted runner can build alike: ("target",),
    ("draft",) or ("random", seed, sizes) (``random_model``'s seeded weights)."""
    if spec[0] == "random":
        return random_model(device, spec[1], **dict(spec[2]))[0]
    from tinyserve.checkpoint import load_model
    return load_model(spec[0], device=device, dtype=torch.float32)


# ------------------------------------------------------------------ reference pieces

# build_model's pieces with the notebook's signatures, for ``call_with_pieces``: when a
# learner's earlier piece raises or gives NaN, a later piece is judged with these in its place
# (one slip costs one piece). Plain torch, each built only on the ones above it; a piece
# that calls them is not the learner's own work (``own_work``: this module is the grader's).

def piece_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def piece_rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    i = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    angles = positions.float()[:, None] * theta ** (-i / head_dim)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def piece_apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def piece_attention(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    group = q.shape[0] // k.shape[0]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
        attn_mask=k_positions[None, :] <= q_positions[:, None])


def piece_swiglu_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    linear = torch.nn.functional.linear
    return linear(torch.nn.functional.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def block_variants(x: Tensor, positions: Tensor, w: dict, cfg: dict) -> tuple:
    """What the classic slips of a decoder block give, as ((wrong, why), ...)."""
    return ((_block(x, positions, w, cfg, attn_residual=False),
             "the attention's residual is missing: h = x + o_proj(attention(...))"),
            (_block(x, positions, w, cfg, mlp_residual=False),
             "the MLP's residual is missing: out = h + mlp(post_attention_layernorm(h))"),
            (_block(x, positions, w, cfg, pre_norm=False),
             "the attention reads x unnormalised: input_layernorm(x) feeds q, k and v (pre-norm)"),
            *((_block(x, positions, w, dict(cfg, rms_norm_eps=e)),
               f"eps = {e:g} written into the block: the norms take cfg['rms_norm_eps'] "
               f"({cfg['rms_norm_eps']:g} here)") for e in (1e-5, 1e-6) if e != cfg["rms_norm_eps"]))


def piece_decoder_block(x: Tensor, positions: Tensor, w: dict, cfg: dict) -> Tensor:
    return _block(x, positions, w, cfg)


def _block(x: Tensor, positions: Tensor, w: dict, cfg: dict, attn_residual: bool = True,
           mlp_residual: bool = True, pre_norm: bool = True) -> Tensor:
    T, d = x.shape[0], cfg["head_dim"]
    n = piece_rms_norm(x, w["input_layernorm.weight"], cfg["rms_norm_eps"]) if pre_norm else x
    q, k, v = ((n @ w[f"self_attn.{p}_proj.weight"].T).view(T, -1, d).transpose(0, 1) for p in "qkv")
    cos, sin = piece_rope_tables(positions, d, cfg["rope_theta"])
    a = piece_attention(piece_apply_rotary(q, cos, sin), piece_apply_rotary(k, cos, sin), v,
                        positions, positions)
    h = x * attn_residual + a.transpose(0, 1).reshape(T, -1) @ w["self_attn.o_proj.weight"].T
    n = piece_rms_norm(h, w["post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    return h * mlp_residual + piece_swiglu_mlp(n, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"],
                                               w["mlp.down_proj.weight"])


def piece_forward(ids: Tensor, positions: Tensor, weights: dict, cfg: dict) -> Tensor:
    E = weights["model.embed_tokens.weight"]
    x = E[ids]
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        w = {n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)}
        x = piece_decoder_block(x, positions, w, cfg)
    return piece_rms_norm(x, weights["model.norm.weight"], cfg["rms_norm_eps"]) @ E.T


def piece_forward_cached(ids: Tensor, positions: Tensor, weights: dict, cfg: dict, cache) -> Tensor:
    """build_kv_cache's forward_cached: ``piece_forward`` with each layer's keys and values
    written to ``cache`` (its ``write`` interface) and attention over what the write returns."""
    E = weights["model.embed_tokens.weight"]
    x, d = E[ids], cfg["head_dim"]
    cos, sin = piece_rope_tables(positions, d, cfg["rope_theta"])
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        w = {n[len(prefix):]: t for n, t in weights.items() if n.startswith(prefix)}
        n = piece_rms_norm(x, w["input_layernorm.weight"], cfg["rms_norm_eps"])
        q, k, v = ((n @ w[f"self_attn.{p}_proj.weight"].T).view(len(ids), -1, d).transpose(0, 1)
                   for p in "qkv")
        keys, values = cache.write(i, piece_apply_rotary(k, cos, sin), v, positions)
        a = piece_attention(piece_apply_rotary(q, cos, sin), keys, values, positions,
                            torch.arange(keys.shape[1], device=keys.device))
        h = x + a.transpose(0, 1).reshape(len(ids), -1) @ w["self_attn.o_proj.weight"].T
        n = piece_rms_norm(h, w["post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        x = h + piece_swiglu_mlp(n, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"],
                                 w["mlp.down_proj.weight"])
    return piece_rms_norm(x, weights["model.norm.weight"], cfg["rms_norm_eps"]) @ E.T


def piece_prefill(prompt_ids: list[int], weights: dict, cfg: dict, cache) -> Tensor:
    device = weights["model.embed_tokens.weight"].device
    return piece_forward_cached(torch.tensor(prompt_ids, device=device),
                                torch.arange(len(prompt_ids), device=device), weights, cfg, cache)


def piece_decode_step(token: int, weights: dict, cfg: dict, cache) -> Tensor:
    device = weights["model.embed_tokens.weight"].device
    return piece_forward_cached(torch.tensor([token], device=device),
                                torch.tensor([cache.length], device=device), weights, cfg, cache)[-1]


def _reference_piece(spec: object, scope: dict):
    """The reference function ``spec`` names: "tinyserve.module.name" (or one of this
    module's ``piece_...`` functions), or [that, {parameter: notebook name}] for a reference
    that takes a notebook function (the given forward pass)."""
    import functools
    import importlib
    path, binds = (spec, {}) if type(spec) is str else tuple(spec)  # type: ignore[misc]
    module, _, attr = str(path).rpartition(".")
    if module == __name__ and attr.startswith("piece_"):
        return globals()[attr]
    if module.split(".")[0] != _REFERENCE or attr.startswith("_"):
        raise ValueError(f"{path!r}: a reference piece is a public function of {_REFERENCE}")
    fn = getattr(importlib.import_module(module), attr)
    return functools.partial(fn, **{p: scope[n] for p, n in dict(binds).items()}) if binds else fn


class CallSizes:
    """``fn``, recording the batch size (``len`` of the first argument) of each call in
    ``sizes``. Lent to the learner's code (``testkit.lend(counter, ("__call__",))``), it runs
    and counts on the tests' side."""

    def __init__(self, fn) -> None:
        self.fn, self.sizes = fn, []

    def __call__(self, *args, **kwargs):
        self.sizes.append(len(args[0]) if args else -1)
        return self.fn(*args, **kwargs)


def call_with_pieces(fn: object, pieces: dict, args: tuple | list,
                     count: str | None = None, lent: dict | None = None
                     ) -> tuple[object, list[int]]:
    """``fn(*args)`` with the notebook names in ``pieces`` bound, for this call only, to
    tinyserve's reference functions, so a later part is judged on its own and not on the
    learner's earlier parts; and the names in ``lent`` to the objects given (at grading, the
    stand-ins of what the tests lend: a ``CallSizes`` the tests read afterwards counts on
    their side). ``count`` names a notebook function whose calls are recorded here (the batch
    size, ``len`` of its first argument, of each): returns (the result, those sizes); at
    grading those are the kernel's word, so a test that must not be forged lends instead.
    Runs in the learner's kernel; a trusted runner sends only names, so no test code crosses."""
    scope = code_globals(fn)
    if not isinstance(scope, dict):
        raise TypeError("expected a function (or a callable object) defined in the notebook")
    batches: list[int] = []
    bound = {name: _reference_piece(spec, scope) for name, spec in dict(pieces).items()}
    bound.update({str(name): obj for name, obj in dict(lent or {}).items()})
    if count is not None:
        counted = scope[count]

        def recorded(*a, **k):
            batches.append(len(a[0]) if a else -1)
            return counted(*a, **k)
        bound[count] = recorded
    saved = {name: scope[name] for name in bound if name in scope}
    try:
        scope.update(bound)
        return fn(*args), batches  # type: ignore[operator]
    finally:
        for name in bound:
            scope.pop(name, None)
        scope.update(saved)
