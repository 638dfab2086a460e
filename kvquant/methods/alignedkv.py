"""AlignedKV: fp16 K/V kept as bit planes; each decode step reads 8, 12 or 16 bits per element.

Nothing is removed from storage: the saving is in what attention loads. The layer stores planes
(``kvquant.alignment.PlaneStore``); on a decode step ``update`` hands attention a placeholder key
that carries the layer, and ``kvquant.attention`` calls ``attend``, which applies the rules
(``key_widths``/``value_widths``), reads K and V at those widths and runs transformers' SDPA on
what was read. Prefill attends in full precision, as in the paper, unless ``prefill_aligned``.

Any layout whose attention goes through transformers' ``AttentionInterface`` (Llama, Mistral,
Qwen2/3, Phi-3, Gemma-2/3): what was read goes to ``kvquant.attention.stock_attention`` with the
model's ``scaling`` and ``softcap``, and the width rule's scores soft-cap the logits the same way.
A sliding-window layer hands attention only its window, as transformers' sliding layers do, and
drops every 64-token block that has fallen wholly out of it (up to 63 older tokens stay held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvquant.alignment import (
    BLOCK,
    PlaneStore,
    accumulation_margin,
    block_key_widths,
    block_widths,
    check_thresholds,
    exponent_gaps,
    high_byte_values,
    key_widths,
    value_widths,
)
from kvquant.attention import NAME as KVQUANT_ATTENTION
from kvquant.attention import causal_allowed, kernel_backend, route_attention, stock_attention, tagged_placeholder
from kvquant.backends import check_backend, get_backend, select_backend
from kvquant.cache import KVCache, KVGeometry, KVLayer, to_fp16_checked
from kvquant.errors import InvalidParameterError
from kvquant.methods.base import KVMethod, register_method

WIDTHS = (8, 12, 16)
V8_MAGNITUDES = high_byte_values(torch.arange(256, dtype=torch.uint8))
"""``|v8|`` of every plane-A byte: the value rule's table for ``kernels_cpu.attend_aligned``."""
FUSED_SCORE_BYTES = 1 << 28
"""Most bytes of fp64 scores (query rows of every head × tokens × 8) ``attend_aligned`` may hold at once;
a step needing more takes the torch rule (its threads hold one KV head's rows each, so this bounds them)."""


def _scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    attention_mask,
    scaling: float,
    softcap: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention probabilities ``[b, q_heads, q_len, L]`` in ``dtype`` of ``query`` over ``keys``:
    logits scaled, soft-capped (``tanh(x/softcap)·softcap``, Gemma-2), then the mask applied.

    The width rules take them in fp64: a product of an fp32 query element and an fp16 key is exact
    there and a sum of ``head_dim`` of them is off by ~1e-16, so a width moves only when a score lies
    that close to a power of two — any BLAS order, thread count or kernel (``kernels_cpu``'s rule)
    decides the same widths, where fp32 sums in different orders would move one now and then."""
    b, hq, q_len, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    grouped = query.to(dtype).reshape(b, hkv, (hq // hkv) * q_len, d)  # GQA without copying K
    logits = (torch.matmul(grouped, keys.to(dtype).transpose(-1, -2)) * scaling).view(b, hq, q_len, n)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., :n]
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    elif q_len > 1:  # no mask on a multi-token step is plain causal: the rules see no later key either
        logits = logits.masked_fill(~causal_allowed(q_len, n, logits.device), float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


class AlignedLayer(KVLayer):
    """One layer's planes plus the per-step width decisions and their statistics."""

    is_croppable = False

    def __init__(
        self,
        layer_idx: int,
        method: AlignedKVMethod,
        n_kv_heads: int,
        backend: str = "torch",
        window: int | None = None,
    ):
        super().__init__(layer_idx, window)
        if backend == "cpu" and window is not None:
            raise InvalidParameterError(f"layer {layer_idx}: the cpu plane kernel has no sliding window ({window})")
        self.method, self.backend = method, backend
        self.visible = 0  # the newest tokens of the store this step's attention sees
        self.store = self.new_store()
        self.kernels = backend == "cupy"
        self.head_widths_k = torch.zeros(n_kv_heads, len(WIDTHS), dtype=torch.int64)
        self.head_widths_v = torch.zeros(n_kv_heads, len(WIDTHS), dtype=torch.int64)
        self.capture_products = False
        self.products: dict[str, torch.Tensor] | None = None
        self._pending: list[tuple[int, int, torch.Tensor, torch.Tensor, int]] = []
        self._dtype = torch.float16

    def new_store(self) -> PlaneStore:
        """Planes in the layout every backend reads; the CuPy backend's store packs with its kernel."""
        if self.backend == "cupy":
            return get_backend("cupy").ops.plane_store("cupy", self.method.blockwise)
        return PlaneStore(block_exponents=self.method.blockwise)

    def map_tensors(self, fn) -> None:
        self.store.map_tensors(fn)

    def stored_k(self) -> list[torch.Tensor | None]:
        return self.store.tensors_k()

    def stored_v(self) -> list[torch.Tensor | None]:
        return self.store.tensors_v()

    def logical_elements(self) -> tuple[int, int]:
        if self.store.tail_k is None:
            return 0, 0
        b, h, _, d = self.store.tail_k.shape
        n = b * h * self.store.n_tokens * d
        return n, n

    @property
    def first_visible(self) -> int:
        """Index, among the tokens the store holds, of the first one this step's attention sees."""
        return self.store.n_tokens - self.visible

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._dtype = key_states.dtype
        q_len = key_states.shape[2]
        self.visible, _ = self.get_mask_sizes(q_len)
        if self.window is not None and self.store.n_full:  # blocks no query from now on can see
            self.store.drop_blocks(max(0, self.seen - self.window + 1 - self.dropped) // BLOCK)
        self.store.append(
            to_fp16_checked(key_states, self.layer_idx, "key"), to_fp16_checked(value_states, self.layer_idx, "value")
        )
        self.seen += q_len
        if q_len == 1 or self.method.prefill_aligned:
            b, h, _, d = key_states.shape
            shape = (b, h, self.visible, d)
            return (
                tagged_placeholder(self, shape, key_states.dtype, key_states.device),
                tagged_placeholder(self, shape, value_states.dtype, value_states.device),
            )
        first = self.first_visible
        keys, values = self.store.read_keys(16)[:, :, first:], self.store.read_values(16)[:, :, first:]
        self.count_read({16: keys.numel()}, {16: values.numel()})
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    @property
    def dropped(self) -> int:
        """Tokens a sliding layer has dropped (whole blocks that fell out of its window)."""
        return self.seen - self.store.n_tokens

    def key_widths(self, query: torch.Tensor) -> torch.Tensor:
        """The key rule (integer exponent arithmetic): per column, or per (block, column) for AlignedKV+."""
        store, method = self.store, self.method
        k_thresholds = method.thresholds_for(method.k_thresholds, query.shape[-1])
        if method.blockwise and store.k_exp is not None:
            return block_key_widths(query, store.k_absmax, store.k_exp, k_thresholds)
        return key_widths(query, store.k_absmax, k_thresholds)

    def decide_widths(self, query: torch.Tensor, attention_mask, scaling: float, softcap: float | None = None):
        """The rules for this step: ``(keys, wk, wv)``, ``keys`` as read at ``wk`` (the value rule's
        scores come from them) and ``wv`` the widths of the block tokens attention sees, raised to the
        widest of each ``v_block`` (counted from the store's first token). The scores are fp64 (see
        ``_scores``). On the cpu backend a decode step uses ``kernels_cpu.attend_aligned`` instead; here,
        its fallback, ``kernels_cpu`` reads the keys and takes the per-token exponent gaps, bit for bit as
        the torch code does."""
        store, method, first = self.store, self.method, self.first_visible
        wk = self.key_widths(query)
        gaps = exponent_gaps
        if self.backend == "cpu":  # the same bits and integers as read_keys and exponent_gaps, in C++
            ops = get_backend("cpu").ops
            keys = ops.read_plane_keys(store.k_a, store.k_b, store.k_c, store.tail_k, k_widths=wk, tiny_k=store.tiny_k)
            keys, gaps = keys[:, :, first:].to(query.dtype), ops.exponent_gaps
        else:
            keys = store.read_keys(wk, query.dtype)[:, :, first:]
        scores = _scores(query, keys, attention_mask, scaling, softcap, torch.float64)
        v_thresholds = method.thresholds_for(method.v_thresholds, self.visible)
        wv_all = value_widths(scores, store.value_high_bytes()[:, :, first:], v_thresholds, method.topk, gaps)
        wv = block_widths(wv_all[:, :, : max(0, store.n_full - first)], method.v_block, first)
        return keys, wk, wv

    def aligned_read(self, query: torch.Tensor, attention_mask, scaling: float, softcap: float | None = None):
        """Decide widths for this step and read K and V at them; returns ``(keys, values, wk, wv)``,
        ``keys``/``values`` being what attention sees and ``wv`` the widths of its block tokens."""
        store, first = self.store, self.first_visible
        keys, wk, wv = self.decide_widths(query, attention_mask, scaling, softcap)
        unseen = wv.new_full((*wv.shape[:2], min(first, store.n_full)), 16)  # held, out of the window: not read
        values = store.read_values(torch.cat([unseen, wv], dim=2) if first else wv, query.dtype)[:, :, first:]
        if self.capture_products:
            self.products = self._products(query, keys, values, attention_mask, scaling, softcap)
        return keys, values, wk, wv

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """Attention for one step over what the rules read (called by ``kvquant.attention``)."""
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self.kernels and not self.capture_products and (query.shape[2] == 1 or attention_mask is not None):
            out, wk, wv = get_backend("cupy").ops.attend(self.method, self.store, query, attention_mask, scaling)
            self._record(wk, wv)
            return out, None
        if self.backend == "cpu" and not self.capture_products:
            return self._attend_cpu(query, attention_mask, scaling), None
        keys, values, wk, wv = self.aligned_read(query, attention_mask, scaling, kwargs.get("softcap"))
        self._record(wk, wv)
        return stock_attention(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)

    def _attend_cpu(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        """``kernels_cpu.attend_aligned``: the value rule on fp64 scores and the attention in one C++ call
        (the key widths are a few integer ops in torch). Where that call cannot stand in for the torch
        rule exactly — a bf16 query (the rule reads keys in the query's dtype), a sliding view, or
        scores too large to hold — the torch rule decides and ``attend_planes`` reads. A multi-token
        step without a mask (a prompt run whole) is causal: the kernel gets that mask spelled out."""
        store, method = self.store, self.method
        ops, n = get_backend("cpu").ops, store.n_tokens
        mask = attention_mask[..., :n] if attention_mask is not None else None
        q_rows = query.shape[1] * query.shape[2]
        fused = (
            query.dtype in (torch.float32, torch.float16)
            and self.first_visible == 0
            and 8 * q_rows * n <= FUSED_SCORE_BYTES
        )
        if not fused:
            _, wk, wv = self.decide_widths(query, attention_mask, scaling)
            self._record(wk, wv)
            out = ops.attend_planes(
                query,
                **ops.plane_tensors(store),
                k_widths=wk,
                v_widths=wv,
                mask=mask,
                scaling=scaling,
                causal=mask is None and query.shape[2] > 1,
            )
            return out.transpose(1, 2).contiguous()
        if mask is None and query.shape[2] > 1:  # the kernel's rule reads no causal limit: spell it out
            mask = causal_allowed(query.shape[2], n, query.device)
        wk = self.key_widths(query)
        out, wv = ops.attend_aligned(
            query,
            **ops.plane_tensors(store),
            k_widths=wk,
            v8=V8_MAGNITUDES,
            v_thresholds=method.thresholds_for(method.v_thresholds, self.visible),
            topk=method.topk,
            v_block=method.v_block,
            mask=mask,
            scaling=scaling,
        )
        self._record(wk, wv)
        return out.transpose(1, 2).contiguous()

    def _record(self, wk: torch.Tensor, wv: torch.Tensor) -> None:
        """Per-head width counts of the tokens this step's attention saw; folded into ``counts()``
        lazily (no sync per step)."""
        store, first = self.store, self.first_visible
        b, h, _, d = store.tail_k.shape
        heads = torch.arange(h, device=wk.device) * len(WIDTHS)
        k_index = (heads.view(1, h, *[1] * (wk.dim() - 2)) + (wk - 8) // 4).flatten()
        if wk.dim() == 4:  # per (block, channel): weighted by the block's tokens in the window
            start = torch.arange(wk.shape[2], device=wk.device) * BLOCK
            inside = (start + BLOCK - start.clamp_min(first)).clamp(0, BLOCK)
            weights = inside.double().view(1, 1, -1, 1).expand(wk.shape).flatten()
            per_head_k = torch.bincount(k_index, weights, minlength=h * len(WIDTHS)).round().long()
        else:  # per column: every block token in the window
            per_head_k = torch.bincount(k_index, minlength=h * len(WIDTHS)) * max(0, store.n_full - first)
        per_head_v = torch.bincount((heads.view(1, h, 1) + (wv - 8) // 4).flatten(), minlength=h * len(WIDTHS))
        per_head_k, per_head_v = per_head_k.view(h, -1).cpu(), (per_head_v.view(h, -1) * d).cpu()
        self.head_widths_k += per_head_k
        self.head_widths_v += per_head_v
        # metadata read each step: the per-channel max |K| (fp16), plus one exponent byte per block channel
        meta_k = 16 * b * h * d + (8 * store.k_exp.numel() if store.k_exp is not None else 0)
        tail = b * h * min(store.tail_k.shape[2], self.visible) * d
        self._pending.append((self.seen, tail, per_head_k.sum(0), per_head_v.sum(0), meta_k))

    def counts(self):
        for position, tail, k, v, meta_k in self._pending:
            read_k = {w: int(n) for w, n in zip(WIDTHS, k.tolist(), strict=True) if n}
            read_v = {w: int(n) for w, n in zip(WIDTHS, v.tolist(), strict=True) if n}
            if tail:
                read_k[16] = read_k.get(16, 0) + tail
                read_v[16] = read_v.get(16, 0) + tail
            self.count_read(read_k, read_v, position=position, meta_k=meta_k)
        self._pending.clear()
        return super().counts()

    def _products(self, query, keys, values, attention_mask, scaling, softcap=None) -> dict[str, torch.Tensor]:
        """``QKᵀ`` and ``SV`` from full fp16 K/V and from what was read (``SV`` with the fp16 scores)."""
        first = self.first_visible
        full_k = self.store.read_keys(16, torch.float32)[:, :, first:]
        full_v = self.store.read_values(16, torch.float32)[:, :, first:]
        full_scores = _scores(query, full_k, attention_mask, scaling, softcap)
        b, hq, q_len, _ = query.shape
        hkv = full_k.shape[1]

        def qk(k):
            grouped = query.float().reshape(b, hkv, -1, query.shape[-1])
            return (grouped @ k.float().transpose(-1, -2) * scaling).view(b, hq, q_len, -1)

        def sv(v):
            return (full_scores.reshape(b, hkv, -1, full_k.shape[2]) @ v.float()).view(b, hq, q_len, -1)

        return {"qk_full": qk(full_k), "qk_read": qk(keys), "sv_full": sv(full_v), "sv_read": sv(values)}

    def reset(self) -> None:
        super().reset()
        self.store = self.new_store()
        self.seen = self.visible = 0
        self._pending.clear()
        self.head_widths_k.zero_()
        self.head_widths_v.zero_()


@dataclass(frozen=True)
class AlignedKVMethod(KVMethod):
    """Precision-aligned reads of fp16 K/V planes (AlignedKV, arXiv 2409.16546).

    ``k_thresholds``/``v_thresholds`` are the binade gaps ``(t12, t8)`` at which a read drops to
    12 and 8 bits; ``topk`` is the number of strided-max candidates behind ``O_est``;
    ``prefill_aligned`` applies the rule to multi-token forwards too (chunked log-likelihood);
    ``margin`` adds binades to every threshold (0 = the paper) and ``accumulation_margin`` adds
    ``kvquant.alignment.accumulation_margin(n)`` for the ``n`` addends of each sum (head_dim for
    ``QKᵀ``, context length for ``SV``). ``v_block`` (beyond the paper, which is 1): value widths
    are decided per block of that many tokens, each the widest any of its tokens needs, so a block
    reads contiguously. ``backend``: ``torch`` (this reference), ``cpu`` (``kernels_cpu`` attends over
    the planes at the widths the torch rules chose), ``cupy`` (the kernels in ``kernels_cupy``; per-token
    value widths only) or ``auto`` (cupy on a CUDA device, cpu on a CPU where built). The default stays
    ``torch`` until ``scripts/gpu_check.sh`` has validated the CuPy kernels on a GPU (none was lent so
    far); the backend a cache uses is resolved when it is built and kept on the cache, never on the
    method.
    """

    blockwise: ClassVar[bool] = False
    attention: ClassVar[str | None] = KVQUANT_ATTENTION

    k_thresholds: tuple[float, float] = (4, 8)
    v_thresholds: tuple[float, float] = (4, 8)
    topk: int = 32
    prefill_aligned: bool = False
    margin: float = 0.0
    accumulation_margin: bool = False
    v_block: int = 1
    backend: str = "torch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_thresholds", check_thresholds(self.k_thresholds, "k"))
        object.__setattr__(self, "v_thresholds", check_thresholds(self.v_thresholds, "v"))
        if self.topk < 1:
            raise InvalidParameterError(f"topk must be >= 1, got {self.topk}")
        if self.margin < 0:
            raise InvalidParameterError(f"margin must be >= 0 binades, got {self.margin}")
        object.__setattr__(self, "margin", float(self.margin))
        if isinstance(self.v_block, bool) or not isinstance(self.v_block, int) or self.v_block < 1:
            raise InvalidParameterError(f"v_block must be a positive integer (tokens per width), got {self.v_block!r}")
        check_backend(self.backend)

    def thresholds_for(self, thresholds: tuple[float, float], n_addends: int) -> tuple[float, float]:
        """``thresholds`` raised by the margin (and the accumulation margin for ``n_addends``)."""
        extra = self.margin + (accumulation_margin(n_addends) if self.accumulation_margin else 0.0)
        return (thresholds[0] + extra, thresholds[1] + extra)

    def new_layer(self, layer_idx: int, geometry: KVGeometry, backend: str = "torch") -> AlignedLayer:
        return AlignedLayer(layer_idx, self, geometry.n_kv_heads, backend, geometry.window(layer_idx))

    def new_cache(self, model: Any) -> KVCache:
        """Planes for every layer, on the backend ``backend`` resolves to for the model's device.

        What the layout must give: a head dim that is a multiple of 8 (the plane layout) and query
        heads that share KV heads evenly; else one line. The kernels (cpu, cupy) apply neither logit
        soft-capping nor a sliding window, and CuPy's decide value widths per token only: such a
        model or method runs the torch reference (``auto``) or is refused (``cpu``/``cupy``).
        """
        geometry = KVGeometry.of(model.config)
        if geometry.head_dim % 8:
            raise InvalidParameterError(
                f"method {self.name or 'alignedkv'}: head_dim {geometry.head_dim} of model_type "
                f"'{geometry.model_type}' must be a multiple of 8 for the plane layout"
            )
        if geometry.n_heads % geometry.n_kv_heads:
            raise InvalidParameterError(
                f"method {self.name or 'alignedkv'}: {geometry.n_heads} query heads cannot share "
                f"{geometry.n_kv_heads} KV heads evenly"
            )
        route_attention(model, self.attention)
        unsupported = [f"soft-capped logits ({geometry.softcap})"] if geometry.softcap is not None else []
        if geometry.sliding_window is not None:
            unsupported.append(f"sliding-window layers ({geometry.sliding_window})")
        resolved = select_backend(self.backend, model.device, "planes")
        if resolved == "cupy" and self.v_block > 1:
            unsupported.append(f"value widths per block (v_block={self.v_block})")
        why = f"the plane kernels have no {' or '.join(unsupported)}" if unsupported else None
        backend = kernel_backend(self.backend, resolved, why)
        cache = KVCache([self.new_layer(i, geometry, backend) for i in range(geometry.n_layers)])
        cache.backend = backend
        return cache

    def analytic_bits(self, geometry: KVGeometry | None = None) -> float:
        return 16.0


@dataclass(frozen=True)
class AlignedKVPlusMethod(AlignedKVMethod):
    """AlignedKV+: key widths per (head, channel, 64-token block) from each block's own max ``|K|``.

    A channel's outliers sit in a few tokens; the whole-column max makes every other block read as
    if it held them. One exponent byte per block and channel (``PlaneStore.k_exp``, written with
    the block) lets each block read only what its own magnitude needs, against the same ``max P``.
    """

    blockwise: ClassVar[bool] = True


register_method("alignedkv", AlignedKVMethod)
register_method("alignedkv_release", AlignedKVMethod, v_thresholds=(1, 2))
register_method("alignedkv_plus", AlignedKVPlusMethod)


def width_histograms(cache: KVCache) -> list[dict[str, list[dict[int, int]]]]:
    """Per layer and KV head: elements read at each width, for K and for V (over all steps so far)."""
    return [
        {
            side: [dict(zip(WIDTHS, row, strict=True)) for row in getattr(layer, f"head_widths_{side}").tolist()]
            for side in ("k", "v")
        }
        for layer in cache.layers
    ]
