"""A bounded cache of static decoders, least recently used dropped first.

A static decoder (:class:`~tinyserve.backends.cuda_graph.GraphDecoder`,
:class:`~tinyserve.backends.spec_graphs.StaticPasses`,
:class:`~tinyserve.backends.compiled.CompiledDecoder`)
holds a KV cache for its whole batch bucket and window and, on CUDA, its captured or
compiled graphs: for a 1B model in bf16 a bucket of 64 rows of 2,048 slots is about 4 GB
of cache alone (64 x 2,048 tokens x 32 KB). Reusing one saves a capture or a compile,
so they are kept; keeping every one ever made would hold that memory, and the model each
one points to, for as long as the process lives (a ``WeakKeyDictionary`` keyed by the model
does not help: its values hold the model, so the key never dies). So each kind is kept in
a :class:`DecoderCache` of at most ``limit`` decoders: making one more drops the least
recently used idle one, whose buffers and graphs are then freed with it. A decoder in use
(``in_use`` true: a request still streams through it) is never dropped.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch.nn as nn

__all__ = ["DecoderCache"]

D = TypeVar("D")


class DecoderCache(Generic[D]):
    """At most ``limit`` decoders, looked up by (model, key), least recently used first out.

    ``exclusive`` lookups hand out only a decoder not ``in_use`` (and make another one if
    every match is busy); shared ones return any decoder with the key (a compiled step holds
    no request state)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a decoder cache holds at least one decoder, got limit={limit}")
        self.limit = limit
        # serial -> (model, key, decoder); order: least recently used first. The entry holds
        # the model, so id(model) in a lookup cannot name a dead model's entries.
        self._entries: OrderedDict[int, tuple[nn.Module, Hashable, D]] = OrderedDict()
        self._serial = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, model: nn.Module, key: Hashable, make: Callable[[], D], *,
            exclusive: bool = True) -> D:
        """The longest-kept decoder of ``model`` with ``key`` (free, if ``exclusive``),
        else ``make()``'s, kept; marked most recently used either way."""
        for serial in list(self._entries):
            owner, k, decoder = self._entries[serial]
            if owner is model and k == key and not (exclusive and getattr(decoder, "in_use")):
                self._entries.move_to_end(serial)
                return decoder
        decoder = make()
        self._serial += 1
        self._entries[self._serial] = (model, key, decoder)
        self._evict(keep=self._serial)
        return decoder

    def _evict(self, keep: int) -> None:
        # The one just made is about to be used: never its own victim.
        idle = [s for s, (_, _, d) in self._entries.items()
                if s != keep and not getattr(d, "in_use", False)]
        for serial in idle[:max(0, len(self._entries) - self.limit)]:
            del self._entries[serial]

    def decoders(self, model: nn.Module | None = None) -> list[D]:
        """The decoders kept (of ``model``), least recently used first."""
        return [d for m, _, d in self._entries.values() if model is None or m is model]

    def drop(self, model: nn.Module) -> None:
        """Forget every decoder of ``model`` (in use or not: their holders keep theirs)."""
        for serial in [s for s, (m, _, _) in self._entries.items() if m is model]:
            del self._entries[serial]

    def clear(self) -> None:
        self._entries.clear()
