"""Kept for the notebooks: chapter 8 imports ``tinyserve.spec_graphs``, and paths the
notebooks name stay. The code lives in :mod:`tinyserve.backends.spec_graphs` (speculation's
passes on static buffers, replayed as CUDA graphs on a GPU); this module only re-exports it."""
from .backends.spec_graphs import MAX_PASSES, StaticPasses, WidthKVCache, static_passes

__all__ = ["WidthKVCache", "StaticPasses", "static_passes", "MAX_PASSES"]
