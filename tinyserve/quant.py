"""int8 weight-only quantization and an int8 KV cache.

**The quantizer.** Symmetric, one scale per row: a row ``x`` (a weight's output channel, or
one head's key vector at one token) is stored as ``q = round(x / s)`` in int8 with
``s = max|x| / 127``, and read back as ``q * s``. The largest entry lands exactly on +-127,
so nothing is clipped and every entry is off by at most ``s / 2`` (rounding to the nearest
step). One scale per row rather than per tensor matters: a single row with an outlier would
otherwise set a coarse step for every other row. -128 is never used, so the grid is
symmetric and ``-x`` quantizes to ``-q``. An all-zero row gets ``s = 1`` (any scale stores
zeros exactly; 1 avoids a division by zero).

**Weights** (:class:`Int8Linear`): 1 byte per weight plus 4 bytes per output channel,
against 4 bytes per weight in fp32. Activations stay in the model's dtype ("weight-only"),
so the matmul runs in float. Four ways to compute it, all tested equal, and a fifth that
trades accuracy for speed, tested within a stated bound:

- ``reference``: dequantize the weight, then ``F.linear``: the plain definition;
- ``scale_after``: ``F.linear(x, q) * s``. A row's scale multiplies every term of
  that output's dot product, so it can be applied once to the result instead of to every
  weight: the same number, fewer multiplies, and no float copy of the weight scaled first.
  Eagerly, ``q`` is still cast to a float copy each call: more bytes than a bf16 weight;
- ``int8pack``: PyTorch's fused kernel ``aten._weight_int8pack_mm(x, q, s)``, which
  computes ``x @ q.T * s`` without materialising a float weight (CPU; some builds register
  one for CUDA too, ``aten/src/ATen/native/cuda/int8mm.cu``);
- ``compiled``: ``scale_after`` through ``torch.compile`` with coordinate-descent tuning.
  For a one-row input inductor rewrites the matmul as a multiply-and-sum
  (``torch/_inductor/decomposition.py``, ``mm``) and fuses the cast into that reduction:
  the kernel reads int8. With more rows it calls cuBLAS on a cast copy, as eager does;
- ``auto`` (default): ``scale_after`` on a CPU (the course's numbers), and on CUDA the
  fastest of ``int8pack`` (where this torch build has a CUDA kernel for it: probed once per
  device and dtype with a tiny tensor), ``compiled`` (where Triton is installed) and the
  eager ``scale_after`` (cuBLAS's bf16 matmul on a cast copy), timed once per device, dtype
  and shape class (:func:`auto_kernel`) and recorded (:func:`auto_choices`). Timed, because
  upstream's CUDA int8pack kernel is a plain loop on CUDA cores that can lose to cuBLAS;
- ``fbgemm`` (CPU only): the fast one. **Not weight-only**: W8A8 dynamic. It is what
  ``torch.ao.nn.quantized.dynamic.Linear`` runs (``quantized::linear_dynamic`` over FBGEMM):
  each call also quantizes the *activations* to 8-bit integers, with one affine scale and zero
  point for the whole input tensor taken from its min and max at run time, multiplies int8 by int8
  into int32 accumulators, and rescales to float. With ``reduce_range=True`` (the module's
  setting: x86's ``vpmaddubsw`` sums pairs of u8 x s8 products in 16 bits, which 8-bit
  activations could overflow; see ``torch/ao/quantization/observer.py``) the activations get
  7 bits, 128 levels. Each row (token) is first divided by its largest
  ``|x|`` and its output multiplied back, so one outlier token does not coarsen every other
  token's step (on the shipped model, teacher-forced over 1,024 tokens: 4% relative RMS
  logit error this way, 17% with one step for all). The weights are *our* int8 values and
  scales, exactly (a per-channel qint8 tensor, zero point 0), packed once into FBGEMM's
  layout on the first forward and kept on the module (not in the state dict; an extra int8
  copy in memory). So its error against ``reference`` is the activations' rounding alone: at
  most half an activation step times the sum of ``|weight|`` along each output row, far
  larger than the weight-only kernels' float rounding. After that rescaling the rows of a
  batch still share the kernel's min and max, so a row's step is between 1/127 and 2/127 of
  its own largest ``|x|`` depending on its batch-mates: batched outputs are close to, not
  equal to, the same rows run alone.

**A scale per group of weights** (:func:`quantize_groups`, ``quantize_model(group_size=32)``):
each row split into groups of ``group_size`` consecutive weights (along the input), each
group quantized as a row is above, with a scale of its own. llama.cpp's q8_0 does this with
32 (its block). An outlier then sets the step of its 31 neighbours only, where with one
scale per row it coarsens all ``in_features`` weights of that output (which scheme keeps the
trained target closer to fp32, q8_0 among them, is measured there by ``bench trained_quality``:
random weights have no outliers). Our scale is fp32, 4 bytes per group
(a 36-byte block of 32, 1/8 byte a weight), where q8_0 stores an fp16 one (ggml's
``block_q8_0``: 2 + 32 = 34 bytes); and
PyTorch's int8 CPU kernels take one scale per output (``_weight_int8pack_mm``, fbgemm's
per-channel weights), none per group: the ``grouped`` kernel dequantizes and calls the GEMM
eagerly, and inside a compiled step of a few rows (the fast path's decode step and verify
passes, :data:`FUSED_ROWS`) writes the product as one multiply-and-sum
(:func:`grouped_matvec`) that inductor turns into a reduction reading the int8 weights
directly. Weight-only, as ``scale_after`` is: the activations stay in float.

**The tied embedding** (:func:`quantize_model`). The target reads tokens in and scores them out
with one (vocab, hidden) matrix. Per-row scales suit both uses: a row is one token's embedding
(what a lookup reads) and one output channel of the LM head. So the matrix is quantized once
and the int8 values and scales are shared by :class:`Int8Embedding` and the head's
:class:`Int8Linear`: the tie, and the memory it saves, survive. ``embeddings=False`` keeps
that matrix in float (what published weight-quantization recipes do by default, e.g.
llm-compressor's ``ignore: ["lm_head"]``); the ratio in the bench shows what it costs.

**The KV cache** (:class:`Int8KVCache`): the contiguous cache with int8 slots and one fp32
scale per (layer, row, KV head, token). ``update`` quantizes the new keys and values as they
are written and hands attention the dequantized cache, so the model code is unchanged.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .kv_cache import KVCache
from .model import TinyLlama

QMAX = 127  # symmetric int8 grid: -127..127
KERNELS = ("reference", "scale_after", "int8pack", "fbgemm", "compiled", "grouped", "auto")
#: The kernels that take a scale per group of weights (:func:`quantize_groups`); the others
#: are written for one scale per output row.
GROUP_KERNELS = ("reference", "grouped", "auto")
#: Inside a compiled step, :func:`grouped_matvec` multiplies inputs of at most this many rows
#: (decode steps, verify passes). More rows dequantize and call the GEMM: the reduction's work
#: grows with the rows (each converts and multiplies every weight again). With freezing (the
#: fast path on a CPU) that dequantization of a constant is folded at compile time, so such a
#: step holds a float copy of the weights (measured on a one-layer model: every projection
#: frozen in fp32; only the embedding table, which a lookup reads, stayed int8).
FUSED_ROWS = 8
KERNEL_NOTES = {
    "reference": "dequantize the weight, then F.linear (the plain definition)",
    "scale_after": "F.linear(x, q) * s: int8 values cast to float, one scale per output after",
    "int8pack": "aten._weight_int8pack_mm: PyTorch's fused kernel (CPU; CUDA where the build "
                "has one), weight-only, float x int8",
    "fbgemm": "quantized::linear_dynamic (FBGEMM, CPU): W8A8 dynamic, activations quantized "
              "per call to 7 bits, int8 x int8 -> int32; fast, not weight-only",
    "compiled": "scale_after through torch.compile: one-row steps read int8 in a fused "
                "reduction (inductor); more rows use cuBLAS on a cast copy",
    "grouped": "a scale per group of weights (q8_0's grouping, an fp32 scale): eagerly "
               "dequantize, then "
               "F.linear; in a compiled step of few rows one fused reduction that reads int8",
    "auto": "scale_after on the CPU; on CUDA the fastest of int8pack, compiled and scale_after "
            "(timed once per device, dtype and shape class; see auto_choices())",
}
# The message PyTorch attaches to its (deprecated) quantized-tensor constructors; building the
# per-channel qint8 weight that quantized::linear_prepack takes is the only way into the
# FBGEMM kernel, so this one warning, and only it, is silenced where that tensor is built.
_QTENSOR_DEPRECATION = (r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other "
                        r"quantized tensor creation functions")


def fbgemm_engine(engines: list[str] | None = None) -> str:
    """The quantized engine whose ``linear_prepack`` packs for FBGEMM ('fbgemm', else 'x86',
    which uses FBGEMM for linear layers) among ``engines`` (default: this build's
    ``torch.backends.quantized.supported_engines``); a clear error where neither is."""
    if engines is None:
        engines = list(torch.backends.quantized.supported_engines)
    for engine in ("fbgemm", "x86"):
        if engine in engines:
            return engine
    raise RuntimeError(f"kernel='fbgemm' needs PyTorch's FBGEMM quantized engine ('fbgemm' or "
                       f"'x86'), and this build has only {engines}; use kernel='int8pack' or "
                       f"'scale_after'")


def fbgemm_prepack(qweight: Tensor, scale: Tensor) -> torch.ScriptObject:
    """Our per-row int8 weight and scales as FBGEMM's packed weight (per-channel qint8, zero
    point 0: the same numbers, exactly), for ``quantized::linear_dynamic``."""
    engine = fbgemm_engine()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_QTENSOR_DEPRECATION, category=UserWarning)
        qw = torch._make_per_channel_quantized_tensor(
            qweight.cpu(), scale.cpu().double(),
            torch.zeros(len(scale), dtype=torch.long), 0)
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine  # prepack packs for the current engine
    try:
        return torch.ops.quantized.linear_prepack(qw, None)
    finally:
        torch.backends.quantized.engine = previous


# ------------------------------------------------------------ the int8 kernel on CUDA

_CUDA_CHOICE: dict[tuple[str, torch.dtype], str] = {}   # (device, dtype) -> kernel, once each


def scale_after(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    """``F.linear(x, q) * s`` (int8 values are exact in fp32, bf16 and fp16)."""
    return F.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)


_compiled: list = []   # the torch.compile'd scale_after, made on first use


def compiled_scale_after(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    """:func:`scale_after` through ``torch.compile`` (one compiled function for every layer:
    dynamo marks sizes that change dynamic, and specialises a one-row input, whose matmul
    coordinate-descent tuning lets inductor decompose into a reduction that reads int8).
    Inside a model being compiled it is the plain expression: the outer compile fuses it."""
    if torch.compiler.is_compiling():
        return scale_after(x, qweight, scale)
    if not _compiled:
        _compiled.append(torch.compile(scale_after,
                                       options={"coordinate_descent_tuning": True}))
    return _compiled[0](x, qweight, scale)


def int8pack_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``aten._weight_int8pack_mm`` runs on ``device`` for ``dtype`` activations and
    gives ``x @ q.T * s``: tried on a tiny tensor (a build without a kernel for the device
    raises; one with a kernel for other dtypes raises too)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=g).to(device, dtype)
    q = torch.randint(-QMAX, QMAX + 1, (8, 64), generator=g, dtype=torch.int8).to(device)
    s = (torch.rand(8, generator=g) + 0.5).to(device)
    want = F.linear(x.float(), q.float()) * s
    try:
        got = torch.ops.aten._weight_int8pack_mm(x, q, s.to(dtype)).float()
        return got.shape == want.shape and bool(
            torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())))
    except (RuntimeError, NotImplementedError):   # no kernel here, or no values to compare
        return False


def compiler_available(device: torch.device) -> bool:
    """Whether ``torch.compile`` can generate kernels for ``device``: Triton on CUDA; on a
    CPU a working C++ compiler with OpenMP (:func:`tinyserve.toolchain.probe`: a
    tiny compile, once a process)."""
    if device.type != "cuda":
        from .toolchain import probe
        return probe().ok
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


def choose_cuda_kernel(int8pack: bool, compiler: bool, device: str = "cuda") -> str:
    """The kernel ``auto`` runs on a CUDA device: one that reads int8 in the matmul."""
    if int8pack:
        return "int8pack"
    if compiler:
        return "compiled"
    raise RuntimeError(
        f"no int8 kernel that reads int8 weights on {device}: this torch build has no CUDA "
        f"kernel for aten._weight_int8pack_mm and torch.compile has no Triton to compile "
        f"scale_after with; install Triton (pip install triton), or pass kernel='scale_after' "
        f"(a float copy of every weight each step) or run the float model")


def cuda_kernel(device: torch.device | str, dtype: torch.dtype) -> str:
    """:func:`choose_cuda_kernel` for ``device`` and ``dtype``, probed once and remembered.
    The probe runs a kernel and reads its result back, so it must not run inside CUDA-graph
    capture: the graph decoder's warm-up steps run it first."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _CUDA_CHOICE:
        if (device.type == "cuda" and torch.cuda.is_available()
                and torch.cuda.is_current_stream_capturing()):
            raise RuntimeError("the int8 kernel is chosen on the first step on a device; run "
                               "one step eagerly before capturing a CUDA graph")
        _CUDA_CHOICE[key] = choose_cuda_kernel(int8pack_runs(device, dtype),
                                               compiler_available(device), str(device))
    return _CUDA_CHOICE[key]


# The candidates ``auto`` times on CUDA, in the order a tie is broken: the two that read int8
# inside the matmul first (fewer bytes, and no float copy in memory), then cuBLAS's matmul
# on a cast copy (bf16 for a bf16 model: the "plain bf16" baseline, keeping int8 storage).
AUTO_CANDIDATES = ("int8pack", "compiled", "scale_after")


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose on CUDA for one (device, dtype, shape class), and why: the
    seconds per call each candidate took."""

    device: str
    dtype: torch.dtype
    rows: str                 # the shape class's rows: "1", "2-16" or ">16"
    in_features: int
    out_features: int
    kernel: str
    seconds: dict[str, float]

    def __str__(self) -> str:
        times = ", ".join(f"{k} {1e6 * t:.1f} us" for k, t in self.seconds.items())
        return (f"int8 auto on {self.device} ({str(self.dtype).replace('torch.', '')}, "
                f"{self.rows} rows x {self.in_features} -> {self.out_features}): {times}: "
                f"{self.kernel}")


AUTO_CHOICES: dict[tuple, AutoChoice] = {}   # (device, dtype, shape class) -> the choice
_INT8PACK_RUNS: dict[tuple[str, torch.dtype], bool] = {}   # int8pack_runs, once per device


def shape_class(rows: int, in_features: int, out_features: int) -> tuple[str, int, int]:
    """The class a matmul's timing stands for: its weight's shape and its rows as one (a
    batch-1 decode step: a matrix-vector product, which the compiled path turns into a
    reduction that reads int8), 2-16 (decode batches) or more (prefill)."""
    label = "1" if rows == 1 else "2-16" if rows <= 16 else ">16"
    return label, in_features, out_features


def time_kernel(kernel: str, x: Tensor, qweight: Tensor, scale: Tensor) -> float:
    """Seconds per call of ``kernel`` on these operands (CUDA): two calls first (the
    compiled one compiles), then the fastest of 3 runs of 10 calls between CUDA events."""
    def call() -> Tensor:
        if kernel == "int8pack":
            return torch.ops.aten._weight_int8pack_mm(x, qweight, scale.to(x.dtype))
        if kernel == "compiled":
            return compiled_scale_after(x, qweight, scale)
        return scale_after(x, qweight, scale)
    with torch.no_grad():
        for _ in range(2):
            call()
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                call()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / 10)   # ms -> s, per call
    return best


def auto_kernel(x: Tensor, qweight: Tensor, scale: Tensor) -> str:
    """``auto``'s kernel on CUDA for ``x`` (..., in) times ``qweight`` (out, in): the
    fastest of :data:`AUTO_CANDIDATES` that run here, timed on these operands the first time
    this (device, dtype, shape class) is met, then remembered (and printed once). Timing
    reads the clock back, so it must not happen inside CUDA-graph capture: the graph
    decoders' warm-up steps run every shape they capture first."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows == 0:
        return "scale_after"                          # nothing to multiply, nothing to time
    key = (str(x.device), x.dtype, shape_class(rows, *reversed(qweight.shape)))
    if key not in AUTO_CHOICES:
        if x.device.type == "cuda" and torch.cuda.is_available() \
                and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the int8 kernel is chosen on the first step of a shape; run "
                               "one step eagerly before capturing a CUDA graph")
        flat = x.reshape(rows, x.shape[-1])
        probe = (str(x.device), x.dtype)
        if probe not in _INT8PACK_RUNS:
            _INT8PACK_RUNS[probe] = int8pack_runs(x.device, x.dtype)
        runs = {"int8pack": _INT8PACK_RUNS[probe],
                "compiled": compiler_available(x.device), "scale_after": True}
        seconds = {k: time_kernel(k, flat, qweight, scale) for k in AUTO_CANDIDATES if runs[k]}
        fastest = min(seconds, key=lambda k: seconds[k])   # the first of equals: candidate order
        label, in_f, out_f = key[2]
        AUTO_CHOICES[key] = choice = AutoChoice(str(x.device), x.dtype, label, in_f, out_f,
                                                fastest, seconds)
        print(choice, flush=True)
    return AUTO_CHOICES[key].kernel


def auto_choices(device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> list[AutoChoice]:
    """Every choice ``auto`` made on CUDA so far (on ``device``, for ``dtype``), in order.
    A device without an index ("cuda") stands for all of its type's."""
    def on(c: AutoChoice) -> bool:
        if device is None:
            return True
        d = torch.device(device)
        return c.device == str(d) or (d.index is None and c.device.split(":")[0] == d.type)
    return [c for c in AUTO_CHOICES.values() if on(c) and (dtype is None or c.dtype == dtype)]


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """int8 values (shape of ``x``) and fp32 scales (``x.shape[:-1]``): one scale per row
    along the last dimension. ``|x - dequantize_rows(q, s)| <= s / 2`` element-wise."""
    if not x.is_floating_point():
        raise TypeError(f"quantize_rows expects a float tensor, got {x.dtype}")
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(x / scale[..., None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` row by row, in ``dtype``."""
    return (q.float() * scale[..., None]).to(dtype)


def quantize_per_tensor(x: Tensor) -> tuple[Tensor, Tensor]:
    """One scale for the whole tensor (the coarser scheme, for comparison)."""
    q, scale = quantize_rows(x.reshape(1, -1))
    return q.reshape(x.shape), scale.reshape(())


def quantize_groups(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """int8 values (shape of ``x``) and fp32 scales (``x.shape[:-1] + (groups,)``): one scale
    per ``group_size`` consecutive entries of the last dimension, each group quantized as
    :func:`quantize_rows` quantizes a row. llama.cpp's q8_0 keeps one per 32 weights: an
    outlier then coarsens the step of its 31 neighbours, not of its whole row."""
    if group_size < 1 or x.shape[-1] % group_size:
        raise ValueError(f"group_size {group_size} must divide the last dimension "
                         f"({x.shape[-1]}): pick a divisor such as 32, 64 or 128")
    q, scale = quantize_rows(x.reshape(*x.shape[:-1], -1, group_size))
    return q.reshape(x.shape), scale


def dequantize_groups(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """:func:`dequantize_rows` for :func:`quantize_groups`' values (one scale per group);
    with one group per row it is :func:`dequantize_rows`."""
    grouped = q.reshape(*q.shape[:-1], scale.shape[-1], -1)
    return dequantize_rows(grouped, scale, dtype).reshape(q.shape)


def grouped_matvec(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    """``x @ W.T`` with ``W`` = :func:`dequantize_groups` ``(qweight, scale)``, written as one
    multiply-and-sum over (group, weight-in-group): what a compiled step uses for a few rows.
    Inductor fuses it into one reduction per output that loads int8, converts, multiplies by
    the input and the group's scale and accumulates, so a step reads 1 byte a weight (plus a
    4-byte scale per group) and never writes a float copy. Eagerly it materialises the
    products: :class:`Int8Linear` uses it only inside a compile. One scale per row (``scale``
    of shape (out,)) is one group per row.

    Two things the reduction is kept from, each of which, measured on the scale model's int8
    decode step, made it much slower (``bench quant`` and ``bench llamacpp`` time the step):

    - **A cascade sum.** Inductor's C++ backend sums a float reduction of more than 4,096
      terms through a helper that adds each vector into a running sum held in a
      ``std::vector`` and counts the terms toward its next level (``CascadeSumHelper`` in
      ``torch/csrc/inductor/cpp_prefix.h``; ``chunk_size = 4096`` in ``codegen/cpp.py``): the
      2048 x 5504 down_proj read its int8 weights at 11 GB/s against 20-22 for the larger
      projections with 2048 inputs. A longer row is cut into :func:`reduction_pieces` of
      whole groups, added term by term (a sum over so few is unrolled), so one reduction
      covers at most :data:`REDUCTION_CHUNK` terms; it then reads at 19 GB/s (the step 10.0
      -> 7.2-7.7 ms).
    - **Recomputing the input.** Inductor inlines a pointwise producer into its consumers, so
      the RMSNorm (and residual add) before a projection ran again for every output row, inside
      the loop over the weights. :func:`realized` makes the input a buffer of its own first
      (-> 5.3-6.4 ms)."""
    out_features, in_features = qweight.shape
    x = realized(x)
    scale = scale.reshape(out_features, -1)
    groups = scale.shape[-1]
    pieces = reduction_pieces(in_features, groups)
    per = groups // pieces
    xg = x.reshape(-1, pieces, per, in_features // groups).permute(1, 0, 2, 3)[:, None]
    wg = qweight.reshape(out_features, pieces, per, -1).permute(1, 0, 2, 3)[:, :, None]
    sg = scale.to(x.dtype).reshape(out_features, pieces, per).permute(1, 0, 2)[:, :, None, :, None]
    # The pieces are added first, term by term, so the sum over (group, weight) is one
    # reduction per output. (out, rows), then transposed: inductor's loops follow the output's
    # dimensions, so with the outputs outermost each weight row is loaded once and reused from
    # L1 for every input row; (rows, out) would stream the whole matrix once per row (both
    # seen in the code inductor generates for 4 rows).
    out = (xg * wg * sg).sum(0).sum((-2, -1))
    return out.T.reshape(*x.shape[:-1], out_features)


#: The most terms :func:`grouped_matvec` sums in one reduction: inductor's C++ backend's limit
#: before it switches to a cascade sum (see there).
REDUCTION_CHUNK = 4096
#: The most pieces a row is cut into: inductor turns a sum over this many or fewer terms into
#: adds (``config.unroll_reductions_threshold``), so the pieces join the one reduction.
UNROLLED_PIECES = 8


def reduction_pieces(in_features: int, groups: int) -> int:
    """How many pieces of whole groups a row of ``in_features`` weights in ``groups`` groups is
    summed in: the fewest that divide ``groups`` and hold at most :data:`REDUCTION_CHUNK`
    weights each, and at most inductor's ``unroll_reductions_threshold`` (8), so that their sum
    is unrolled into the reduction; 1 (a cascade sum) where no such count exists."""
    need = -(-in_features // REDUCTION_CHUNK)
    return next((p for p in range(need, min(groups, UNROLLED_PIECES) + 1) if groups % p == 0), 1)


def realized(x: Tensor) -> Tensor:
    """``x``, made a buffer of its own inside a compile: inductor's stride-order primitive
    (``torch/_inductor/inductor_prims.py``, lowered through ``ExternKernel.require_strides``)
    with ``x``'s own strides. An ``x`` already in a buffer comes back as it is; an unrealized
    one is written once into a buffer of its own (a copy its producer fuses into). We found no
    public inductor hint for this. Where a torch lacks the primitive, or outside a compile:
    ``x`` itself (the same numbers, the producer inlined as before)."""
    if not torch.compiler.is_compiling():
        return x
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return x if force is None else force(x, x.stride())


class Int8Linear(nn.Module):
    """A bias-free linear layer whose weight (out, in) is int8 with one scale per output, or
    with ``scale`` of shape (out, groups) one per group of ``in / groups`` weights
    (:func:`quantize_groups`; kernels :data:`GROUP_KERNELS`)."""

    def __init__(self, qweight: Tensor, scale: Tensor, kernel: str = "auto") -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of: {', '.join(KERNELS)}")
        if scale.dim() == 2 and kernel not in GROUP_KERNELS:
            raise ValueError(f"kernel {kernel!r} takes one scale per output row; a scale per "
                             f"group of weights runs on {', '.join(GROUP_KERNELS)}")
        if kernel == "fbgemm":
            fbgemm_engine()  # fail here, not at the first forward, where the engine is missing
        self.register_buffer("qweight", qweight)  # (out, in) int8
        self.register_buffer("scale", scale)      # (out,) or (out, groups) fp32
        self.kernel = kernel
        self.out_features, self.in_features = qweight.shape
        self._packed: tuple[tuple[int, ...], torch.ScriptObject] | None = None  # fbgemm only

    def _fbgemm_weight(self) -> torch.ScriptObject:
        """The packed weight, built on first use and rebuilt only if ``qweight`` or ``scale``
        are replaced or written in place (keyed on their storage and version counter)."""
        key = (self.qweight.data_ptr(), self.qweight._version,
               self.scale.data_ptr(), self.scale._version)
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, fbgemm_prepack(self.qweight, self.scale))
        return self._packed[1]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        return {**state, "_packed": None}  # a cache: copies and pickles repack on first use

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: str = "auto",
                    group_size: int | None = None) -> "Int8Linear":
        """``linear``'s weight quantized per output row, or per ``group_size`` weights."""
        if linear.bias is not None:
            raise ValueError("Int8Linear covers the model's bias-free projections only")
        weight = linear.weight.detach()
        q, s = quantize_rows(weight) if group_size is None else quantize_groups(weight, group_size)
        return cls(q, s, kernel)

    @property
    def group_size(self) -> int:
        """Weights per scale along the input: ``in_features`` for one scale per row."""
        return self.in_features // self.scale.shape[-1] if self.scale.dim() == 2 \
            else self.in_features

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        if self.scale.dim() == 2:
            return dequantize_groups(self.qweight, self.scale, dtype)
        return dequantize_rows(self.qweight, self.scale, dtype)

    def kernel_for(self, x: Tensor) -> str:
        """The kernel that multiplies ``x``: ``auto`` is ``scale_after`` off CUDA and
        :func:`auto_kernel`'s timed choice on CUDA (where a model being compiled gets the
        plain ``scale_after`` expression, which the compiler fuses)."""
        if self.kernel != "auto":
            return self.kernel
        if self.scale.dim() == 2:
            return "grouped"
        if x.device.type != "cuda" or torch.compiler.is_compiling():
            return "scale_after"
        return auto_kernel(x, self.qweight, self.scale)

    def forward(self, x: Tensor) -> Tensor:
        kernel = self.kernel_for(x)
        if kernel == "grouped" and torch.compiler.is_compiling() and \
                x.numel() // self.in_features <= FUSED_ROWS:
            return grouped_matvec(x, self.qweight, self.scale)
        if kernel in ("reference", "grouped"):
            return F.linear(x, self.dequantized_weight(x.dtype))
        if kernel == "scale_after":
            return scale_after(x, self.qweight, self.scale)
        if kernel == "compiled":
            return compiled_scale_after(x, self.qweight, self.scale)
        dtype = x.dtype
        if x.device.type != "cpu" and not (kernel == "int8pack" and x.device.type == "cuda"):
            raise RuntimeError(f"the {kernel} kernel is a PyTorch CPU kernel; use kernel="
                               "'auto' or 'scale_after' on other devices")
        if kernel == "int8pack" and x.device.type == "cuda" and \
                cuda_kernel(x.device, x.dtype) != "int8pack":
            raise RuntimeError(f"this torch build has no CUDA kernel for "
                               f"aten._weight_int8pack_mm ({x.dtype}); use kernel='auto' or "
                               f"'compiled' on CUDA")
        if kernel == "fbgemm":
            # W8A8 dynamic: the activations are quantized here too (see the module docstring).
            # The kernel takes one scale for the whole input; dividing each row (token) by its
            # largest |x| first, and multiplying its output back (exact: the layer is linear),
            # ties each token's step to its own range (within 2x), as in batch-1 decode.
            x = x.float()
            amax = x.abs().amax(-1, keepdim=True)
            r = torch.where(amax > 0, amax, torch.ones_like(amax))
            out = torch.ops.quantized.linear_dynamic(x / r, self._fbgemm_weight(), True)
            return (out * r).to(dtype)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale.to(x.dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        groups = f", a scale per {self.group_size}" if self.scale.dim() == 2 else ""
        return (f"in={self.in_features}, out={self.out_features}, int8{groups}, "
                f"kernel={self.kernel}")


class Int8Embedding(nn.Module):
    """Token lookup from an int8 (vocab, hidden) table with one scale per token row, or per
    group of each row (scale (vocab, groups))."""

    def __init__(self, qweight: Tensor, scale: Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.out_dtype = dtype

    def forward(self, ids: Tensor) -> Tensor:
        if self.scale.dim() == 2:   # a scale per group of each row (quantize_groups)
            return dequantize_groups(self.qweight[ids], self.scale[ids], self.out_dtype)
        return (self.qweight[ids].to(self.out_dtype) * self.scale[ids, None].to(self.out_dtype))


class QuantizedTinyLlama(TinyLlama):
    """The same model with int8 projections. Only ``device`` and ``dtype`` change: the base
    class reads them off the embedding's float weight, which an int8 model no longer has, so
    they come from the final norm's gain (always float, in the activations' dtype)."""

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype


def quantize_model(model: TinyLlama, *, kernel: str = "auto", embeddings: bool = True,
                   group_size: int | None = None) -> QuantizedTinyLlama:
    """A new model whose linear layers hold int8 weights; ``model`` is left untouched.

    ``kernel`` picks how every int8 linear layer, the tied LM head included, multiplies (see
    ``KERNEL_NOTES``): ``quantize_model(model, kernel="fbgemm")`` is the fast CPU path (W8A8
    dynamic); ``auto`` (the default) is ``scale_after`` on a CPU and, on CUDA, the fastest
    of ``int8pack`` (where the build has one), ``compiled`` and ``scale_after``, timed at
    the first step of each shape class on each device (:func:`auto_choices` lists them).

    Norm gains stay in float (a few hundred numbers). The tied embedding / LM head is
    quantized once, per token row, and shared (see the module docstring); with
    ``embeddings=False`` it stays in float.

    ``group_size`` (e.g. 32, llama.cpp's q8_0 block) gives every weight matrix, the tied one
    included, a scale per ``group_size`` weights along its input (:func:`quantize_groups`)
    instead of one per row; such a model runs on the ``grouped`` kernel (``auto`` picks it).
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of: {', '.join(KERNELS)}")
    if group_size is not None and kernel not in GROUP_KERNELS:
        raise ValueError(f"group_size={group_size} runs on the kernels {', '.join(GROUP_KERNELS)}, "
                         f"not {kernel!r} (written for one scale per row)")
    if isinstance(model, QuantizedTinyLlama):
        raise ValueError("the model is already quantized; quantize the float model instead")
    cfg: ModelConfig = model.config
    new = QuantizedTinyLlama(cfg).to(device=model.device, dtype=model.dtype)
    new.load_state_dict(model.state_dict())  # a copy: the original's tensors are not shared
    new.eval()
    for layer in new.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(parent, name, Int8Linear.from_linear(getattr(parent, name), kernel,
                                                             group_size))
    if embeddings:
        table = new.model.embed_tokens.weight.detach()
        q, s = quantize_rows(table) if group_size is None else quantize_groups(table, group_size)
        new.model.embed_tokens = Int8Embedding(q, s, model.dtype)
        if cfg.tie_word_embeddings:
            new.lm_head = Int8Linear(q, s, kernel)  # the very same int8 tensors: still tied
        else:
            new.lm_head = Int8Linear.from_linear(new.lm_head, kernel, group_size)
    return new


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of distinct storages: a tensor shared twice (the tied matrix) counts once."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        key = (str(t.device), t.untyped_storage().data_ptr())
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
    return sum(seen.values())


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers occupy (each storage once)."""
    return tensor_bytes([*model.parameters(), *model.buffers()])


class Int8KVCache(KVCache):
    """:class:`~tinyserve.kv_cache.KVCache` with int8 slots and per-token, per-KV-head scales.

    Same slots, lengths, ``rewind`` and errors as the float cache (the bookkeeping is
    inherited); only what a slot holds differs. ``dtype`` is the dtype attention receives.
    Cost per token per layer: ``2 x kv_heads x (head_dim + 4)`` bytes against
    ``2 x kv_heads x head_dim x 4`` in fp32, so 128 / 36 = 3.6x smaller at head_dim 32.
    """

    def __init__(self, config: ModelConfig, batch_size: int = 1, max_seq: int | None = None,
                 *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, batch_size, max_seq, device=device, dtype=torch.int8)
        self.dtype = dtype
        scales = self.k.shape[:-1]  # (layers, batch, kv_heads, max_seq)
        self.k_scale = torch.ones(scales, device=device, dtype=torch.float32)
        self.v_scale = torch.ones(scales, device=device, dtype=torch.float32)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def _store(self, values: Tensor, scales: Tensor, layer: int, q: Tensor, s: Tensor) -> None:
        if isinstance(self._write, slice):
            values[layer, :, :, self._write] = q
            scales[layer, :, :, self._write] = s
        else:
            rows, slots = self._write
            values[layer][rows, :, slots] = q.transpose(1, 2)   # (B, T, kv_heads, head_dim)
            scales[layer][rows, :, slots] = s.transpose(1, 2)   # (B, T, kv_heads)

    def update(self, layer: int, k: Tensor, v: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if k.shape[0] != self.batch_size:
            raise ValueError(f"the cache holds {self.batch_size} sequences, got a batch of "
                             f"{k.shape[0]}")
        if layer == 0:
            self._advance(positions)
        self._store(self.k, self.k_scale, layer, *quantize_rows(k))
        self._store(self.v, self.v_scale, layer, *quantize_rows(v))
        n = self._n_visible
        # Attention reads every cached slot each step, so each step dequantizes them all:
        # the overhead that can eat the bandwidth saved when the matmuls are not fused.
        keys = dequantize_rows(self.k[layer, :, :, :n], self.k_scale[layer, :, :, :n], self.dtype)
        values = dequantize_rows(self.v[layer, :, :, :n], self.v_scale[layer, :, :, :n], self.dtype)
        return keys, values, self._k_positions

    def __repr__(self) -> str:
        return (f"Int8KVCache(batch_size={self.batch_size}, max_seq={self.max_seq}, "
                f"lengths={self.lengths}, nbytes={self.nbytes:,})")


# ---------------------------------------------------------------------- measuring quality

def validation_windows(n_windows: int, seq_len: int = 512) -> Tensor:
    """The first ``n_windows`` held-out windows the model card's validation loss uses
    (same corpus seed, tokenizer and windowing as ``train.py``), as (n, seq_len + 1) ids."""
    from .corpus import build_corpus
    from .train import TRAIN_PRESETS, eval_windows, token_stream
    _, val_texts = build_corpus(seed=TRAIN_PRESETS["target"].seed)
    stream, used = [], 0
    for text in val_texts:  # tokenize only as many documents as the windows need
        stream.append(token_stream([text]))
        used += len(stream[-1])
        if used > n_windows * seq_len:
            break
    return eval_windows(torch.cat(stream), seq_len, n_windows * seq_len)


@torch.no_grad()
def quality(reference: TinyLlama, candidate: TinyLlama, windows: Tensor,
            cache_cls: type[KVCache] | None = None) -> dict[str, float]:
    """How far ``candidate`` (run with a ``cache_cls`` cache when given) strays from
    ``reference`` (no cache) on held-out windows, teacher-forced.

    ``max_abs_logit_error`` and ``rel_rms_logit_error`` compare logits position by position;
    ``greedy_agreement`` is the fraction of positions with the same argmax next token;
    ``val_loss_delta`` is the relative change of the mean cross-entropy (0.004 = +0.4%).
    """
    reference.eval(), candidate.eval()
    windows = windows.to(reference.device)
    ids, targets = windows[:, :-1], windows[:, 1:]
    want = reference(ids)
    if cache_cls is None:
        got = candidate(ids)
    else:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        got = candidate(ids, positions, cache_cls.for_model(candidate, len(ids), ids.shape[1]))
    loss = [F.cross_entropy(x.flatten(0, 1), targets.flatten()).item() for x in (want, got)]
    diff = (got - want).float()
    return {"max_abs_logit_error": diff.abs().max().item(),
            "rel_rms_logit_error": (diff.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item(),
            "greedy_agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "val_loss": loss[1], "reference_val_loss": loss[0],
            "val_loss_delta": (loss[1] - loss[0]) / loss[0], "tokens": targets.numel()}
