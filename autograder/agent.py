"""The kernel's end of the grading channel: answers the trusted test runner's requests.

Imported into the student's (sandboxed) kernel. It is *not* trusted and needs not be: a
submission may replace it, patch it or answer with anything it likes, and the worst it can
do is hand the tests wrong data, which is no more than a wrong answer. See
``autograder.channel`` for the protocol and why no verdict can be forged from here.

Every request is one JSON object (``op`` plus fields, values encoded by ``autograder.wire``);
every reply is ``{"ok": value}`` or ``{"error": [module, type name, message]}``. The runner
sends a request as a ``user_expressions`` entry of a silent execute request; ipykernel
evaluates it and returns the reply string in the execute reply.
"""
from __future__ import annotations

import sys

from .wire import Decoder, Encoder, WireError, allowed_class, rebuild

_objects: dict[int, object] = {}     # handle id -> object kept alive for the runner
_tagged: dict[int, object] = {}      # id(rebuilt trusted object) -> its tag, for this call
_by_tag: dict[int, object] = {}      # tag -> rebuilt object, so the same tag is one object


def _user_ns() -> dict:
    try:
        shell = sys.modules["IPython"].get_ipython()
        if shell is not None:
            return shell.user_ns
    except (KeyError, AttributeError):
        pass
    return sys.modules["__main__"].__dict__


def _handle(obj, depth):
    if id(obj) in _tagged:
        return {"$tag": _tagged[id(obj)]}
    _objects[id(obj)] = obj
    return {"$h": [id(obj), type(obj).__name__]}


def _rebuild(path, fields, tag):
    if tag in _by_tag:
        return _by_tag[tag]
    obj = rebuild(allowed_class(path), fields)
    _by_tag[tag] = obj
    _tagged[id(obj)] = tag
    return obj


def _lookup(ref, _name=""):
    if ref not in _objects:
        raise WireError("stale handle")
    return _objects[ref]


_encoder = Encoder(_handle)
_decoder = Decoder(_lookup, _rebuild)
_MISSING = object()


def _apply(req: dict):
    op = req["op"]
    if op == "name":
        value = _user_ns().get(req["name"], _MISSING)
        return {"$missing": True} if value is _MISSING else value
    target = _lookup(req["ref"])
    if op == "call":
        args = _decoder.decode(req.get("args", []))
        kwargs = _decoder.decode(req.get("kwargs", {"$d": []}))
        return target(*args, **kwargs)
    if op == "getattr":
        return getattr(target, req["name"])
    if op == "setattr":
        setattr(target, req["name"], _decoder.decode(req["value"]))
        return None
    if op == "getitem":
        return target[_decoder.decode(req["key"])]
    if op == "setitem":
        target[_decoder.decode(req["key"])] = _decoder.decode(req["value"])
        return None
    if op == "len":
        return len(target)
    if op == "list":
        return list(target)
    if op == "contains":
        return _decoder.decode(req["item"]) in target
    raise WireError(f"unknown op {str(op)[:20]!r}")


def serve(request: str) -> str:
    """Answer one request; whatever the student's code raises comes back as data."""
    import json
    try:
        req = json.loads(request)
        value = _apply(req)
        if type(value) is dict and value.get("$missing") is True and req["op"] == "name":
            return '{"missing":true}'
        return '{"ok":' + _encoder.dumps(value) + "}"
    except BaseException as e:  # noqa: BLE001 - the student's error is the answer
        if isinstance(e, KeyboardInterrupt):
            raise  # the runner's timeout interrupt: let ipykernel report it
        kind = type(e)
        try:
            message = str(e)
        except BaseException:  # noqa: BLE001 - a __str__ that raises
            message = "<unprintable>"
        return json.dumps({"error": [str(getattr(kind, "__module__", "")), kind.__name__,
                                     message[:2000]]})
    finally:
        _tagged.clear()
        _by_tag.clear()
