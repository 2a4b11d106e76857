"""A tiny Llama: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, tied embeddings.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.
self_attn.q_proj`` ...), so exporting is a rename-free copy of the state dict.

The forward pass takes token ids *and their positions*. Positions drive two things: the
rotary angle of each query and key, and the causal mask (a query at position p may attend to
keys at positions <= p). Passing them explicitly is what lets a KV cache be threaded through
later: cached keys keep the positions they were written at, and a decode step supplies just
one new position.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig


class KVStore(Protocol):
    """What attention needs from a KV cache (implemented by the cache modules).

    ``update`` stores this step's keys and values for layer ``layer`` and returns every key
    and value the new queries may look at, with the position of each key. A key position
    below zero marks an empty or padded slot that no query may attend to. ``None`` in place
    of the key positions says every returned key is visible to every query (a decode step
    in which each row appended one token at the same position): no mask to build or apply.
    """

    def update(self, layer: int, k: Tensor, v: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor, Tensor | None]: ...


class AttentionBackend(Protocol):
    """A cache that does attention itself (the paged cache of :mod:`tinyserve.paged`).

    ``attend`` stores this step's keys and values and returns the attention output for the
    step's queries. It is how one forward pass serves a flat list of tokens from several
    sequences: only the backend knows which tokens belong together.
    """

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned gain (no mean, no bias)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 whatever the model dtype: the mean of squares underflows in bf16.
        # F.rms_norm is x * rsqrt(mean(x^2) + eps). torch 2.13 sends it to _fused_rms_norm,
        # which has kernels for CUDA, MPS and XPU (native_functions.yaml; not run on a GPU
        # here); a CPU gets the composite, its parts one by one (pow, mean, add, rsqrt, mul:
        # about twenty dispatcher calls in the profiler), no cheaper than writing them out.
        if x.dtype == torch.float32 or (x.is_cuda and x.dtype == self.weight.dtype):
            # fp32: no casts, the gain applied inside. CUDA, bf16/fp16: ONE kernel instead of
            # four (cast, norm, cast, multiply). _fused_rms_norm_cuda (aten/src/ATen/native/
            # cuda/layer_norm_kernel.cu) runs layer norm's kernels with rms_norm=true: they
            # read the bf16 input, sum its squares in acc_type<T, true> (float), and compute
            # gain * (rstd * x) in float, rounding once on the store. Input and gain must share
            # a dtype, or rms_norm falls back to the composite with a warning (layer_norm.cpp).
            # One rounding where the path below has two: equal within one bf16 step.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, shape (B, 1, T, head_dim) (the 1 broadcasts over
    heads).

    Pair i of each head rotates by ``position * theta^(-2i/head_dim)``: low pairs spin fast,
    high pairs slowly. Halves are laid out as in Hugging Face ([x_0..x_{d/2}) paired with
    [x_{d/2}..x_d)), which keeps weights interchangeable with ``transformers``.

    The sin's first half is negated here, once per forward pass, so that rotating a vector
    needs no negation per layer: see :func:`apply_rope`.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None, :, None] * inv_freq   # (B, 1, T, head_dim/2)
    sin = angles.sin()
    return (torch.cat([angles, angles], dim=-1).cos().to(dtype),
            torch.cat([-sin, sin], dim=-1).to(dtype))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate queries or keys (B, heads, T, head_dim) by their positions' angles.

    Each pair (x_i, x_{i+d/2}) becomes (x_i cos - x_{i+d/2} sin, x_{i+d/2} cos + x_i sin).
    ``roll`` swaps the halves and ``sin`` arrives with its first half negated, so this is
    Hugging Face's ``x * cos + rotate_half(x) * sin`` in four operations instead of seven.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def apply_rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`apply_rope` on queries (B, heads, T, d) and keys (B, kv_heads, T, d) in one pass.

    Both rotate by the same angles, so they are rotated as one (B, heads + kv_heads, T, d)
    tensor: cat, the four rotary operations, split (six operator calls, five kernels) instead
    of eight of each, and the same numbers element by element (tested against two calls).
    Under ``torch.compile`` the two are rotated apart: the compiler fuses each rotation
    into one kernel anyway, and the cat costs it a copy that made the compiled CPU decode
    step of the target slower (``bench decode`` times that step).
    """
    if torch.compiler.is_compiling():
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)
    return qk.split([q.shape[1], k.shape[1]], dim=1)


def causal_mask(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """Boolean mask (B, 1, Tq, Tk): True where a query may attend to a key.

    A key is visible when it is not empty (position >= 0) and not in the query's future.
    Written from positions, not a fixed triangle, so the same rule covers a full prompt,
    a cached decode step and (later) padded batches.
    """
    visible = (k_positions[:, None, :] <= q_positions[:, :, None]) & (k_positions[:, None, :] >= 0)
    return visible[:, None]


def grouped_mask(mask: Tensor, n_rep: int) -> Tensor:
    """A (B, 1, T, Tk) mask for grouped query rows (B, 1, n_rep * T, Tk): each of the n_rep
    query heads sharing a KV head brings its own copy of the T query rows."""
    B, _, T, Tk = mask.shape
    return mask[:, :, None].expand(B, 1, n_rep, T, Tk).reshape(B, 1, n_rep * T, Tk)


def fused_linear(x: Tensor, owner: nn.Module, linears: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
    """``x`` through one or several linear layers that read the same input (q, k, v; gate,
    up; the LM head alone).

    At inference (no autograd) this is ONE matmul against the layers' weights stacked once
    and kept on ``owner``: one kernel instead of three, which matters when a decode step is a
    few hundred small kernels. The parameters stay separate, so state dicts and the Hugging
    Face export keep their names. The stacked copy is rebuilt when any weight is replaced or
    changed in place (its data pointer or version counter moves); layers that are not plain
    ``nn.Linear`` (int8) run one by one.

    The copy is stored transposed, (in, out), when the output is wider than the input: a
    one-row matmul then streams rows of ``out`` numbers, and long rows stream faster than
    short ones from memory (timed on one thread with the weights out of cache, the LM head
    and gate/up read markedly faster transposed). Narrow outputs (o_proj, down_proj) keep
    (out, in), faster for them. ``bench scale`` measures the batch-1 step this serves
    against the machine's read bandwidth (``scale_decode_mbu_b1``).

    While ``torch.compile`` traces (the compiled decode step), the copy made by an eager call
    is used as it is: the step's caller runs prefill eagerly first, which refreshes it.
    """
    if torch.is_grad_enabled() or not all(type(lin) is nn.Linear for lin in linears):
        return tuple(lin(x) for lin in linears)
    cached = owner.__dict__.get("_fused_weight")
    if torch.compiler.is_compiling():
        if cached is None:
            return tuple(lin(x) for lin in linears)
    else:
        weights = [lin.weight for lin in linears]
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in weights)
        if cached is None or cached[0] != key:
            cached = _stack_weights(key, weights)
            owner.__dict__["_fused_weight"] = cached
    _, weight, sizes, transposed = cached
    out = x @ weight if transposed else F.linear(x, weight)
    return out.split(sizes, dim=-1) if len(sizes) > 1 else (out,)


def _stack_weights(key: tuple, weights: list[Tensor]) -> tuple:
    """The stacked copy of ``weights`` (see :func:`fused_linear`) with its cache key."""
    sizes = [w.shape[0] for w in weights]
    transposed = sum(sizes) > weights[0].shape[1]
    # A plain tensor, usable outside inference mode; no_grad because leaving inference
    # mode turns autograd back on, and a copy that requires grad cannot cross to another
    # process (the parallel chapter sends the model to its ranks).
    with torch.inference_mode(False), torch.no_grad():
        stacked = torch.cat(weights)
        weight = stacked.t().contiguous() if transposed else stacked
    return key, weight, sizes, transposed


class Attention(nn.Module):
    """Grouped-query attention: ``num_attention_heads`` query heads share
    ``num_key_value_heads`` KV heads, so the cache stores n_rep times fewer keys/values."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = (cfg.num_attention_heads,
                                                  cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                cache: KVStore | AttentionBackend | None = None, contiguous: bool = False,
                masks: dict[str, Tensor] | None = None) -> Tensor:
        """``masks``, when given, is shared by every layer of one forward pass: the first
        layer stores the attention mask there and the others reuse it (every layer sees the
        same positions, so building it again would only cost time)."""
        B, T, _ = x.shape
        q, k, v = fused_linear(x, self, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope_qk(q, k, cos, sin)                    # (B, heads, T, head_dim)
        if hasattr(cache, "attend"):
            out = cache.attend(self.layer, q, k, v)             # type: ignore[union-attr]
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

        if cache is None:
            k_positions = positions
        else:  # the cache stores rotated keys, so they are never rotated twice
            k, v, k_positions = cache.update(self.layer, k, v, positions)

        # Each KV head serves n_rep consecutive query heads (the layout HF's repeat_kv uses).
        n_rep = self.n_heads // self.n_kv
        if cache is None and contiguous:
            # Same rule as causal_mask for positions 0..T-1, but lets SDPA pick a fused kernel.
            k = k.repeat_interleave(n_rep, dim=1)             # (B, heads, Tk, head_dim)
            v = v.repeat_interleave(n_rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

        mask = masks.get("grouped") if masks is not None else None
        if mask is None and k_positions is not None:  # None: the cache says all visible
            mask = grouped_mask(causal_mask(positions, k_positions), n_rep)
            if masks is not None:
                masks["grouped"] = mask
        # Grouped-query attention without copying keys: the n_rep query heads that share a
        # KV head become n_rep * T query rows of that one head. (B, kv, n_rep * T, head_dim)
        q = q.reshape(B, self.n_kv, n_rep * T, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # Back to (B, T, heads * head_dim) without assuming SDPA's output strides: CUDA's
        # memory-efficient kernel returns a (B, rows, kv, head_dim) buffer seen transposed,
        # where .view(B, heads, T, head_dim) fails. Splitting one dim is a view in any
        # layout; the reshape copies once. (tests/test_sdpa_layout.py imposes that layout.)
        out = out.unflatten(2, (n_rep, T))                    # (B, kv, n_rep, T, head_dim)
        return self.o_proj(out.permute(0, 3, 1, 2, 4).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = fused_linear(x, self, (self.gate_proj, self.up_proj))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor,
                cache: KVStore | AttentionBackend | None = None,
                contiguous: bool = False, masks: dict[str, Tensor] | None = None,
                keep: Tensor | None = None) -> Tensor:
        """``keep`` (indices into T): only those positions go on past attention. Attention
        still runs for every position (each one's keys and values go into the cache), but the
        MLP, row by row, serves only the rows kept (see :meth:`TinyLlama.forward`)."""
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, cache, contiguous,
                               masks)
        if keep is not None:
            x = x[:, keep]
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack without the LM head (``model.`` in Hugging Face's names)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyLlama(nn.Module):
    """Token ids and positions in, next-token logits out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            # One matrix reads tokens in and scores them out: saves vocab x hidden parameters.
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def num_parameters(self) -> int:
        """Unique parameters (the tied embedding counts once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`rope_cos_sin` for ``positions`` (B, T).

        At inference the rows come from a table of every position in the context window,
        computed once by that same function: a decode step then looks up two rows instead
        of running a dozen small operations (what serving engines do with their
        "cos/sin cache"). Training and ``torch.compile`` tracing compute them directly."""
        cfg = self.config
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        key = (positions.device, self.dtype)
        table = self.__dict__.get("_rope_table")
        if table is None or table[0] != key:
            with torch.inference_mode(False):  # a plain tensor, usable outside inference mode
                every = torch.arange(cfg.max_position_embeddings, device=positions.device)
                cos, sin = rope_cos_sin(every[None], cfg.head_dim, cfg.rope_theta, self.dtype)
            table = (key, cos[0, 0], sin[0, 0])               # (window, head_dim) each
            self.__dict__["_rope_table"] = table
        return table[1][positions][:, None], table[2][positions][:, None]

    def _outside_window(self, position: int) -> str:
        limit = self.config.max_position_embeddings
        return (f"position {position} is outside the context window of {limit} tokens; "
                f"shorten the prompt or lower max_tokens so prompt + output <= {limit}.")

    def forward(self, input_ids: Tensor, positions: Tensor | None = None,
                cache: KVStore | AttentionBackend | None = None,
                logits_at: Tensor | None = None) -> Tensor:
        """``input_ids`` (B, T) -> logits (B, T, vocab), float32.

        ``logits_at`` (indices into T) keeps only those positions' logits, (B, len, vocab):
        a serving step samples from one position per sequence, and scoring the whole
        vocabulary at every prompt position would cost more than the rest of the model. The
        last layer's MLP then serves only those positions too (``DecoderLayer``'s ``keep``).

        ``positions`` (B, T) or (T,) defaults to 0..T-1, or, with a cache that keeps its
        lengths on the host (``step_positions``: the contiguous and the paged cache), to the
        positions the cache says come next. Positions must lie inside the context window;
        the error says so rather than failing deep inside attention.

        Where the positions come from decides whether the step waits on the device: the
        defaults are known on the host, so they are checked there; explicit positions are a
        tensor whose largest value must be read back (on a GPU, a synchronisation per step).
        """
        B, T = input_ids.shape
        contiguous = positions is None and cache is None  # 0..T-1: the plain causal triangle
        limit = self.config.max_position_embeddings
        if positions is None and hasattr(cache, "step_positions"):
            positions = cache.step_positions(B, T)   # type: ignore[union-attr]  # checks the window
        elif positions is None:
            if T > limit:
                raise ValueError(self._outside_window(T - 1))
            positions = torch.arange(T, device=input_ids.device)
        # Explicit positions: the check reads a value back from the device; a compiled step
        # (static shapes, positions checked by its caller) must not, so it skips it while
        # tracing.
        elif T and not torch.compiler.is_compiling() and int(positions.max()) >= limit:
            raise ValueError(self._outside_window(int(positions.max())))
        if positions.dim() == 1:
            positions = positions.expand(B, T)
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(input_ids)
        masks: dict[str, Tensor] = {}   # the attention mask, built by layer 0, read by all
        *body, last = self.model.layers
        for layer in body:
            x = layer(x, positions, cos, sin, cache, contiguous, masks)
        # The last layer's MLP runs only for the positions whose logits are asked for: nothing
        # after it reads the others (their keys and values are cached by its attention). For a
        # prompt that saves the MLP's share of the last layer's matmul FLOPs (about three
        # quarters in the course's models); llama.cpp's graphs do the same
        # (ggml_get_rows on inp_out_ids before the last layer's feed-forward).
        x = last(x, positions, cos, sin, cache, contiguous, masks, keep=logits_at)
        return fused_linear(self.model.norm(x), self, (self.lm_head,))[0].float()
