"""AlignedKV: fp16 K/V kept as bit planes; each decode step reads 8, 12 or 16 bits per element.

Nothing is removed from storage: the saving is in what attention loads. The layer stores planes
(``kvquant.alignment.PlaneStore``); on a decode step ``update`` hands attention a placeholder key
that carries the layer, and ``kvquant.attention`` calls ``attend``, which applies the rules
(``key_widths``/``value_widths``), reads K and V at those widths and runs transformers' SDPA on
what was read. Prefill attends in full precision, as in the paper, unless ``prefill_aligned``.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kernels_cupy
from kvquant.alignment import (
    BLOCK,
    accumulation_margin,
    block_key_widths,
    check_thresholds,
    key_widths,
    value_widths,
)
from kvquant.attention import tagged_placeholder, use_kvquant_attention
from kvquant.cache import KVCache, KVLayer, to_fp16_checked
from kvquant.errors import InvalidParameterError
from kvquant.methods.base import KVMethod, register_method

WIDTHS = (8, 12, 16)


def _scores(query: torch.Tensor, keys: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
    """Attention probabilities (fp32) ``[b, q_heads, q_len, L]`` of ``query`` over ``keys`` (fp32), mask applied."""
    b, hq, q_len, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    grouped = query.float().reshape(b, hkv, (hq // hkv) * q_len, d)  # GQA without copying K
    logits = (torch.matmul(grouped, keys.transpose(-1, -2)) * scaling).view(b, hq, q_len, n)
    if attention_mask is not None:
        mask = attention_mask[..., :n]
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


class AlignedLayer(KVLayer):
    """One layer's planes plus the per-step width decisions and their statistics."""

    is_croppable = False

    def __init__(self, layer_idx: int, method: AlignedKVMethod, n_kv_heads: int):
        super().__init__(layer_idx)
        self.method = method
        self.store = kernels_cupy.plane_store(method.backend_used, method.blockwise)
        self.kernels = method.backend_used == "cupy"
        self.head_widths_k = torch.zeros(n_kv_heads, len(WIDTHS), dtype=torch.int64)
        self.head_widths_v = torch.zeros(n_kv_heads, len(WIDTHS), dtype=torch.int64)
        self.capture_products = False
        self.products: dict[str, torch.Tensor] | None = None
        self._pending: list[tuple[int, int, torch.Tensor, torch.Tensor, int]] = []
        self._dtype = torch.float16

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

    def get_seq_length(self) -> int:
        return self.store.n_tokens

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._dtype = key_states.dtype
        self.store.append(
            to_fp16_checked(key_states, self.layer_idx, "key"), to_fp16_checked(value_states, self.layer_idx, "value")
        )
        if key_states.shape[2] == 1 or self.method.prefill_aligned:
            b, h, _, d = key_states.shape
            shape = (b, h, self.store.n_tokens, d)
            return (
                tagged_placeholder(self, shape, key_states.dtype, key_states.device),
                tagged_placeholder(self, shape, value_states.dtype, value_states.device),
            )
        keys, values = self.store.read_keys(16), self.store.read_values(16)
        self.count_read({16: keys.numel()}, {16: values.numel()})
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def aligned_read(self, query: torch.Tensor, attention_mask, scaling: float):
        """Decide widths for this step and read K and V at them; returns ``(keys, values, wk, wv)``."""
        store, method = self.store, self.method
        k_thresholds = method.thresholds_for(method.k_thresholds, query.shape[-1])
        if method.blockwise and store.k_exp is not None:
            wk = block_key_widths(query, store.k_absmax, store.k_exp, k_thresholds)
        else:
            wk = key_widths(query, store.k_absmax, k_thresholds)
        keys = store.read_keys(wk, query.dtype)
        scores = _scores(query, keys.float(), attention_mask, scaling)
        v_thresholds = method.thresholds_for(method.v_thresholds, store.n_tokens)
        wv_all = value_widths(scores, store.value_high_bytes(), v_thresholds, method.topk)
        wv = wv_all[:, :, : store.n_full]
        values = store.read_values(wv, query.dtype)
        if self.capture_products:
            self.products = self._products(query, keys, values, attention_mask, scaling)
        return keys, values, wk, wv

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """Attention for one step over what the rules read (called by ``kvquant.attention``)."""
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self.kernels and not self.capture_products and (query.shape[2] == 1 or attention_mask is not None):
            out, wk, wv = kernels_cupy.attend(self.method, self.store, query, attention_mask, scaling)
            self._record(wk, wv)
            return out, None
        keys, values, wk, wv = self.aligned_read(query, attention_mask, scaling)
        self._record(wk, wv)
        return sdpa_attention_forward(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)

    def _record(self, wk: torch.Tensor, wv: torch.Tensor) -> None:
        """Per-head width counts for this step; folded into ``counts()`` lazily (no sync per step)."""
        store = self.store
        b, h, _, d = store.tail_k.shape
        heads = torch.arange(h, device=wk.device) * len(WIDTHS)
        per_head_k = torch.bincount(
            (heads.view(1, h, *[1] * (wk.dim() - 2)) + (wk - 8) // 4).flatten(), minlength=h * len(WIDTHS)
        ).view(h, -1)
        per_head_v = torch.bincount((heads.view(1, h, 1) + (wv - 8) // 4).flatten(), minlength=h * len(WIDTHS))
        tokens_per_k_width = BLOCK if wk.dim() == 4 else store.n_full  # per-block or per-column widths
        per_head_k, per_head_v = (per_head_k * tokens_per_k_width).cpu(), (per_head_v.view(h, -1) * d).cpu()
        self.head_widths_k += per_head_k
        self.head_widths_v += per_head_v
        # metadata read each step: the per-channel max |K| (fp16), plus one exponent byte per block channel
        meta_k = 16 * b * h * d + (8 * store.k_exp.numel() if store.k_exp is not None else 0)
        tail = b * h * store.tail_k.shape[2] * d
        self._pending.append((store.n_tokens, tail, per_head_k.sum(0), per_head_v.sum(0), meta_k))

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

    def _products(self, query, keys, values, attention_mask, scaling) -> dict[str, torch.Tensor]:
        """``QKᵀ`` and ``SV`` from full fp16 K/V and from what was read (``SV`` with the fp16 scores)."""
        full_k, full_v = self.store.read_keys(16, torch.float32), self.store.read_values(16, torch.float32)
        full_scores = _scores(query, full_k, attention_mask, scaling)
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
        self.store = kernels_cupy.plane_store(self.method.backend_used, self.method.blockwise)
        self._pending.clear()
        self.head_widths_k.zero_()
        self.head_widths_v.zero_()


class AlignedKVMethod(KVMethod):
    """Precision-aligned reads of fp16 K/V planes (AlignedKV, arXiv 2409.16546).

    ``k_thresholds``/``v_thresholds`` are the binade gaps ``(t12, t8)`` at which a read drops to
    12 and 8 bits; ``topk`` is the number of strided-max candidates behind ``O_est``;
    ``prefill_aligned`` applies the rule to multi-token forwards too (chunked log-likelihood);
    ``margin`` adds binades to every threshold (0 = the paper) and ``accumulation_margin`` adds
    ``kvquant.alignment.accumulation_margin(n)`` for the ``n`` addends of each sum (head_dim for
    ``QKᵀ``, context length for ``SV``). ``backend``: ``torch`` (this reference), ``cupy`` (the
    kernels in ``kernels_cupy``) or ``auto`` (cupy on a CUDA device). The default stays ``torch``
    until ``scripts/gpu_check.sh`` has validated the kernels on a GPU (none was lent so far).
    """

    blockwise = False

    def __init__(
        self,
        k_thresholds: tuple[float, float] = (4, 8),
        v_thresholds: tuple[float, float] = (4, 8),
        topk: int = 32,
        prefill_aligned: bool = False,
        margin: float = 0.0,
        accumulation_margin: bool = False,
        backend: str = "torch",
    ):
        self.k_thresholds = check_thresholds(k_thresholds, "k")
        self.v_thresholds = check_thresholds(v_thresholds, "v")
        if int(topk) < 1:
            raise InvalidParameterError(f"topk must be >= 1, got {topk}")
        if float(margin) < 0:
            raise InvalidParameterError(f"margin must be >= 0 binades, got {margin}")
        self.topk = int(topk)
        self.prefill_aligned = bool(prefill_aligned)
        self.margin = float(margin)
        self.accumulation_margin = bool(accumulation_margin)
        self.backend, self.backend_used = kernels_cupy.check_backend(backend), None

    def thresholds_for(self, thresholds: tuple[float, float], n_addends: int) -> tuple[float, float]:
        """``thresholds`` raised by the margin (and the accumulation margin for ``n_addends``)."""
        extra = self.margin + (accumulation_margin(n_addends) if self.accumulation_margin else 0.0)
        return (thresholds[0] + extra, thresholds[1] + extra)

    def new_layer(self, layer_idx: int, model_config) -> AlignedLayer:
        n_kv = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
        return AlignedLayer(layer_idx, self, n_kv)

    def new_cache(self, model) -> KVCache:
        self.backend_used = kernels_cupy.select_backend(self.backend, model.device)
        use_kvquant_attention(model)
        return super().new_cache(model)

    def describe(self) -> dict:
        return {**super().describe(), **({"backend_used": self.backend_used} if self.backend_used else {})}

    def analytic_bits(self) -> float:
        return 16.0


class AlignedKVPlusMethod(AlignedKVMethod):
    """AlignedKV+: key widths per (head, channel, 64-token block) from each block's own max ``|K|``.

    A channel's outliers sit in a few tokens; the whole-column max makes every other block read as
    if it held them. One exponent byte per block and channel (``PlaneStore.k_exp``, written with
    the block) lets each block read only what its own magnitude needs, against the same ``max P``.
    """

    blockwise = True


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
