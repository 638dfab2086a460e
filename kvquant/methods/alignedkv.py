"""AlignedKV: fp16 K/V kept as bit planes; each decode step reads 8, 12 or 16 bits per element.

Nothing is removed from storage: the saving is in what attention loads. The layer stores planes
(``kvquant.formats.planes.PlaneStore``); on a decode step ``update`` hands attention placeholders
(``kvquant.attention``), which calls ``attend``: the cache's backend applies the rules
(``kvquant.alignment``) by the method's ``AlignedRule``, reads K and V at those widths and attends
over what was read. Prefill attends in full precision, as in the paper, unless ``prefill_aligned``.

Any layout whose attention goes through transformers' ``AttentionInterface`` (Llama, Mistral,
Qwen2/3, Phi-3, Gemma-2/3): the rule carries the model's logit ``softcap``, applied to the rule's
scores and to the attention alike.
A sliding-window layer hands attention only its window, as transformers' sliding layers do, and
drops every 64-token block that has fallen wholly out of it (up to 63 older tokens stay held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from kvquant.alignment import check_thresholds
from kvquant.attention import NAME as KVQUANT_ATTENTION
from kvquant.attention import route_attention, stock_attention
from kvquant.backends import TORCH, Backend, check_backend
from kvquant.cache import CropError, KVCache, KVGeometry, KVLayer, to_fp16_checked
from kvquant.errors import InvalidParameterError
from kvquant.formats.base import Reads
from kvquant.formats.planes import BLOCK, WIDTHS, AlignedRule, PlaneStore, aligned_read, decide_widths, scores
from kvquant.methods.base import KVMethod, register_method
from kvquant.quant.device import on_device


def head_width_counts(
    wk: torch.Tensor, wv: torch.Tensor, first: int, n_full: int, in_numpy: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, how many (key token, channel) and value tokens of the window ``first..n_full`` were read at
    each of ``WIDTHS``: int64 ``[H, 3]`` each, on ``wk``'s device. ``wk``: ``[B, H, D]`` per column or
    ``[B, H, nb, D]`` per (block, column); ``wv``: ``[B, H, n]``. Counted in numpy where both are CPU tensors
    (``in_numpy`` None; the same integers with less overhead per op than torch's small ops, and a decode step
    counts every layer), else in torch ops on their device that never wait for it (``_head_width_counts_on_device``:
    CUDA's ``bincount`` reads its input's min and max back to the host, two syncs a call)."""
    n = len(WIDTHS)
    h = wk.shape[1]
    cpu = in_numpy if in_numpy is not None else wk.device.type == "cpu" and wv.device.type == "cpu"
    if not cpu:
        return _head_width_counts_on_device(wk, wv, first, n_full)
    k, v = wk.numpy(), wv.numpy()
    heads = np.arange(h, dtype=np.int64) * n
    k_index = (heads.reshape(1, h, *[1] * (k.ndim - 2)) + (k >> 2) - 2).reshape(-1)  # 8/12/16 -> 0/1/2
    if k.ndim == 4:  # per (block, channel): weighted by the block's tokens in the window
        start = np.arange(k.shape[2]) * BLOCK
        inside = np.clip(start + BLOCK - np.maximum(start, first), 0, BLOCK)
        weights = np.broadcast_to(inside.reshape(1, 1, -1, 1), k.shape).reshape(-1).astype(np.float64)
        per_k = np.rint(np.bincount(k_index, weights, minlength=h * n)).astype(np.int64)
    else:  # per column: every block token in the window
        per_k = np.bincount(k_index, minlength=h * n) * max(0, n_full - first)
    per_v = np.bincount((heads.reshape(1, h, 1) + (v >> 2) - 2).reshape(-1), minlength=h * n)
    per_k, per_v = torch.from_numpy(per_k.astype(np.int64)), torch.from_numpy(per_v.astype(np.int64))
    return per_k.view(h, n), per_v.view(h, n)


_WIDTHS = torch.tensor(WIDTHS, dtype=torch.int32)  # placed on a device once (on_device)


def _head_width_counts_on_device(
    wk: torch.Tensor, wv: torch.Tensor, first: int, n_full: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_width_counts`` in torch ops with no host sync, few of them (each is a launch on a GPU, every layer
    and step): each element compared with the three widths at once and the matches summed per head; keys per
    block weighted by the block's tokens in the window."""
    widths = on_device(_WIDTHS, wk.device)
    if wk.ndim == 4:
        start = torch.arange(wk.shape[2], device=wk.device) * BLOCK
        inside = (start + BLOCK - start.clamp(min=first)).clamp(0, BLOCK)
        per_k = ((wk.unsqueeze(-1) == widths) * inside.view(1, 1, -1, 1, 1)).sum(dim=(0, 2, 3))
    else:
        per_k = (wk.unsqueeze(-1) == widths).sum(dim=(0, 2)) * max(0, n_full - first)
    return per_k, (wv.unsqueeze(-1) == widths).sum(dim=(0, 2))


class AlignedLayer(KVLayer):
    """One layer's planes (``kvquant.formats.planes.PlaneStore``) plus the width statistics of its reads."""

    def __init__(
        self,
        layer_idx: int,
        rule: AlignedRule,
        n_kv_heads: int,
        backend: Backend = TORCH,
        window: int | None = None,
        prefill_aligned: bool = False,
    ):
        super().__init__(layer_idx, window, backend, rule)
        self.prefill_aligned = prefill_aligned
        self.store = self.new_store()
        self.head_widths_k = torch.zeros(n_kv_heads, len(WIDTHS), dtype=torch.int64)
        self.head_widths_v = torch.zeros(n_kv_heads, len(WIDTHS), dtype=torch.int64)
        self.capture_products = False
        self.products: dict[str, torch.Tensor] | None = None
        self._pending: list[tuple[int, int, torch.Tensor, torch.Tensor, int, int, int]] = []

    def new_store(self) -> PlaneStore:
        """Planes in the layout every backend reads, as the backend's class for them (CuPy packs on the GPU)."""
        value_block = self.rule.v_block if self.rule.value_rule == "block" else 0
        return self.backend.new_state(PlaneStore, block_exponents=self.rule.blockwise, value_block=value_block)

    def attended_state(self) -> PlaneStore:
        return self.store

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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q_len = key_states.shape[2]
        self.store.visible, _ = self.get_mask_sizes(q_len)
        if self.window is not None and self.store.n_full:  # blocks no query from now on can see
            self.store.drop_blocks(max(0, self.seen - self.window + 1 - self.dropped) // BLOCK)
        self.store.append(
            to_fp16_checked(key_states, self.layer_idx, "key", self.finite),
            to_fp16_checked(value_states, self.layer_idx, "value", self.finite),
        )
        self.seen += q_len
        if q_len == 1 or self.prefill_aligned:
            b, h, _, d = key_states.shape
            return self.expect_attention((b, h, self.store.visible, d), key_states.dtype, key_states.device)
        first = self.store.first_visible
        keys, values = self.store.read_keys(16)[:, :, first:], self.store.read_values(16)[:, :, first:]
        self.count_read({16: keys.numel()}, {16: values.numel()})
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def forget_newest(self, n: int) -> None:
        """Every token is held at full precision (planes hold fp16): the store is rebuilt without the newest
        ``n``; a sliding layer's only until its window has filled."""
        if self.window is not None and self.seen >= self.window:
            raise CropError(
                f"layer {self.layer_idx}: a sliding-window layer cannot be cropped once its window has filled"
            )
        self.store = self.store.kept(self.store.n_tokens - n)

    @property
    def dropped(self) -> int:
        """Tokens a sliding layer has dropped (whole blocks that fell out of its window)."""
        return self.seen - self.store.n_tokens

    def decide_widths(self, query: torch.Tensor, attention_mask, scaling: float):
        """The torch rules for this step: ``(keys, wk, wv)`` (``kvquant.formats.planes.decide_widths``)."""
        return decide_widths(self.store, self.rule, query, attention_mask, scaling)

    def aligned_read(self, query: torch.Tensor, attention_mask, scaling: float):
        """This step's widths and K/V read at them: ``(keys, values, wk, wv)`` (the torch reference's read)."""
        return aligned_read(self.store, self.rule, query, attention_mask, scaling)

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None, **kwargs):
        """A kernel backend reads the planes (``KVLayer.attend``). The torch reference decides the widths,
        reads K/V at them and hands them to the model's own attention (so its SDPA or eager path and
        soft-capping apply as they do to fp16); ``capture_products`` (relative-error analysis) reads by
        the torch reference too and keeps ``QKᵀ``/``SV`` from full fp16 and from what was read."""
        if not (self.backend.materializes or self.capture_products):
            return super().attend(module, query, attention_mask, scaling, **kwargs)
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        mask = attention_mask[..., : self._attend_len] if attention_mask is not None else None
        keys, values, wk, wv = self.aligned_read(query, mask, scaling)
        if self.capture_products:
            self.products = self._products(query, keys, values, mask, scaling)
        self._record(wk, wv)
        return stock_attention(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)

    def record(self, reads: Reads) -> None:
        self._record(reads.k_widths, reads.v_widths, reads.counts)

    def _record(
        self, wk: torch.Tensor, wv: torch.Tensor, counts: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Per-head width counts of the tokens this step's attention saw (``counts`` where the backend
        counted them); folded into ``counts()`` lazily (no sync per step)."""
        store = self.store
        b, h, _, d = store.tail_k.shape
        if counts is None:
            counts = head_width_counts(wk, wv, store.first_visible, store.n_full)
        per_head_k, per_head_v = counts  # value tokens: times d channels when counted (on the host, no launch)
        # metadata read each step: the per-channel max |K| (fp16), one exponent byte per block channel of keys
        # (AlignedKV+) and of values (the block rule)
        meta_k = 16 * b * h * d + (8 * store.k_exp.numel() if store.k_exp is not None else 0)
        meta_v = 8 * store.v_exp.numel() if store.v_exp is not None else 0
        tail = b * h * min(store.tail_k.shape[2], store.visible) * d
        self._pending.append((self.seen, tail, per_head_k, per_head_v, d, meta_k, meta_v))

    def counts(self):
        """What was read, the steps not yet counted moved off the device together (one sync)."""
        moved = torch.stack([torch.stack((k, v)) for _, _, k, v, *_ in self._pending]).cpu() if self._pending else []
        for (position, tail, _, _, d, meta_k, meta_v), (per_head_k, per_head_v) in zip(
            self._pending, moved, strict=True
        ):
            per_head_v = per_head_v * d
            self.head_widths_k += per_head_k
            self.head_widths_v += per_head_v
            read_k = {w: int(n) for w, n in zip(WIDTHS, per_head_k.sum(0).tolist(), strict=True) if n}
            read_v = {w: int(n) for w, n in zip(WIDTHS, per_head_v.sum(0).tolist(), strict=True) if n}
            if tail:
                read_k[16] = read_k.get(16, 0) + tail
                read_v[16] = read_v.get(16, 0) + tail
            self.count_read(read_k, read_v, position=position, meta_k=meta_k, meta_v=meta_v)
        self._pending.clear()
        return super().counts()

    def _products(self, query, keys, values, attention_mask, scaling) -> dict[str, torch.Tensor]:
        """``QKᵀ`` and ``SV`` from full fp16 K/V and from what was read (``SV`` with the fp16 scores)."""
        first = self.store.first_visible
        full_k = self.store.read_keys(16, torch.float32)[:, :, first:]
        full_v = self.store.read_values(16, torch.float32)[:, :, first:]
        full_scores = scores(query, full_k, attention_mask, scaling, self.rule.softcap)
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
        self.seen = 0
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
    reads contiguously. All of them travel in one frozen ``AlignedRule`` (``rule``) to whichever
    backend reads the planes; ``backend`` (``auto``: the device's kernels where built and able to
    run the model and the rule, else the torch reference) is resolved once per cache.
    """

    blockwise: ClassVar[bool] = False
    value_rule: ClassVar[str] = "token"
    attention: ClassVar[str | None] = KVQUANT_ATTENTION
    format: ClassVar[str] = "planes"

    k_thresholds: tuple[float, float] = (4, 8)
    v_thresholds: tuple[float, float] = (4, 8)
    topk: int = 32
    prefill_aligned: bool = False
    margin: float = 0.0
    accumulation_margin: bool = False
    v_block: int = 1
    backend: str = "auto"

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

    def rule(self, geometry: KVGeometry | None = None) -> AlignedRule:
        """Every parameter that decides a step's widths, and the model's logit soft-capping."""
        return AlignedRule(
            k_thresholds=self.k_thresholds,
            v_thresholds=self.v_thresholds,
            topk=self.topk,
            v_block=self.v_block,
            blockwise=self.blockwise,
            margin=self.margin,
            accumulation=self.accumulation_margin,
            softcap=geometry.softcap if geometry is not None else None,
            value_rule=self.value_rule,
        )

    def new_layer(self, layer_idx: int, geometry: KVGeometry, backend: Backend = TORCH) -> AlignedLayer:
        return AlignedLayer(
            layer_idx,
            self.rule(geometry),
            geometry.n_kv_heads,
            backend,
            geometry.window(layer_idx),
            self.prefill_aligned,
        )

    def new_cache(self, model: Any) -> KVCache:
        """Planes for every layer, read by the backend ``backend`` resolves to for this model and rule.

        What the layout must give: a head dim that is a multiple of 8 (the plane layout) and query
        heads that share KV heads evenly; else one line. What a backend's kernels lack (soft-capping,
        sliding windows, a rule they cannot apply) its ``limits`` say: such a model runs the torch
        reference (``auto``) or is refused (an explicit kernel backend).
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
        backend = self.resolve(model, geometry, self.rule(geometry))
        cache = KVCache([self.new_layer(i, geometry, backend) for i in range(geometry.n_layers)])
        cache.backend = backend.name
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


@dataclass(frozen=True)
class AlignedKVBlockMethod(AlignedKVMethod):
    """AlignedKV with the block-bound value rule (beyond the paper; ``kvquant.alignment.block_value_widths``).

    Values are appended with one exponent byte per block of ``v_block`` tokens and channel (their largest);
    a step gives each block one width from that bound, the block's largest probability and ``e(O_est)``:
    never fewer bits than the paper's rule gives any token of it, no pass over plane A beyond the top-k
    rows ``O_est`` reads, and every read of a block one width — what a vector loop or a GPU warp needs.
    ``v_block`` must divide the 64-token plane block (default 32: one GPU warp's tokens).
    """

    value_rule: ClassVar[str] = "block"
    v_block: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.v_block < 2 or BLOCK % self.v_block:
            raise InvalidParameterError(
                f"method {self.name or 'alignedkv_block'}: v_block must divide {BLOCK} and be at least 2 "
                f"(2, 4, 8, 16, 32 or 64), got {self.v_block}"
            )


@dataclass(frozen=True)
class AlignedKVPlusBlockMethod(AlignedKVBlockMethod):
    """AlignedKV+'s per-block key widths with the block-bound value rule: both read one width per block,
    each bound from exponent bytes kept when the block was stored."""

    blockwise: ClassVar[bool] = True


register_method("alignedkv", AlignedKVMethod)
register_method("alignedkv_block", AlignedKVBlockMethod)
register_method("alignedkv_release", AlignedKVMethod, v_thresholds=(1, 2))
register_method("alignedkv_plus", AlignedKVPlusMethod)
register_method("alignedkv_plus_block", AlignedKVPlusBlockMethod)


def width_histograms(cache: KVCache) -> list[dict[str, list[dict[int, int]]]]:
    """Per layer and KV head: elements read at each width, for K and for V (over all steps so far)."""
    cache.counts()  # folds the steps not yet counted into every layer's histograms
    return [
        {
            side: [dict(zip(WIDTHS, row, strict=True)) for row in getattr(layer, f"head_widths_{side}").tolist()]
            for side in ("k", "v")
        }
        for layer in cache.layers
    ]
