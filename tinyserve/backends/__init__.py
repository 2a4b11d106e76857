"""Decode backends: the step machines on fixed buffers that the loops choose.

A backend runs the model's own forward pass on buffers whose shapes never change (a static
KV cache, static token and position tensors, a batch padded up to a bucket), so the step can
be captured once as a CUDA graph or compiled once by ``torch.compile`` and then replayed. The
loop that runs a step (``generate``, ``engine``, ``speculative``) picks eager or a backend,
as nano-vllm's model runner picks eager or graph; the model knows nothing of any of them.

The room's rule (``tests/test_package_layout.py`` holds it): a backend imports only
``config``, ``device``, ``toolchain``, ``model``, ``kv_cache``, ``paged`` and ``sampling`` from tinyserve
(and the other backends); never a loop, ``roofline``, ``checkpoint`` or anything above them.
Only the loops and the measuring modules above them (``roofline``, ``graph_check``) import a
backend.

    static          what every static step shares: ``StaticKVCache`` (fixed shapes, no
                    lengths on the host), ``window_for`` (the cache's window) and the one
                    ``bucket_for`` (the batch's bucket)
    compiled        the decode step traced by ``torch.compile`` (opt-in), one per (bucket,
                    window); the engine's token-wise layers compiled in place
    cuda_graph      the decode step captured once per (bucket, window) and replayed (CUDA's
                    default); the engine's pure-decode steps on paged buffers
    spec_graphs     speculation's draft and verify passes, one static buffer and graph per width
    decoder_cache   the bounded (least recently used first out) cache of built decoders
    fast            what ``path="fast"`` runs here, said once: the graphs on CUDA, on a CPU
                    the fastest of the step compiled in max-autotune with frozen weights, eager
                    over packed weights and plain eager; a persistent kernel cache and
                    ``prepare`` (the shapes a run needs, up front)
    choices         what each fast shape runs: every way timed in turns once, kept on disk
"""
