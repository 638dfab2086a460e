"""Decode attention over HIGGS codes (keys coded after RoPE, ``higgs_post_rope``, or before it, ``higgs``) on the
GPU: ``higgs.cu`` through the backend protocol.

``attend_higgs`` takes a ``kvquant.formats.higgs.HiggsState`` as the method stores it (codes, scales, fp16
sinks and window read where they lie) and returns ``(out [B, Hq, q_len, D] in the query's dtype, Reads())``,
the torch reference ``kvquant.formats.higgs.attend`` up to fp32 summation order. Keys coded after RoPE are
scored in the rotated domain (each query row rotated once per step, here in torch); keys coded before RoPE
are rebuilt per token in the kernel (grid points, the inverse rotation, signs and scale, RoPE at the
token's position from ``positions``/``inv_freq``/``rope_scale`` or the ``cos``/``sin`` tables) and scored
against the plain query. Values are summed in the rotated domain either way, rotated back once per query
row by the merge kernel. The launch arithmetic (lane groups, row tiles, the split of
the three parts of the sequence, shared memory) and the argument preparation (query rows by group, the
rotated queries, the quantizer's tensors on the device) are plain functions, so the CPU tests and
``kernels_cupy.higgs_emulate`` (the kernel line for line in torch) use the very same numbers.

AQUA-KV states (codes of a predictor's residual) are read from their cache's decoded workspace by the same
launches (``higgs_rows_r*``, ``kernels_cupy.aquakv``). Refused: the shapes ``limits`` names, and
(``check_state``, per call) pre-RoPE keys whose RoPE inputs do not cover whole heads (tables or ``inv_freq``
narrower than the head: partial rotary) or are missing. Importing this module needs torch and numpy only;
cupy is imported at the first launch.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from kernels_cupy.codes import check_cuda, kernel_arg, mask_view
from kernels_cupy.codes import limits as code_limits
from kernels_cupy.loader import i32, launch, ptr, sm_count
from kvquant.formats.base import Reads
from kvquant.quant.hadamard import hadamard_transform

SOURCE = "higgs.cu"
THREADS = 128  # higgs.cu HIGGS_THREADS
WARPS = THREADS // 32
COORDS_PER_LANE = 8  # 4 codes of 2 coordinates
ROW_TILES = (1, 2, 4, 8)
#: tokens in flight per lane group, per rows of a tile: higgs.cu's HIGGS_KERNEL instantiations (one per tile;
#: the code width is an argument)
TOKENS_IN_FLIGHT = {1: 4, 2: 4, 4: 4, 8: 2}
#: the same for keys coded before RoPE (higgs.cu's ``higgs_pre_r*``): fewer tiles and tokens in flight, as
#: each token's rebuild is inlined once per token in flight (registers, compile time)
PRE_TOKENS_IN_FLIGHT = {1: 2, 4: 2, 8: 1}
PRE_ROW_TILES = tuple(PRE_TOKENS_IN_FLIGHT)
#: the same for an AQUA-KV workspace (``higgs_rows_r*``): no 8-row tile (with RoPE in registers it spills at
#: 255 registers on sm_80 or sm_90, at 2 or 1 tokens in flight), so more rows re-read the rows once per 4
ROWS_TOKENS_IN_FLIGHT = {1: 4, 2: 4, 4: 4}
ROWS_ROW_TILES = tuple(ROWS_TOKENS_IN_FLIGHT)
#: ``check_state``'s RoPE forms of pre-RoPE keys, as higgs.cu's ``rope_kind`` numbers them
ROPE_KINDS = {"post_rope": 0, "positions": 1, "tables": 2}
SHARED_STAGE = 256  # S_p butterflies of this stride and up cross warps: through shared memory
ZBUF = 2 * 1024  # floats: two rounds of the lane groups' coordinates (nseg · P <= 1024)
CODE_BITS = (4, 6, 8)  # HIGGS at 2, 3, 4 bits a value: 16-, 64-, 256-point grids of 2 coordinates
PADDED_MAX = 1024  # the widest group (padded): 128 lanes of 8 coordinates, one CTA
HEAD_DIM_MAX = 256
MIN_CHUNK = 256  # fewest keys a split of the coded part is given
WAVES = 4  # CTAs aimed for per SM when splitting the codes
#: queries in one step from which the torch reference runs instead (a prompt)
PROMPT_QUERIES = 16


def lanes_per_token(p: int) -> int:
    """Lanes that read one token's group: a power of two >= P / 8 (each lane holds 8 coordinates)."""
    need = -(-p // COORDS_PER_LANE)
    return 1 << (need - 1).bit_length()


def lane_groups(p: int) -> int:
    """Lane groups of a CTA (each runs its own online softmax over its tokens): 128 / LPT."""
    return THREADS // lanes_per_token(p)


def row_tile(rows: int, pre: bool = False, workspace: bool = False) -> int:
    """Rows of one CTA: the smallest instantiated tile holding ``rows``, else the largest (several tiles);
    ``pre``: among the pre-RoPE kernels' tiles; ``workspace``: the AQUA-KV kernels'."""
    tiles = ROWS_ROW_TILES if workspace else PRE_ROW_TILES if pre else ROW_TILES
    return next((t for t in tiles if t >= rows), tiles[-1])


def tokens_in_flight(rt: int, pre: bool = False, workspace: bool = False) -> int:
    """Tokens a lane group takes per step in the kernel of row tile ``rt`` (``pre``: keys coded before RoPE;
    ``workspace``: an AQUA-KV workspace)."""
    return (ROWS_TOKENS_IN_FLIGHT if workspace else PRE_TOKENS_IN_FLIGHT if pre else TOKENS_IN_FLIGHT)[rt]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def plan(parts: tuple[int, int, int], ctas: int, sms: int, p: int, tokens_in_flight: int) -> list[tuple[int, int]]:
    """``[(n_split, chunk)]`` for the sinks, the codes and the recent window: each part cut into chunks of
    ``chunk`` keys (the last may be shorter; no split straddles two parts), a whole number of the CTA's
    steps (lane groups × tokens in flight). The codes get about ``WAVES`` CTAs per SM over ``ctas`` (groups
    × row tiles × batch) but never fewer than ``MIN_CHUNK`` keys a split; the fp16 parts one split per
    ``MIN_CHUNK`` keys. An empty part has no split."""
    step = lane_groups(p) * tokens_in_flight
    want = max(1, _ceil(WAVES * sms, max(1, ctas)))
    out = []
    for i, n in enumerate(parts):
        if n == 0:
            out.append((0, step))
            continue
        n_split = max(1, min(want, _ceil(n, MIN_CHUNK))) if i == 1 else _ceil(n, MIN_CHUNK)
        chunk = _ceil(_ceil(n, n_split), step) * step
        out.append((_ceil(n, chunk), chunk))
    return out


def split_range(split: int, parts: tuple[int, int, int], splits: list[tuple[int, int]]) -> tuple[int, int, int]:
    """``(part, first, end)`` of split ``split`` as higgs.cu finds it: part 0 sinks, 1 codes, 2 recent;
    keys ``[first, end)`` in the order sinks, codes, window."""
    start = 0
    for part, ((n_split, chunk), n) in enumerate(zip(splits, parts, strict=True)):
        if split < n_split:
            first = start + split * chunk
            return part, first, min(start + n, first + chunk)
        split -= n_split
        start += n
    raise ValueError(f"split beyond the plan's {sum(s for s, _ in splits)}")


def shared_bytes(p: int, rt: int, n_grid: int, pre: bool = False, m: int = 1, workspace: bool = False) -> int:
    """Dynamic shared memory of one CTA: the grid's points, the warps' partial dot products (two steps) and
    m, l and the accumulators of every lane group (the final merge); ``pre`` (keys coded before RoPE, outer
    factor ``m × m``): also signs / √P and the outer factor, and the two rounds of the groups' coordinates
    that the rebuild uses in the merge's place (``ZBUF`` floats when that is more); ``workspace`` (AQUA-KV's
    rows, ``n_grid`` 0): its tokens in flight."""
    lpt, nseg = lanes_per_token(p), lane_groups(p)
    u = tokens_in_flight(rt, pre, workspace)
    merge = 2 * nseg * rt + nseg * rt * COORDS_PER_LANE * lpt
    if pre:
        return 4 * (2 * n_grid + 2 * WARPS * u * rt + p + m * m + max(merge, ZBUF))
    return 4 * (2 * n_grid + 2 * WARPS * u * rt + merge)


def kernel_name(rt: int, pre: bool = False, workspace: bool = False) -> str:
    """The attention kernel of row tile ``rt``: keys coded after RoPE, before it (``pre``), or an AQUA-KV
    workspace (``higgs_rows_r*``)."""
    return f"higgs_rows_r{rt}" if workspace else f"higgs_pre_r{rt}" if pre else f"higgs_r{rt}"


def butterfly_stages(p: int) -> list[tuple[int, str]]:
    """The S_p transform of a pre-RoPE key as higgs.cu's ``rebuild_key`` runs it: ``(stride, where)`` per
    butterfly stage, ``lane`` (strides 1, 2, 4: within a lane's 8 coordinates), ``warp`` (a shuffle with the
    lane ``stride / 8`` away) or ``shared`` (strides of ``SHARED_STAGE`` and up: a round through shared
    memory)."""
    out, h = [], 1
    while h < p:
        out.append((h, "lane" if h < COORDS_PER_LANE else "warp" if h < SHARED_STAGE else "shared"))
        h *= 2
    return out


def rope_partner(c: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's pairing in ``rebuild_key``: channel ``c`` of a group (heads of ``d`` side by side) is rotated with
    ``c − e + (e + d/2) mod d`` (``e = c mod d``), taken negated below ``d/2`` (``rotate_half``): ``(partner,
    sign)``."""
    e = c % d
    return c - e + (e + d // 2) % d, torch.where(e < d // 2, -1.0, 1.0)


def rope_sincos(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``higgs_sincos`` in torch: ``(sin, cos)`` of fp32 angles, the quadrant and remainder found in float64
    (``π/2`` in two parts), the remainder through Cephes' ``sinf``/``cosf`` polynomials in fp32."""
    x = angle.double()
    k = torch.round(x * 0.63661977236758134308)
    r = ((x - k * 1.5707963267948965580) - k * 6.123233995736766036e-17).float()
    r2 = r * r
    ps = r * r2 * ((r2 * -1.9515295891e-4 + 8.3321608736e-3) * r2 - 1.6666654611e-1) + r
    pc = r2 * r2 * ((r2 * 2.443315711809948e-5 - 1.388731625493765e-3) * r2 + 4.166664568298827e-2) - 0.5 * r2 + 1
    quadrant = (k.long() % 4).unsqueeze(-1)
    sin = torch.stack([ps, pc, -ps, -pc], -1).gather(-1, quadrant).squeeze(-1)
    cos = torch.stack([pc, -ps, -pc, ps], -1).gather(-1, quadrant).squeeze(-1)
    return sin, cos


def rope_kind(state: Any) -> int:
    """higgs.cu's ``rope_kind`` of a state: 0 for keys coded after RoPE or nothing coded (no RoPE at a read), 1
    for ``{"positions", "inv_freq", "rope_scale"}``, 2 for ``{"cos", "sin"}`` tables."""
    if state.qk is None or state.rope.get("post_rope"):
        return ROPE_KINDS["post_rope"]
    return ROPE_KINDS["tables" if state.rope.get("cos") is not None else "positions"]


def rope_tensors(state: Any, b: int, d: int, device: torch.device) -> dict[str, Any]:
    """The pre-RoPE kernel's RoPE arguments from ``state.rope``: int32 ``positions`` ``[B, nc]``, fp32
    ``inv_freq`` ``[D/2]`` and ``rope_scale`` (kind 1), or fp32 ``cos``/``sin`` ``[B, nc, D]`` (kind 2), the
    others None; contiguous on ``device``."""
    kind, rope, nc = rope_kind(state), state.rope, state.n_codes
    out: dict[str, Any] = {"positions": None, "inv_freq": None, "rope_scale": 1.0, "cos": None, "sin": None}
    if kind == 1:
        out["positions"] = kernel_arg(rope["positions"].to(device, torch.int32).expand(b, nc))
        out["inv_freq"] = kernel_arg(rope["inv_freq"].to(device, torch.float32))
        out["rope_scale"] = float(rope["rope_scale"])
    elif kind == 2:
        out["cos"] = kernel_arg(rope["cos"].to(device, torch.float32).expand(b, nc, d))
        out["sin"] = kernel_arg(rope["sin"].to(device, torch.float32).expand(b, nc, d))
    return out


def limits(fmt: str, geometry: Any, rule: Any) -> list[str]:
    """What of a model or rule this kernel lacks, one phrase each; ``rule`` is the method's quantizer or
    ``kvquant.formats.higgs.HiggsRule`` (its quantizer, and whether keys are coded after RoPE: both are read):
    (format ``aquakv``: ``kernels_cupy.aquakv.limits``) logit soft-capping, sliding-window layers, head dims not a
    multiple of 8 up to 256, groups that split a head or pad to more than 1024 or to a size not a multiple of
    8. RoPE inputs narrower than a head (partial rotary) show only in a step's state: ``check_state``."""
    if fmt == "aquakv":  # read from the cache's decoded rows: the AQUA-KV kernels' own limits
        from kernels_cupy.aquakv import limits as aquakv_limits

        return aquakv_limits(fmt, geometry, rule)
    missing = code_limits("higgs", geometry, rule)  # the code kernels' checks of a model: lanes of 8 channels here too
    d = geometry.head_dim
    if rule is not None and d % COORDS_PER_LANE == 0 and d <= HEAD_DIM_MAX:
        p = rule.padded_group
        if rule.group % d or p % COORDS_PER_LANE or p > PADDED_MAX:
            missing.append(
                f"groups of {rule.group} channels padded to {p} over heads of {d} "
                f"(they need whole heads, padded to a multiple of 8 up to {PADDED_MAX})"
            )
    return missing


def check_state(state: Any, d: int, hkv: int) -> None:
    """What the kernel assumes of a state, one ``ValueError`` line otherwise: HIGGS codes (not AQUA-KV's),
    whole heads per group, head dim and padded group as ``limits`` says; keys coded before RoPE with this
    step's RoPE inputs set and covering the whole head (``inv_freq`` of ``d/2``, tables of ``d`` channels)."""
    if state.format != "higgs":
        raise ValueError("kernels_cupy: HIGGS codes of a predictor residual (AQUA-KV) are not supported")
    kind, rope = rope_kind(state), state.rope
    if kind == 1 and rope.get("positions") is None:
        raise ValueError("kernels_cupy: HIGGS keys coded before RoPE without this step's RoPE inputs (state.rope)")
    if kind == 1 and tuple(rope["inv_freq"].shape) != (d // 2,):
        raise ValueError(f"kernels_cupy: RoPE inv_freq of shape {tuple(rope['inv_freq'].shape)} over heads of {d}")
    if kind == 2 and (rope["cos"].shape[-1] != d or rope["sin"].shape != rope["cos"].shape):
        raise ValueError(f"kernels_cupy: RoPE tables of {rope['cos'].shape[-1]} channels over heads of {d}")
    quant = state.quant
    if d % COORDS_PER_LANE or not COORDS_PER_LANE <= d <= HEAD_DIM_MAX:
        raise ValueError(f"kernels_cupy: the HIGGS kernel takes head_dim a multiple of 8 up to 256, got {d}")
    if quant.channels != hkv * d or quant.group % d:
        raise ValueError(f"kernels_cupy: HIGGS groups of {quant.group} channels split heads of {d}")
    if quant.padded_group % COORDS_PER_LANE or quant.padded_group > PADDED_MAX:
        raise ValueError(f"kernels_cupy: HIGGS groups padded to {quant.padded_group} (a multiple of 8 up to 1024)")
    if quant.code_bits not in CODE_BITS:
        raise ValueError(f"kernels_cupy: HIGGS codes of {quant.code_bits} bits")


def group_shape(quant: Any, hkv: int, d: int, hq: int, q_len: int) -> dict[str, int]:
    """The sizes a launch is built from: groups ``G``, KV heads a group ``hpg``, padded group ``P``, GQA
    ``g``, rows of a full group ``RM`` (``hpg·g·q_len``) and of each group (the last may hold fewer heads)."""
    hpg, g = quant.group // d, hq // hkv
    groups = quant.n_groups
    rows = [min(hpg, hkv - i * hpg) * g * q_len for i in range(groups)]
    return {"G": groups, "hpg": hpg, "P": quant.padded_group, "g": g, "RM": hpg * g * q_len, "rows": rows}


def query_rows(query: torch.Tensor, shape: dict[str, int]) -> torch.Tensor:
    """The query as ``[B, G, RM, D]`` fp32: group ``gi``'s rows (query head major, then position) first,
    zero rows past a short last group."""
    b, hq, q_len, d = query.shape
    flat = query.float().reshape(b, hq * q_len, d)
    pad = shape["G"] * shape["RM"] - hq * q_len
    return torch.nn.functional.pad(flat, (0, 0, 0, pad)).view(b, shape["G"], shape["RM"], d).contiguous()


def placed(rows: torch.Tensor, shape: dict[str, int], q_len: int) -> torch.Tensor:
    """Each row at its KV head's channels of the group, zeros elsewhere: ``[B, G, RM, P]``."""
    d = rows.shape[-1]
    head = torch.arange(shape["RM"], device=rows.device) // (shape["g"] * q_len)
    index = (head.unsqueeze(-1) * d + torch.arange(d, device=rows.device)).expand(*rows.shape)
    out = rows.new_zeros(*rows.shape[:-1], shape["P"])
    return out.scatter_(-1, index, rows)


def rotated_queries(rows: torch.Tensor, signs: torch.Tensor, shape: dict[str, int], q_len: int) -> torch.Tensor:
    """``qt = ((signs · q) H) / √P`` per row, ``[B, G, RM, P]`` fp32: scores are then ``s_t · (qt · y_t)``."""
    return hadamard_transform(placed(rows, shape, q_len) * signs).contiguous()


def group_codes(rows: torch.Tensor, code_bits: int, gi: int, p: int) -> torch.Tensor:
    """Group ``gi``'s ``P/2`` codes of packed rows ``[..., bytes]`` as higgs.cu's lanes read them: lane ``sub``
    loads the little-endian word of its 4 codes (2, 3 or 4 bytes from byte ``k0·bits/8``, ``k0 = gi·P/2 +
    4·sub``) and takes code ``j`` at bit ``j·bits``; int64 ``[..., P/2]``."""
    lanes = p // COORDS_PER_LANE
    nbytes = code_bits // 2
    first = (gi * (p // 2)) * code_bits // 8
    words = rows[..., first : first + lanes * nbytes].reshape(*rows.shape[:-1], lanes, nbytes).to(torch.int64)
    word = sum(words[..., i] << (8 * i) for i in range(nbytes))
    shifts = torch.arange(4, device=rows.device) * code_bits
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << code_bits) - 1)
    return codes.reshape(*rows.shape[:-1], p // 2)


def rotation_entries(outer: torch.Tensor, p: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``kron(outer, S_p)`` as higgs_merge forms each entry: ``outer[c // p, j // p]``,
    negated where ``popcount((c % p) & (j % p))`` is odd (the Sylvester matrix's sign), ``[len(rows), P]``."""
    j = torch.arange(outer.shape[0] * p)
    c = rows.unsqueeze(-1)
    both = (c % p) & (j % p)
    odd = sum((both >> k) & 1 for k in range(max(1, (p - 1).bit_length()))) % 2
    return outer[c // p, j // p] * (1 - 2 * odd)


class _Quant:
    """A quantizer's grid, signs and outer factor on one device (copied once, not per step)."""

    def __init__(self, quant: Any, device: torch.device) -> None:
        self.grid = kernel_arg(quant.grid.to(device, torch.float32))
        self.signs = kernel_arg(quant.signs.to(device, torch.float32))
        self.outer = kernel_arg(quant.outer.to(device, torch.float32))


_QUANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def quant_tensors(quant: Any, device: torch.device) -> _Quant:
    """The cached ``_Quant`` of a quantizer on ``device``."""
    per = _QUANTS.setdefault(quant, {})
    if device not in per:
        per[device] = _Quant(quant, device)
    return per[device]


def _window(win: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, int, int]:
    sinks = None if win.sinks is None or win.sinks.shape[2] == 0 else kernel_arg(win.sinks)
    recent = None if win.recent is None or win.recent.shape[2] == 0 else kernel_arg(win.recent)
    return sinks, recent, 0 if sinks is None else sinks.shape[2], 0 if recent is None else recent.shape[2]


def rows_shape(hkv: int, d: int, hq: int, q_len: int) -> dict[str, int]:
    """``group_shape`` of an AQUA-KV workspace's attention: a group per KV head (``hpg`` 1, ``P`` = D, no
    padding), whatever the quantizer's groups (the rows are decoded: ``kernels_cupy.aquakv``)."""
    g = hq // hkv
    return {"G": hkv, "hpg": 1, "P": d, "g": g, "RM": g * q_len, "rows": [g * q_len] * hkv}


def launches(
    state: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float, sms: int
) -> tuple[list[tuple], torch.Tensor, tuple]:
    """A step's two launches as ``(kernel, grid, shared memory, args)`` (the attention kernel, then
    ``higgs_merge``), the ``[B·Hq·q_len, D]`` fp32 output they write, and the tensors they read (the caller
    holds them until both are queued). ``state`` has at least one token. An AQUA-KV state (format
    ``aquakv``) is read from its workspace ``rows`` by ``higgs_rows_r*`` (``rows_shape``; values in the plain
    domain, so the merge rotates nothing back: its ``n1`` is 0)."""
    b, hq, q_len, d = query.shape
    hkv = state.k_win.recent.shape[1]
    quant = state.quant
    from_rows = state.format == "aquakv"
    shape = rows_shape(hkv, d, hq, q_len) if from_rows else group_shape(quant, hkv, d, hq, q_len)
    n_groups, p, rm = shape["G"], shape["P"], shape["RM"]
    ks, kr, ns, nr = _window(state.k_win)
    vs, vr, _, _ = _window(state.v_win)
    nc = state.n_codes
    qt_tensors = None if from_rows else quant_tensors(quant, query.device)
    rows = query_rows(query, shape)
    rkind = rope_kind(state)
    pre = rkind != 0 and not from_rows
    qt = rotated_queries(rows, qt_tensors.signs, shape, q_len) if nc and not pre and not from_rows else None
    rope = rope_tensors(state, b, d, query.device)
    kc = vc = ksc = vsc = krows = vrows = None
    if nc and from_rows:
        krows, vrows = kernel_arg(state.rows[0]), kernel_arg(state.rows[1])
    elif nc:
        kc, ksc = kernel_arg(state.qk.codes), kernel_arg(state.qk.scales)
        vc, vsc = kernel_arg(state.qv.codes), kernel_arg(state.qv.scales)
    mask_t, kind, (mb, mh, mq, mt) = mask_view(mask, b, hq, q_len, ns + nc + nr)
    rt = row_tile(rm, pre, from_rows)
    tiles = _ceil(rm, rt)
    splits = plan((ns, nc, nr), b * n_groups * tiles, sms, p, tokens_in_flight(rt, pre, from_rows))
    n_split = sum(s for s, _ in splits)
    f32 = {"dtype": torch.float32, "device": query.device}
    part_acc = torch.empty(n_split, b * n_groups, rm, p, **f32)
    part_ml = torch.empty(n_split, b * n_groups, rm, 2, **f32)
    n_grid = 0 if from_rows else quant.grid.shape[0]
    grid_t, signs, outer = (None, None, None) if from_rows else (qt_tensors.grid, qt_tensors.signs, qt_tensors.outer)
    args = (ptr(rows), ptr(qt), ptr(kc), ptr(ksc), ptr(ks), ptr(kr), ptr(vc), ptr(vsc), ptr(vs), ptr(vr))
    args += (ptr(krows), ptr(vrows))
    args += (i32(ns), i32(nc), i32(nr), i32(0 if kc is None else kc.shape[-1]), i32(quant.code_bits))
    args += (ptr(grid_t), i32(n_grid), np.uint64(0 if mask_t is None else mask_t.data_ptr()), i32(kind))
    args += (*(np.int64(x) for x in (mb, mh, mq, mt)), i32(hkv), i32(shape["g"]), i32(q_len), i32(d), i32(p))
    (n0, c0), (n1, c1), (_, c2) = splits
    args += (i32(shape["hpg"]), i32(rm), i32(n_groups), i32(n0), i32(c0), i32(n1), i32(c1), i32(c2))
    causal = mask is None and q_len > 1
    m = 1 if from_rows else quant.outer.shape[0]
    args += (i32(causal), np.float32(scaling), i32(lanes_per_token(p)), i32(rkind), ptr(rope["positions"]))
    args += (ptr(rope["inv_freq"]), np.float32(rope["rope_scale"]), ptr(rope["cos"]), ptr(rope["sin"]))
    args += (ptr(signs), ptr(outer), i32(m), i32(p // m), np.float32(p**-0.5))
    args += (ptr(part_acc), ptr(part_ml))
    out = torch.empty(b * hq * q_len, d, **f32)
    merge = (ptr(part_acc), ptr(part_ml), i32(n_split), i32(n0), i32(0 if from_rows else n1), i32(b * n_groups))
    merge += (i32(n_groups), i32(rm), i32(p), i32(d), i32(shape["g"] * q_len), i32(hq * q_len), ptr(signs))
    merge += (ptr(outer), i32(m), i32(p // m), np.float32(p**-0.5), ptr(out))
    name = kernel_name(rt, pre, from_rows)
    steps = [
        (name, (n_split, b * n_groups, tiles), shared_bytes(p, rt, n_grid, pre, m, from_rows), args),
        ("higgs_merge", (b * hq * q_len,), 4 * p, merge),
    ]
    held = (rows, qt, kc, ksc, vc, vsc, krows, vrows, ks, kr, vs, vr, mask_t, part_acc, part_ml, *rope.values())
    return steps, out, held


def attend_higgs(
    state: Any, rule: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, Reads]:
    """The backend protocol for format ``higgs`` (a ``HiggsState``, keys coded before or after RoPE):
    ``(out, Reads())``."""
    check_state(state, query.shape[-1], state.k_win.recent.shape[1])
    return launched(state, query, mask, scaling, "HIGGS")


def launched(state: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float, what: str):
    """A checked HIGGS or AQUA-KV state's attention: ``launches`` on the GPU for a decode step, the torch
    reference for a prompt chunk of more than ``PROMPT_QUERIES`` queries; ``(out, Reads())``."""
    b, hq, q_len, d = query.shape
    if q_len > PROMPT_QUERIES:
        from kvquant.formats.higgs import attend

        return attend(state, None, query, mask, scaling)[0], Reads()
    check_cuda(query, what)
    if state.n_sinks + state.n_codes + state.n_recent == 0:
        return query.new_zeros(query.shape), Reads()
    steps, out, _held = launches(state, query, mask, scaling, sm_count(query.device.index or 0))
    for name, grid, shared, args in steps:
        launch(SOURCE, name, grid, THREADS, args, shared_mem=shared)
    return out.view(b, hq, q_len, d).to(query.dtype), Reads()
