"""The data format of the grading channel: plain values in, plain values out, never pickle.

Both ends use this module: the trusted test runner (``autograder.runner.channel``) and the agent in
the student's kernel (``autograder.kernel.agent``). A value crosses as JSON built from these nodes,
and nothing else decodes:

=====================================  ==============================================
JSON                                   value
=====================================  ==============================================
null, true/false, number, string        None, bool, int, float, str (exact types only)
array                                   list
``{"$t": [...]}``                       tuple
``{"$d": [[key, value], ...]}``         dict (any keys that are themselves data)
``{"$set": [...]}``, ``{"$deque": ...}``  set, collections.deque
``{"$b": base64}``                      bytes
``{"$tensor": [dtype, shape, base64]}``  torch.Tensor (raw little-endian bytes; a 4th
                                        item names its device when not the CPU)
``{"$nd": [dtype, shape, base64]}``     numpy.ndarray (no object arrays)
``{"$device": "cpu"}``, ``{"$dtype": .}``  torch.device, torch.dtype
``{"$slice": [a, b, c]}``, ``$range``    slice, range
``{"$h": [id, type name, methods]}``    a handle on an object that stays in the kernel
``{"$o": [class path, fields, tag]}``   an object of a class on ``DATA_CLASSES`` (the
                                        course's own data), rebuilt from its fields
``{"$tag": n}``                         that same object, handed back
``{"$cset": [n, tensor]}``              a large constant tensor of the tests (a read-only
                                        cell's binding, such as the shipped weights),
                                        kept by the kernel under number n
``{"$c": n}``                           that constant again, without its bytes
``{"$lent": [n, type, methods, attrs]}``  an object the tests keep and lend to the learner's
                                        code: in the kernel a stand-in whose methods call
                                        back to the tests' side (``testkit.lend``)
=====================================  ==============================================

The decoder builds only the types in the table: an ``int`` subclass with an ``__eq__``
that is always true, a ``float`` that reads the caller's frame, an object whose class claims
to be numpy's, none of them survives the trip; each arrives as a handle (an opaque reference
the tests can only compare by identity) or as the plain value it converts to.
"""
from __future__ import annotations

import base64
import collections
import importlib
import json
import sys

MAX_DEPTH = 64
MAX_MESSAGE_BYTES = 256 * 2**20
# The most elements (lists, dicts, sets and the items in them) one message may hold. Parsing
# costs ~60 bytes of memory per element and decoding as much again, so the 256 MB cap alone
# let a reply of nested empty lists ("[[],[],...": three characters an element) grow the
# worker ~50x its size. The largest reply grading the solutions sees holds ~6,000 (the
# serving tests' traces; tensors and arrays cross as one base64 string each, not elements):
# a million is 150 times that, and costs at most ~120 MB to build.
MAX_ELEMENTS = 1_000_000
# The most dict keys and set items one message may hold (the largest seen: ~1,500), and the
# most distinct ones that may share one hash: inserting n keys of one hash costs n**2/2
# comparisons (250,000 multiples of 2**61-1, which all hash to 0, took minutes). Real data
# has few: -1 and -2 share a hash by CPython's rule, and so does a number and its float.
MAX_HASHED_KEYS = 100_000
MAX_SAME_HASH = 16
# The classes whose objects may cross as their fields (``$o``), by the module that defines
# them: the course's own data, found by grading every assignment's solution and recording
# what the tests lend and receive (workload specs, traces, SLOs, cost models, engine and
# model configs, the build track's caches), plus the small frozen dataclasses the notebooks
# build their inputs from (length distributions, sampling parameters). Anything else a
# course module defines or merely imports (``Path``, ``tqdm``, a model, the engine) stays a
# handle: a reply naming it is refused, so the grader never builds one from the kernel's word.
DATA_CLASSES = frozenset({
    "tinyserve.config:ModelConfig",
    "tinyserve.engine:EngineConfig",
    "tinyserve.metrics:RequestTrace",
    "tinyserve.metrics:SLO",
    "tinyserve.sampling:SamplingParams",
    "tinyserve.simulator:CostModel",
    "tinyserve.workload:RequestSpec",
    "tinyserve.workload:Fixed",
    "tinyserve.workload:Uniform",
    "tinyserve.workload:LogNormal",
    "tinyserve.workload:Mixture",
    "tinyserve.kv_cache:KVCache",
})
# Of those, the ones that are not dataclasses: plain classes whose whole state is their
# instance fields (tensors, ints, a config), rebuilt without running their constructor.
PLAIN_DATA_CLASSES = frozenset({"tinyserve.kv_cache:KVCache"})


class WireError(ValueError):
    """A value that cannot cross the channel; the message says which and why."""


def _tensor_bytes(t) -> tuple[str, list[int], str]:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(__import__("torch").uint8).numpy().tobytes() if flat.numel() else b""
    return str(t.dtype).removeprefix("torch."), list(t.shape), base64.b64encode(raw).decode()


def tensor_node(t) -> list:
    """A tensor's [dtype, shape, bytes], and its device when it is not on the CPU: the tests
    build their inputs on the learner's DEVICE and the learner's code must get them there
    (a cache made on cuda written with keys that arrived on the CPU mixes devices).
    runner.channel sends a tensor the kernel's cache holds with it too."""
    node = list(_tensor_bytes(t))
    return node + [str(t.device)] if t.device.type != "cpu" else node


# Devices a tensor is put back on when this process can use them; otherwise it stays on the CPU.
PLACED_DEVICES = ("cuda", "mps")


def _placed(t, device: object):
    import torch
    try:
        where = torch.device(str(device)[:40])
    except (RuntimeError, ValueError):
        return t
    if where.type not in PLACED_DEVICES:
        return t
    try:
        return t.to(where)
    except (RuntimeError, AssertionError, ValueError):  # not usable here (no such GPU)
        return t


def _tensor_from(dtype: str, shape: list, data: str, device: object = None):
    t = _tensor_contents(dtype, shape, data)
    return t if device is None else _placed(t, device)


def _tensor_contents(dtype: str, shape: list, data: str):
    import torch
    kind = getattr(torch, str(dtype), None)
    if not isinstance(kind, torch.dtype):
        raise WireError(f"unknown tensor dtype {str(dtype)[:40]!r}")
    raw = bytearray(base64.b64decode(data))
    numel = 1
    for n in shape:
        if type(n) is not int or n < 0:
            raise WireError("a tensor shape holds non-negative ints only")
        numel *= n
    if len(raw) != numel * torch.empty((), dtype=kind).element_size():
        raise WireError("tensor bytes do not match its shape and dtype")
    if not raw:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(raw, dtype=torch.uint8).view(kind).reshape(shape).clone()


def _array_from(dtype: str, shape: list, data: str):
    import numpy as np
    kind = np.dtype(str(dtype))
    if kind.hasobject:
        raise WireError("object arrays cannot cross the channel")
    return np.frombuffer(base64.b64decode(data), dtype=kind).reshape(shape).copy()


class Encoder:
    """Turn a value into JSON nodes.

    ``on_other(obj)`` decides what happens to anything that is not data: the kernel's agent
    turns it into a handle, the trusted side into an ``$o`` node or an error.
    """

    def __init__(self, on_other, on_tensor=None, limit: int | None = None):
        self.on_other = on_other
        # on_tensor(t) -> a node or None: the trusted side's constants (sent once, then by
        # number). limit: the most tensor/bytes/str payload one encode() may hold, checked
        # before any copying, so an oversized value costs nothing (the kernel's snapshots).
        self.on_tensor, self.limit, self._room = on_tensor, limit, 0

    def _spend(self, n: int) -> None:
        if self.limit is not None:
            self._room -= n
            if self._room < 0:
                raise WireError(f"a value over {self.limit} bytes")

    def encode(self, obj, depth: int = 0):
        if depth == 0:
            self._room = self.limit or 0
        if depth > MAX_DEPTH:
            raise WireError(f"a value nested deeper than {MAX_DEPTH} levels")
        t = type(obj)
        self._spend(8)
        if obj is None or t is bool or t is str:
            if t is str:
                self._spend(len(obj))
            return obj
        if t is int or t is float:
            return obj
        if t is list:
            return [self.encode(x, depth + 1) for x in obj]
        if t is tuple:
            return {"$t": [self.encode(x, depth + 1) for x in obj]}
        if t is dict:
            return {"$d": [[self.encode(k, depth + 1), self.encode(v, depth + 1)]
                           for k, v in obj.items()]}
        if t is set or t is frozenset:
            return {"$set": [self.encode(x, depth + 1) for x in obj]}
        if t is collections.deque:
            return {"$deque": [self.encode(x, depth + 1) for x in obj]}
        if t is bytes:
            self._spend(len(obj))
            return {"$b": base64.b64encode(obj).decode()}
        if t is slice or t is range:
            return {"$slice" if t is slice else "$range":
                    [self.encode(x, depth + 1) for x in (obj.start, obj.stop, obj.step)]}
        torch = sys.modules.get("torch")
        if torch is not None and t in (torch.Tensor, torch.nn.Parameter):
            self._spend(obj.numel() * obj.element_size())
            node = self.on_tensor(obj) if self.on_tensor is not None else None
            return node if node is not None else {"$tensor": tensor_node(obj)}
        if torch is not None and t is torch.device:
            return {"$device": str(obj)}
        if torch is not None and t is torch.dtype:
            return {"$dtype": str(obj).removeprefix("torch.")}
        np = sys.modules.get("numpy")
        if np is not None:
            if t is np.ndarray and not obj.dtype.hasobject:
                self._spend(obj.nbytes)
                return {"$nd": [obj.dtype.str, list(obj.shape),
                                base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode()]}
            if t in (np.float64, np.float32, np.float16, np.int64, np.int32, np.int16,
                     np.int8, np.uint8, np.bool_):
                return obj.item()  # numpy's own scalar types, converted by numpy
        return self.on_other(obj, depth)

    def dumps(self, obj) -> str:
        return json.dumps(self.encode(obj), separators=(",", ":"))


def _too_many_elements() -> WireError:
    return WireError(f"a message with more than {MAX_ELEMENTS:,} elements (lists, dicts, "
                     "sets and their items): return a tensor or an array for bulk data (it "
                     "crosses as bytes), or a smaller value")


def count_elements(text: str) -> int:
    """An upper bound on the containers and items ``text`` parses into, counted without
    parsing: every one starts with '[' or '{' or follows a ','. Commas inside strings count
    too (base64 payloads have none), which only errs on the safe side."""
    return text.count("[") + text.count("{") + text.count(",")


def parse(text: str):
    """``json.loads(text)`` within the message budgets: the size, then the elements, counted
    before anything is built (see MAX_ELEMENTS)."""
    if len(text) > MAX_MESSAGE_BYTES:
        raise WireError(f"a message over {MAX_MESSAGE_BYTES // 2**20} MB")
    if count_elements(text) > MAX_ELEMENTS:
        raise _too_many_elements()
    return json.loads(text)


def _check_hashes(keys: list) -> None:
    """Refuse many keys with one hash before a dict or set is built from them. The keys of
    an encoded dict or set are distinct (equal keys are one key), so counting hashes counts
    distinct keys, and telling them apart (a set of them) would be the quadratic work itself."""
    if len(keys) <= MAX_SAME_HASH:
        return
    for _, n in collections.Counter(map(hash, keys)).most_common(1):
        if n > MAX_SAME_HASH:
            raise WireError(f"a message whose dict keys or set items include more than "
                            f"{MAX_SAME_HASH} values that share one hash (building it would "
                            "take quadratic time): use other keys, or a list")


class Decoder:
    """Turn JSON nodes back into values; ``on_handle`` and ``on_object`` build references.

    One message (``loads``, or a top-level ``decode``) is held to MAX_ELEMENTS elements and
    MAX_HASHED_KEYS dict keys and set items, whichever end decodes it."""

    def __init__(self, on_handle, on_object=None, on_tag=None, on_constant=None, on_lent=None):
        self.on_handle, self.on_object, self.on_tag = on_handle, on_object, on_tag
        self.on_constant = on_constant  # (n, tensor or None) -> the kernel's kept constant
        self.on_lent = on_lent  # [n, type, methods, attributes] -> the kernel's stand-in
        self._elements = self._keys = 0

    def loads(self, text: str):
        try:
            return self.decode(parse(text))
        except (RecursionError, ValueError, TypeError, KeyError, IndexError) as e:
            if isinstance(e, WireError):
                raise
            raise WireError(f"malformed message ({type(e).__name__})") from None

    def _keyed(self, body: list) -> None:
        """Count a dict's or set's keys against the budget before decoding any of them."""
        self._keys += len(body)
        if self._keys > MAX_HASHED_KEYS:
            raise WireError(f"a message with more than {MAX_HASHED_KEYS:,} dict keys and set "
                            "items: return a list, a tensor or an array instead")

    def decode(self, node, depth: int = 0):
        if depth == 0:
            self._elements = self._keys = 0
        if depth > MAX_DEPTH:
            raise WireError(f"a value nested deeper than {MAX_DEPTH} levels")
        t = type(node)
        if node is None or t in (bool, int, float, str):
            return node
        if t is list:
            self._elements += len(node) + 1   # inline: decoding's hottest path
            if self._elements > MAX_ELEMENTS:
                raise _too_many_elements()
            return [self.decode(x, depth + 1) for x in node]
        if t is not dict or len(node) != 1:
            raise WireError("malformed message (unknown node)")
        (tag, body), = node.items()
        d = depth + 1
        self._elements += len(body) + 1 if type(body) is list else 1
        if self._elements > MAX_ELEMENTS:
            raise _too_many_elements()
        if tag == "$t":
            return tuple(self.decode(x, d) for x in body)
        if tag == "$d":
            self._keyed(body)
            pairs = [(self.decode(k, d), self.decode(v, d)) for k, v in body]
            if len(pairs) > MAX_SAME_HASH:   # fewer keys cannot share one hash too often
                _check_hashes([k for k, _ in pairs])
            return dict(pairs)
        if tag == "$set":
            self._keyed(body)
            items = [self.decode(x, d) for x in body]
            _check_hashes(items)
            return set(items)
        if tag == "$deque":
            return collections.deque(self.decode(x, d) for x in body)
        if tag == "$b":
            return base64.b64decode(body)
        if tag in ("$slice", "$range"):
            parts = [self.decode(x, d) for x in body][:3]
            if not all(p is None or type(p) is int for p in parts):
                raise WireError("slice and range bounds are ints")
            return slice(*parts) if tag == "$slice" else range(*parts)
        if tag == "$tensor":
            return _tensor_from(*body[:4])
        if tag == "$nd":
            return _array_from(*body)
        if tag == "$device":
            import torch
            return torch.device(str(body))
        if tag == "$dtype":
            import torch
            kind = getattr(torch, str(body), None)
            if not isinstance(kind, torch.dtype):
                raise WireError(f"unknown dtype {str(body)[:40]!r}")
            return kind
        if tag == "$h":
            methods = body[2] if len(body) > 2 and type(body[2]) is list else []
            return self.on_handle(int(body[0]), str(body[1])[:80],
                                  frozenset(m for m in methods[:1000] if type(m) is str))
        if tag == "$o" and self.on_object is not None:
            return self.on_object(str(body[0]), self.decode(body[1], d), body[2])
        if tag == "$tag" and self.on_tag is not None:
            return self.on_tag(body)
        if tag == "$cset" and self.on_constant is not None:
            value = self.decode(body[1], d)
            if type(value) is not __import__("torch").Tensor:
                raise WireError("a constant is a tensor")
            return self.on_constant(int(body[0]), value)
        if tag == "$c" and self.on_constant is not None:
            return self.on_constant(int(body), None)
        if tag == "$lent" and self.on_lent is not None:
            return self.on_lent(body)
        raise WireError(f"malformed message (node {str(tag)[:20]!r})")


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def allowed_class(path: str) -> type:
    """The class at ``module:qualname``, if it is on ``DATA_CLASSES`` (where it is defined:
    an import of it under another module's name is refused too)."""
    if path not in DATA_CLASSES:
        raise WireError(f"objects of {str(path)[:80]!r} cannot cross the channel (only the "
                        "course's own data classes, autograder.protocol.wire.DATA_CLASSES)")
    module, _, qualname = path.partition(":")
    cls = getattr(importlib.import_module(module), qualname, None)
    if not isinstance(cls, type) or class_path(cls) != path:
        raise WireError(f"{path[:80]!r} is not a class")
    return cls


def rebuild(cls: type, fields: dict):
    """An instance of ``cls`` holding ``fields``. A dataclass is built through its own
    constructor (so its checks run on the values that came across); another class gets its
    fields set without running any of its code."""
    import dataclasses
    if type(fields) is not dict or not all(type(k) is str for k in fields):
        raise WireError("object fields must be a dict with str keys")
    if dataclasses.is_dataclass(cls):
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        obj = cls(**{k: v for k, v in fields.items() if k in init})
        rest = {k: v for k, v in fields.items() if k not in init}
    else:
        obj, rest = object.__new__(cls), fields
    for k, v in rest.items():
        object.__setattr__(obj, k, v)
    return obj


def object_fields(obj) -> dict | None:
    """The instance fields of an allowed trusted object, or None when it may not cross."""
    cls = type(obj)
    if class_path(cls) not in DATA_CLASSES:
        return None
    fields = getattr(obj, "__dict__", None)
    if fields is None and hasattr(cls, "__slots__"):
        fields = {k: getattr(obj, k) for k in cls.__slots__ if hasattr(obj, k)}
    return dict(fields) if fields is not None else None
