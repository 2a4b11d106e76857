"""Trusted tests, untrusted kernel: the runner's end of the grading channel.

Why
    Test cells used to run in the student's kernel, where everything a test relies on (the
    helpers' module, ``sys.modules``, torch's functions, the shell's execute path, stack
    frames) is within the student's reach. Now the student's notebook runs in the sandboxed
    kernel only to *define answers*; test cells, hidden tests and their references run here,
    in the grader's own process, outside the sandbox, in a namespace of their own.

The channel
    The only link to the kernel is jupyter's own connection (the sockets nbclient already
    uses). When a trusted cell first needs the kernel, the runner sends one silent execute
    request, ``autograder.kernel.agent.serve_loop()``, with stdin allowed. The loop asks for input;
    each request goes to the kernel as jupyter's *input reply*, and the kernel's answer
    comes back as the prompt of its next *input request*. ``done`` ends the loop when the
    cell is over. Requests and replies are JSON built by
    ``autograder.protocol.wire`` (plain data; tensors and arrays as dtype + shape + raw bytes; objects
    that stay in the kernel as opaque handles). Never pickle, never code from the kernel.

    ====================  ===========================================================
    request               meaning
    ====================  ===========================================================
    name NAME             the value the student's namespace binds to NAME
    call REF ARGS KWARGS  call a student function / method / class
    callattr REF NAME ..  call a method of a student object; the reply carries the
                          object's attributes after the call (a snapshot, see Remote)
    map REF CALLS         call a student function once per [ARGS, KWARGS] in CALLS, in
                          one request (a distribution test's trials: ``call_each``)
    getattr REF NAME      an attribute of a student object (setattr, getitem,
                          setitem, len, list, contains: the same for the others)
    ====================  ===========================================================

    reply: ``{"ok": VALUE}``, ``{"missing": true}``, ``{"error": [module, type, message]}``
    or ``{"stale": true}`` (see constants).

Constants
    Large tensors bound by read-only cells (the shipped weights: 21 MB) would cross by value
    on every call that passes them. The runner numbers each one; the first request that
    passes it carries its bytes (``$cset``), later ones only its number (``$c``). The kernel
    keeps the tensor as sent and hands each request a copy of its own, so a change the
    student's code makes in place (through ``.data`` too) ends with that request: every call
    gets the tests' value. When the kernel no longer holds a number (the student's code
    dropped the agent's table), it answers ``stale`` and the runner sends the request again
    with the bytes.

How names resolve
    The test namespace holds what the read-only cells bind (they run here *and* in the
    kernel, so the student's code sees them too, and here whatever they did there) and what
    test cells bind. A name the tests use that is not there is looked up in the kernel, unless
    one of the assignment's own cells binds it (``TestNamespace.template_names``: then the
    cell that binds it failed, and the test fails saying so): data comes back as a value,
    anything else as a ``Remote`` (calling it, reading an attribute, indexing it: one request
    each). Names the trusted cells bind are never replaced by the student's, and values
    fetched from the kernel are dropped after every student cell, so a test always sees the
    latest answer.

Requests, replies and calls back
    Every request carries an id, echoed by its reply: a prompt without it (the student's own
    ``input()``) is answered with an empty line, a reply with another id (stale) gets the
    request again, so the channel never falls one reply behind. An object the tests lend the
    student's code (``testkit.lend``) crosses as a stand-in; calling one of its lent methods
    in the kernel sends a ``{"cb": ...}`` prompt, which the runner serves from the real
    object (data arguments only) before it reads on for the request's reply.

Why a submission cannot forge a verdict
    A verdict is the outcome of a test cell run *here*: passed when the cell finishes
    without an exception. Student code never runs in this process; it can only send back
    data, which the tests compare with their own references using their own functions. So:
    patched builtins, swapped modules, trace hooks, a rewritten ``run_cell``, frame walking
    and output printed to look like a pass change nothing here; a value with a lying
    ``__eq__`` or a fake numpy type cannot be decoded (it arrives as a handle, which
    compares by identity only); and the agent in the kernel is not trusted at all: answering
    a request with made-up data is the same as writing a wrong (or right) answer, which the
    hidden tests, whose inputs the kernel sees only when called, then judge. Exceptions from
    student code come back as a type name and a message (capped), marked as the student's;
    they fail the test like any exception. A kernel that hangs is interrupted, then stopped.
"""
from __future__ import annotations

import builtins
import sys
import time

from autograder.protocol.wire import MAX_MESSAGE_BYTES, Decoder, Encoder, WireError, allowed_class, class_path, \
    object_fields, parse, rebuild

MESSAGE_CAP = 500



class StudentError(Exception):
    """An exception raised by the student's code, of a type the tests do not know."""


class StudentTimeout(BaseException):
    """A call into the student's code ran out of time (not catchable by ``except Exception``)."""


class KernelLost(BaseException):
    """The kernel died or ignored an interrupt during a call; no later call can succeed."""


class GraderOverran(BaseException):
    """The tests' own work, serving a call back of the learner's code, ran out of the cell's
    time: the grader's limit, reported as the grader's, never the learner's."""


def cap_text(text: str, n: int = MESSAGE_CAP) -> str:
    """``text`` as a string of at most ``n`` characters (and a `` [...]`` mark where cut), its
    invalid UTF-8 replaced: the names and error texts the channel reports; runner.trusted
    caps the errors it reports with it too."""
    text = str(text).encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= n else text[:n] + " [...]"


class Remote:
    """An object that stays in the student's kernel; every use is one request.

    Compares by identity only: its ``__eq__`` is object's, never the student's. Reading an
    attribute uses a snapshot of the instance's own data attributes, taken with one request
    and valid until the next request that may run student code; calling a method the class
    defines is one request (``callattr``).
    """

    __slots__ = ("_ch", "_ref", "_type", "_methods", "_state", "_epoch")
    _autograder_remote = True

    def __init__(self, channel: "Channel", ref: int, type_name: str,
                 methods: frozenset = frozenset()):
        for name, value in (("_ch", channel), ("_ref", ref), ("_type", type_name),
                            ("_methods", methods), ("_state", None), ("_epoch", -1)):
            object.__setattr__(self, name, value)

    def __call__(self, *args, **kwargs):
        return self._ch.request("call", ref=self._ref, args=list(args), kwargs=dict(kwargs))

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name in self._methods:
            return _Method(self, name)
        ch = self._ch
        if self._epoch != ch.epoch:
            state = ch.request("state", ref=self._ref)
            object.__setattr__(self, "_state", state if type(state) is dict else None)
            object.__setattr__(self, "_epoch", ch.epoch)
        if self._state is not None and type(self._state.get(name)) is str:
            return ch.decode(self._state[name])
        return ch.request("getattr", ref=self._ref, name=name)

    def __setattr__(self, name: str, value) -> None:
        self._ch.request("setattr", ref=self._ref, name=name, value=value)

    def __getitem__(self, key):
        return self._ch.request("getitem", ref=self._ref, key=key)

    def __setitem__(self, key, value) -> None:
        self._ch.request("setitem", ref=self._ref, key=key, value=value)

    def __len__(self) -> int:
        n = self._ch.request("len", ref=self._ref)
        if type(n) is not int:
            raise TypeError("len() of the student's object is not an int")
        return n

    def __iter__(self):
        items = self._ch.request("list", ref=self._ref)
        return iter(items if type(items) is list else [])

    def __contains__(self, item) -> bool:
        return self._ch.request("contains", ref=self._ref, item=item) is True

    def __repr__(self) -> str:
        return f"<your {self._type} object>"

    __str__ = __repr__


class _Method:
    """``remote.name`` for a method its class defines: calling it is one request."""

    __slots__ = ("_remote", "_name")

    def __init__(self, remote: Remote, name: str):
        self._remote, self._name = remote, name

    def __call__(self, *args, **kwargs):
        r = self._remote
        return r._ch.request("callattr", ref=r._ref, name=self._name, args=list(args),
                             kwargs=dict(kwargs))

    def __repr__(self) -> str:
        return f"<your method {self._remote._type}.{self._name}>"


def type_name(value) -> str:
    """The type name tests should show: a Remote says which student type it stands for."""
    if getattr(type(value), "_autograder_remote", False):
        return object.__getattribute__(value, "_type")
    return type(value).__name__


class Channel:
    """Requests to the kernel over jupyter's connection, with a deadline per test cell.

    ``exchange(request, timeout)`` is supplied by the executor: it sends one request (None:
    end the serving loop) and returns the kernel's reply text, or raises
    ``StudentTimeout`` / ``KernelLost``.
    """

    def __init__(self, exchange):
        self._execute = exchange
        self.deadline = float("inf")
        self.namespace: TestNamespace | None = None
        self.calls = 0
        self._next_id = 0
        self.epoch = 0   # bumped by every request that may run student code
        self._remotes: dict[int, Remote] = {}
        self._tags: dict[int, object] = {}
        self.constants = Constants()
        self.read_only: set[int] = set()   # ids of what read-only cells bound: never written
        self._lent: dict[int, tuple] = {}        # number -> (object, methods, attributes)
        self._lent_numbers: dict[int, int] = {}  # id(object) -> number
        # Call backs are served only to objects lent to the request running now (or published
        # by a read-only cell): a stand-in kept from an earlier call answers nothing.
        self._request_lent: set[int] = set()
        self._published: set[int] = set()
        self._live: dict[int, tuple[str, ...]] = {}
        self.call_backs = 0   # served, all requests together
        # Arguments of a call back are data only: a handle there would need a request of its
        # own while the kernel waits for the call back's answer.
        self._plain = Decoder(_no_handles, on_constant=self._constant_back,
                              on_lent=self._lent_back)
        self._encoder = Encoder(self._encode_other, on_tensor=self.constants.node)
        self._decoder = Decoder(self._remote, on_object=_rebuild_answer, on_tag=self._tags.get)

    # encoding ------------------------------------------------------------------------------
    def lend(self, obj, methods: tuple[str, ...], attributes: tuple[str, ...],
             published: bool = False, live: tuple[str, ...] = ()):
        """Lend ``obj`` (kept here) to the learner's code: it crosses as a stand-in whose
        ``methods`` and ``attributes`` are served from here, one call back each, so what the
        object counts (its forward passes, say) is counted where the kernel cannot write. It
        answers during the requests that carry it; ``published`` (a read-only cell's own
        helper, bound in the learner's namespace): during every request."""
        number = self._lent_numbers.setdefault(id(obj), len(self._lent) + 1)
        # A live list attribute: its items are read and written one call back each.
        items = {f"{a}.{m}" for a in live for m in ("__getitem__", "__setitem__", "__len__")}
        self._lent[number] = (obj, frozenset(methods) | items, frozenset(attributes) | set(live))
        self._live[number] = tuple(live)
        if published:
            self._published.add(number)
        return obj

    def _encode_other(self, obj, depth):
        number = self._lent_numbers.get(id(obj))
        if number is not None and self._lent[number][0] is obj:
            _, methods, attributes = self._lent[number]
            self._request_lent.add(number)
            kind = getattr(obj, "__name__", None) or type(obj).__name__
            live = self._live.get(number, ())
            return {"$lent": [number, str(kind)[:60], sorted(m for m in methods if "." not in m),
                              sorted(attributes), list(live)]}
        if type(obj) is Remote:
            if obj._ch is not self:
                raise WireError("a handle from another kernel")
            return {"$h": [obj._ref, obj._type]}
        fields = object_fields(obj)
        if fields is None:
            raise WireError(f"a {type(obj).__name__} cannot be sent to the student's code "
                            "(only data, tensors, and the course's own dataclasses)")
        tag = id(obj)
        self._tags[tag] = obj
        return {"$o": [class_path(type(obj)), self._encoder.encode(fields, depth + 1), tag]}

    def _remote(self, ref: int, type_name: str, methods: frozenset = frozenset()) -> Remote:
        if ref not in self._remotes:
            self._remotes[ref] = Remote(self, ref, type_name, methods)
        return self._remotes[ref]

    def decode(self, text: str):
        return self._decoder.loads(text)

    # requests ------------------------------------------------------------------------------
    def request(self, op: str, **fields):
        self.calls += 1
        if op not in ("state", "name", "held"):
            self.epoch += 1
        try:
            msg = self._roundtrip(op, fields)
            if msg.get("stale") is True:   # a constant the kernel lost: send its bytes
                self.constants.forget_sent()
                msg = self._roundtrip(op, fields)
            self.constants.confirm()
            target = self._remotes.get(fields["ref"]) if op == "callattr" else None
            return self._answer(msg, target)
        finally:
            self._tags.clear()

    def call_with(self, fn: "Remote", args: list, bind: dict | None = None, repeat: int = 1):
        """``fn(*args)`` in the kernel, with the notebook names in ``bind`` bound for this call
        only (to objects lent from here: the tests' reference pieces, served and counted on
        this side); with ``repeat`` n > 1, the list of the n answers of ``fn`` called n times
        on the very same argument objects, in one request (what a call did to its arguments
        shows in the next answer: an answer, never the kernel's account of the arguments)."""
        if type(fn) is not Remote or fn._ch is not self:
            raise TypeError("expected a function of the learner's notebook")
        fields: dict = {"ref": fn._ref, "args": list(args), "kwargs": {}}
        if bind:
            fields["bind"] = dict(bind)
        if repeat > 1:
            fields["repeat"] = int(repeat)
        got = self.request("call", **fields)
        if repeat > 1 and (type(got) is not list or len(got) != repeat):
            raise StudentError("the kernel answered the call with something else")
        return got

    def publish(self, imports: dict, withheld: dict, values: dict, sources: dict) -> None:
        """Bind what a read-only cell bound (run here only) in the learner's namespace: see
        ``autograder.runner.publish``."""
        self.request("bind", imports=imports, withheld=withheld, values=values, sources=sources)

    def _encode_request(self, op: str, fields: dict, rid: int) -> str:
        import json
        self._tags.clear()
        self._request_lent = set()
        self.constants.begin()
        encoded = {k: (v if k in ("ref", "name", "repeat", "names", "number") else self._encoder.encode(v))
                   for k, v in fields.items()}
        return json.dumps({"op": op, "id": rid, **encoded}, separators=(",", ":"))

    # A call's prompts that are not its reply (each answered, then the reply awaited again);
    # past this many the kernel is not answering the tests.
    STRAY_LIMIT = 1000

    def _roundtrip(self, op: str, fields: dict) -> dict:
        """Send one request and return its reply. Replies carry the request's id: a prompt
        without it is the student's own ``input()`` (answered with an empty line, as at the
        end of input) and one with another id is a stale reply of the serving loop (which
        then waits for a request: ours is sent again). Either way the channel stays in step:
        the next reply taken is this request's."""
        self._next_id += 1
        rid = self._next_id
        text = self._encode_request(op, fields, rid)
        reply = self._send(text)
        strays = 0
        while strays < self.STRAY_LIMIT:
            kind, msg = _reply_kind(reply, rid)
            if kind == "reply":
                return msg
            if kind == "callback":
                reply = self._send(self._call_back(msg))
                continue
            strays += 1
            reply = self._send(text if kind == "stale" else "")
        raise StudentError(f"the kernel answered {self.STRAY_LIMIT} prompts of its own "
                           "instead of the test's request")

    def _send(self, text: str) -> str:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise StudentTimeout("the cell's time ran out while calling your code")
        reply = self._execute(text, remaining)
        if type(reply) is not str:
            raise StudentError("the kernel answered with something that is not a reply")
        return reply

    def _constant_back(self, number: int, value):
        """A call back's ``{"$c": n}``: the kernel passes one of the tests' constants (the
        weights) untouched, and the tests' own tensor stands in for it."""
        t = self.constants.by_number(int(number)) if value is None else None
        if t is None:
            raise WireError("a call back named a constant the tests do not hold")
        return t

    def _lent_back(self, body):
        """A call back passes one of the tests' lent objects (the draft model the loop was
        given): the object itself stands in, if it was lent to this request."""
        number = int(body[0])
        if number not in self._request_lent and number not in self._published:
            raise WireError("a call back passed an object lent to an earlier call")
        return self._lent[number][0]

    def _call_back(self, msg: dict) -> str:
        """Serve one call back of the learner's code to a lent object: a method in its
        ``methods`` or an attribute in its ``attributes``, with data arguments only. Whatever
        it raises goes back as an error of that type's name, raised in the learner's code."""
        import json
        try:
            number, name, args, kwargs = msg["cb"]
            number = int(number)
            if number not in self._request_lent and number not in self._published:
                raise RuntimeError("this object of the tests was lent to an earlier call, not "
                                   "to this one: use what this call is given")
            obj, methods, attributes = self._lent[number]
            self.call_backs += 1
            if args is None and name in attributes:
                value = getattr(obj, name)
            elif args is not None and name in methods:
                args, kwargs = self._plain.decode(args), self._plain.decode(kwargs or {"$d": []})
                if type(args) is not list or type(kwargs) is not dict:
                    raise WireError("malformed call back")
                _check_size([args, kwargs], self.constants)
                attr, _, method = name.rpartition(".")
                target = getattr(obj, attr) if attr else obj
                if attr and method == "__setitem__" and (len(args) != 2 or type(args[1]) is not type(
                        target[args[0]])):
                    raise TypeError(f"{attr}[...] keeps its type ({type(target[args[0]]).__name__})")
                with _deadline(self.deadline):
                    value = getattr(target, method)(*args, **kwargs)
            else:
                raise AttributeError(f"{name!r} is not lent to your code")
            return '{"ok":' + self._encoder.dumps(value) + "}"
        except Exception as e:  # noqa: BLE001 - the learner's call failed: theirs to see
            return json.dumps({"error": [type(e).__name__, cap_text(e)]})

    def end(self) -> None:
        """Close the kernel's serving loop (after each trusted cell)."""
        self._execute(None, 5)

    def _answer(self, msg: dict, target: Remote | None = None):
        if msg.get("missing") is True:
            raise KeyError("missing")
        if "error" in msg:
            raise self._student_error(msg["error"])
        if "ok" not in msg:
            raise WireError("malformed reply")
        value = self._decode_node(msg["ok"])
        if "back" in msg:
            self._copy_back(self._decode_node(msg["back"]))
        if target is not None and "state" in msg:
            state = self._decode_node(msg["state"])
            object.__setattr__(target, "_state", state if type(state) is dict else None)
            object.__setattr__(target, "_epoch", self.epoch)
        return value

    def _copy_back(self, back) -> None:
        """Update the objects the tests lent to a call with their fields after it, only where
        the object is the learner's to write (a test marked it so, ``testkit.yours_to_write``,
        or it came from the kernel in the first place, as an answer): only
        fields it already had, each with a value of the same type (data, never behaviour).
        Anything else the tests lend (a read-only cell's SLO, which a later hidden test reads
        for its reference) keeps its values, whatever the learner's code did to its copy."""
        for item in back if type(back) is list else []:
            if type(item) is not list or len(item) != 2 or type(item[1]) is not dict:
                continue
            obj = self._tags.get(item[0])
            if _WRITABLE.get(id(obj)) is not obj or id(obj) in self.read_only:
                continue
            fields = getattr(obj, "__dict__", None)
            if type(fields) is not dict:
                continue
            for name, value in item[1].items():
                if name in fields and type(value) is type(fields[name]):
                    object.__setattr__(obj, name, value)

    def _decode_node(self, node):
        try:
            return self._decoder.decode(node)
        except (RecursionError, ValueError, TypeError, KeyError, IndexError) as e:
            if isinstance(e, WireError):
                raise
            raise WireError(f"malformed reply ({type(e).__name__})") from None

    def _student_error(self, err) -> BaseException:
        try:
            module, name, message = (str(x) for x in err)
        except (TypeError, ValueError):
            module, name, message = "", "Error", ""
        name, message = cap_text(name, 80), cap_text(message)
        known = (self.namespace.exception_classes().get(name)
                 if self.namespace is not None and module != "builtins" else None)
        builtin = getattr(builtins, name, None) if module == "builtins" else None
        cls = known or builtin
        if not (isinstance(cls, type) and issubclass(cls, Exception)) \
                or issubclass(cls, AssertionError):
            cls = StudentError
            message = f"{name}: {message}"
        try:
            exc = cls(message)
        except Exception:  # an exception class with a different signature
            exc = StudentError(f"{name}: {message}")
        exc.autograder_student = name  # marks the error as the student's, for feedback
        return exc


# Objects tests marked as the learner's to write (id -> object, kept alive so an id is never
# reused by another object while marked).
_WRITABLE: dict[int, object] = {}


def mark_writable(obj: object) -> object:
    """See ``autograder.testkit.yours_to_write``."""
    _WRITABLE[id(obj)] = obj
    return obj


class Constants:
    """The tests' large constant tensors: sent to the kernel once, then by number.

    A tensor is registered when a read-only cell binds it (alone, or as a value of a dict or
    list it binds); it keeps its number while it is the same object at the same version
    (an in-place change on this side makes it a new constant)."""

    MIN_BYTES = 65536

    def __init__(self) -> None:
        self._kept: dict[int, list] = {}   # id -> [tensor, version, number]
        self._sent: set[int] = set()       # numbers the kernel confirmed
        self._pending: set[int] = set()    # numbers sent with bytes in the current request
        self._next = 0

    def register(self, value) -> None:
        items = (value.values() if type(value) is dict
                 else value if type(value) in (list, tuple) else (value,))
        torch = sys.modules.get("torch")
        for t in items:
            if torch is not None and type(t) in (torch.Tensor, torch.nn.Parameter) \
                    and t.numel() * t.element_size() >= self.MIN_BYTES:
                self._next += 1
                self._kept[id(t)] = [t, t._version, self._next]

    def node(self, t):
        kept = self._kept.get(id(t))
        if kept is None or kept[0] is not t:
            return None
        if kept[1] != t._version:           # changed in place here: a new constant
            self._next += 1
            kept[1:] = [t._version, self._next]
        number = kept[2]
        if number in self._sent:
            return {"$c": number}
        from autograder.protocol.wire import tensor_node
        self._pending.add(number)
        return {"$cset": [number, {"$tensor": tensor_node(t)}]}

    def begin(self) -> None:
        self._pending = set()

    def confirm(self) -> None:
        self._sent |= self._pending
        self._pending = set()

    def forget_sent(self) -> None:
        self._sent.clear()

    def by_number(self, number: int):
        """The tests' own tensor that constant ``number`` stands for now (the kernel names
        one in a call back instead of sending its bytes back), or None."""
        for t, version, n in self._kept.values():
            if n == number and t._version == version:
                return t
        return None

    def holds(self, t) -> bool:
        """``t`` is one of the tests' constants, as registered."""
        kept = self._kept.get(id(t))
        return kept is not None and kept[0] is t

    def __len__(self) -> int:
        return len(self._kept)


# The most tensor elements one call back may pass: the tests' inputs are far smaller (the
# shipped weights cross by number, not counted here), so a call past it is the learner's.
CALL_BACK_ELEMENTS = 1 << 22
# A call back's work is bounded before it runs (issue 53: one torch call, such as attention
# over 55k positions under a broadcast mask, cannot be stopped by the cell's alarm): no
# dimension longer than the vocabulary (4096, logits); token ids and positions (integer
# tensors, and Python ints in lists) at most twice the longest window of the tests' models
# (512) in any dimension and 8192 in all; at most 256 tensors, constants included (the
# shipped weights are 56), so a weights dict repeated over many layers is refused too.
CALL_BACK_DIM = 4096
CALL_BACK_POSITIONS = 1024
CALL_BACK_TOKENS = 8192
CALL_BACK_TENSORS = 256


def _check_size(value, constants: "Constants") -> None:
    """Refuse, before it runs, a call back whose tensors are past what the tests' own inputs
    need (see CALL_BACK_ELEMENTS and the bounds after it): the tests' own constants (the
    weights, which crossed by number) count only toward the number of tensors."""
    torch = sys.modules.get("torch")
    total, tokens, tensors, todo = 0, 0, 0, [value]
    while todo:
        v = todo.pop()
        if type(v) in (list, tuple):
            todo.extend(v)
        elif type(v) is dict:
            todo.extend(v.values())
        elif type(v) is int:   # a prompt passed as a list: its token ids count too
            tokens += 1
        elif torch is not None and isinstance(v, torch.Tensor):
            tensors += 1
            if constants.holds(v):
                continue
            total += v.numel()
            longest = max(v.shape, default=1)
            integer = not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool)
            tokens += v.numel() if integer else 0
            if longest > CALL_BACK_DIM or (integer and longest > CALL_BACK_POSITIONS):
                raise ValueError(
                    f"your call passes a tensor of shape {tuple(v.shape)} to the tests' object; no "
                    f"dimension of the tests' inputs is longer than {CALL_BACK_DIM:,} (token ids and "
                    f"positions: {CALL_BACK_POSITIONS:,}, twice the longest context window here): "
                    "pass the tensors the test gave you")
    if total > CALL_BACK_ELEMENTS or tokens > CALL_BACK_TOKENS or tensors > CALL_BACK_TENSORS:
        raise ValueError(f"your call passes {total:,} tensor elements ({tokens:,} token ids and positions, "
                         f"{tensors:,} tensors) to the tests' object; the tests' inputs are far smaller "
                         f"(limits {CALL_BACK_ELEMENTS:,}, {CALL_BACK_TOKENS:,} and {CALL_BACK_TENSORS:,}): "
                         "pass the tensors the test gave you")


class _deadline:
    """The tests' own work serving a call back stops at the cell's deadline: an alarm where
    this is the main thread (a long loop of torch calls is stopped between two of them), a
    check after the call elsewhere. Running out is the grader's limit (``GraderOverran``)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.alarm = False

    def __enter__(self):
        import signal
        import threading
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise GraderOverran("the cell's time ran out before the tests could serve your call")
        if left != float("inf") and threading.current_thread() is threading.main_thread():
            def overran(*_):
                raise GraderOverran("the tests' own work serving your call ran past the cell's time")
            self.previous = signal.signal(signal.SIGALRM, overran)
            signal.setitimer(signal.ITIMER_REAL, left)
            self.alarm = True
        return self

    def __exit__(self, *exc) -> None:
        if self.alarm:
            import signal
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        if exc[0] is None and time.monotonic() > self.deadline:
            raise GraderOverran("the tests' own work serving your call ran past the cell's time")


def _no_handles(*_args):
    raise WireError("a call back's arguments are data only (numbers, lists, tensors ...)")


def _reply_kind(text: str, rid: int) -> tuple[str, dict | None]:
    """("reply", message) for the reply to request ``rid``; ("callback", message) for a call
    of the learner's code to a lent object; ("stale", None) for a reply of the serving loop to
    another request; ("foreign", None) for any other prompt."""
    import json
    if text.startswith('{"cb":'):
        try:
            msg = parse(text)
        except (ValueError, RecursionError):  # WireError included: over a budget
            msg = None
        if type(msg) is dict and type(msg.get("cb")) is list and len(msg["cb"]) == 4:
            return "callback", msg
        return "foreign", None
    if not text.startswith('{"id":'):
        return "foreign", None
    try:
        msg = parse(text)   # the size and the elements counted before anything is built
    except WireError:
        raise
    except (ValueError, RecursionError):
        raise WireError("malformed reply") from None
    if type(msg) is not dict or type(msg.get("id")) is not int:
        raise WireError("malformed reply")
    return ("reply", msg) if msg["id"] == rid else ("stale", None)


def call_each(fn, calls: list) -> list:
    """``[fn(*args) for args in calls]``; for a function of the student's, one request."""
    if type(fn) is not Remote:
        return [fn(*args) for args in calls]
    got = fn._ch.request("map", ref=fn._ref, calls=[[list(args), {}] for args in calls])
    if type(got) is not list or len(got) != len(calls):
        raise StudentError(f"the kernel answered {len(calls)} calls with something else")
    return got


def _rebuild_answer(path: str, fields, _tag):
    """A course dataclass the student's code built (an EngineConfig, say), rebuilt here from
    its fields by the real class's constructor. It is the learner's data already, so a later
    call may write into it (a cache the kernel built, which the learner's code then fills)."""
    return mark_writable(rebuild(allowed_class(path), fields))


class TemplateNameUnbound(NameError):
    """A test used a name the assignment's own cells bind, and the cell that binds it did not
    get that far: the name is not looked up in the student's kernel (there it would be the
    student's to choose), so the test fails."""

    def __init__(self, name: str):
        super().__init__(f"`{cap_text(name, 80)}` belongs to the assignment's own cells, which did "
                         "not define it (a read-only cell above failed; see the notes)", name=name)


class TestNamespace(dict):
    """The test cells' globals: trusted names first, then the student's, fetched as needed."""

    __test__ = False  # not a pytest test class

    def __init__(self, channel: Channel, template_names: frozenset[str] = frozenset()):
        super().__init__(__builtins__=builtins, __name__="__autograder_tests__")
        self._channel = channel
        self._fetched: set[str] = set()
        self._missing: set[str] = set()
        # What the assignment's own cells (read-only and test cells) bind: the tests' names,
        # never the student's, even when the cell that binds one failed before binding it.
        self.template_names = frozenset(template_names)

    def __missing__(self, name: str):
        if name in self.template_names:
            raise TemplateNameUnbound(name)
        if hasattr(builtins, name) or name in self._missing:
            raise KeyError(name)
        try:
            value = self._channel.request("name", name=name)
        except KeyError:
            self._missing.add(name)
            raise KeyError(name) from None
        dict.__setitem__(self, name, value)
        self._fetched.add(name)
        return value

    def __setitem__(self, name, value) -> None:
        self._fetched.discard(name)
        dict.__setitem__(self, name, value)

    def name_of(self, value) -> str | None:
        """The student's name under which ``value`` (a handle) was fetched, if it was."""
        for name in self._fetched:
            if dict.get(self, name) is value:
                return name
        return None

    def forget_student_values(self) -> None:
        """After a student cell ran: what was fetched may have changed."""
        self._channel.epoch += 1
        for name in self._fetched:
            self.pop(name, None)
        self._fetched.clear()
        self._missing.clear()

    def exception_classes(self) -> dict[str, type]:
        """Exception classes the trusted cells bound (a student error of that name maps in)."""
        return {k: v for k, v in dict.items(self)
                if isinstance(v, type) and issubclass(v, Exception) and k not in self._fetched}
