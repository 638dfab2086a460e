"""``higgs.cu`` line for line in torch, on any device: what the CPU tests check the kernel's arithmetic with.

The same split of the three parts (``higgs.plan``, ``higgs.split_range``), row tiles, lane groups and tokens
in flight as a launch; the rotated queries of ``higgs.rotated_queries`` (keys coded after RoPE) or, for keys
coded before RoPE, ``rebuild_key``: the grid points, the S_p butterflies stage by stage
(``higgs.butterfly_stages``), the outer mix, signs / √P and RoPE with ``higgs.rope_sincos`` (or the tables)
and ``higgs.rope_partner``, scored against the plain query; the lanes' codes read as the kernel
reads them (``higgs.group_codes``) and looked up in the grid; per lane group an online softmax over its
tokens with scores ``(q · k) · s_t · scaling`` and values ``acc += (p · s_t) · v``; the lane groups' merge,
then ``higgs_merge``: the splits' log-sum-exp, the code splits' rotated sums rotated back once per row
(``kron(outer, S_p)ᵀ``, signs, ``1/√P``) and added to the fp16 splits' plain sums. An AQUA-KV state (format
``aquakv``) as ``higgs_rows_r*`` reads it: its workspace rows, a group per KV head (``higgs.rows_shape``), keys
rotated by RoPE as ``row_key`` does, values summed in the plain domain (nothing rotated back in the merge).
Vectorised over batch × groups, lane groups and rows; slow, for tests.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels_cupy.aquakv import check_state as check_rows_state
from kernels_cupy.codes import mask_view
from kernels_cupy.higgs import (
    PROMPT_QUERIES,
    butterfly_stages,
    check_state,
    group_codes,
    group_shape,
    lane_groups,
    placed,
    plan,
    query_rows,
    rope_kind,
    rope_partner,
    rope_sincos,
    rotated_queries,
    rotation_entries,
    row_tile,
    rows_shape,
    split_range,
    tokens_in_flight,
)
from kvquant.formats.base import Reads

NEG_INF = float("-inf")


def _fp16_part(win: torch.Tensor | None, shape: dict[str, int], d: int) -> torch.Tensor | None:
    """An fp16 part ``[B, Hkv, n, D]`` as the lanes read it: each group's heads side by side, ``[B·G, n, P]``
    fp32 (zeros past the group's heads and in the padding)."""
    if win is None or win.shape[2] == 0:
        return None
    b, hkv, n, _ = win.shape
    groups, hpg, p = shape["G"], shape["hpg"], shape["P"]
    x = torch.nn.functional.pad(win.float(), (0, 0, 0, 0, 0, groups * hpg - hkv))
    x = x.view(b, groups, hpg, n, d).permute(0, 1, 3, 2, 4).reshape(b * groups, n, hpg * d)
    return torch.nn.functional.pad(x, (0, p - hpg * d))


def _coded_part(q: Any, quant: Any, shape: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Coded tokens as the lanes read them: grid points ``[B·G, n, P]`` and scales ``[B·G, n]`` fp32."""
    b, n, _ = q.codes.shape
    groups, p = shape["G"], shape["P"]
    points = torch.stack([quant.grid[group_codes(q.codes, quant.code_bits, gi, p)] for gi in range(groups)], 1)
    scales = q.scales.float().transpose(1, 2)
    return points.reshape(b * groups, n, p), scales.reshape(b * groups, n)


def _rope_channels(state: Any, shape: dict[str, int], d: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rebuild_key``'s cos and sin at each channel of a group, ``[B·G, nc, P]`` fp32: from the positions
    (``rope_sincos(float(position) · inv_freq[e mod D/2]) · rope_scale``) or the tables, at ``e = c mod D``."""
    rope, nc, p = state.rope, state.n_codes, shape["P"]
    e = torch.arange(p) % d
    if rope_kind(state) == 1:
        angle = rope["positions"].float().expand(b, nc).unsqueeze(-1) * rope["inv_freq"].float()[e % (d // 2)]
        sin, cos = rope_sincos(angle)
        cos, sin = cos * float(rope["rope_scale"]), sin * float(rope["rope_scale"])
    else:
        cos, sin = (rope[k].float().expand(b, nc, d)[..., e] for k in ("cos", "sin"))
    return cos.repeat_interleave(shape["G"], 0), sin.repeat_interleave(shape["G"], 0)


def unrotated(y: torch.Tensor, signs: torch.Tensor, outer: torch.Tensor) -> torch.Tensor:
    """``higgs_unrotate`` and the outer mix over grid points ``y`` ``[..., P]``: the S_p butterflies (within a
    lane, by shuffle or through shared memory: the same sums), the outer mix, signs / √P (no scale)."""
    p_all, m = y.shape[-1], outer.shape[0]
    p = p_all // m
    j = torch.arange(p_all)
    x = y
    for h, _where in butterfly_stages(p):
        other = x[..., j ^ h]
        x = torch.where((j & h) != 0, other - x, x + other)
    if m > 1:
        taps = torch.arange(m) * p + (j % p).unsqueeze(-1)  # [P, m]: a·p + c mod p
        x = (x[..., taps] * outer.float()[j // p]).sum(-1)
    return x * (signs.float() * p_all**-0.5)


def _roped(a: torch.Tensor, state: Any, shape: dict[str, int], d: int, b: int) -> torch.Tensor:
    """RoPE as ``rebuild_key`` and ``row_key`` apply it to pre-RoPE keys ``a`` ``[B·G, nc, P]`` (heads of ``d``
    side by side): ``a · cos + (sign · a[partner]) · sin`` at each channel's position."""
    p_all = shape["P"]
    partner, sign = rope_partner(torch.arange(p_all), d)
    o = a[..., partner.clamp(max=p_all - 1)]
    cos, sin = _rope_channels(state, shape, d, b)
    return a * cos + (sign * o) * sin


def _rebuilt_keys(y: torch.Tensor, state: Any, shape: dict[str, int], d: int, b: int) -> torch.Tensor:
    """``rebuild_key`` over the coded keys' grid points ``y`` ``[B·G, nc, P]``: ``unrotated``, then RoPE; zeros
    past each group's heads. The scale stays out (it multiplies the score)."""
    j = torch.arange(shape["P"])
    k = _roped(unrotated(y, state.quant.signs, state.quant.outer), state, shape, d, b)
    heads = torch.tensor(_heads(shape)).repeat(b)
    return torch.where(j.view(1, 1, -1) < (heads * d).view(-1, 1, 1), k, 0.0)


def _heads(shape: dict[str, int]) -> list[int]:
    """KV heads of each group (the last may hold fewer)."""
    return [rows * shape["hpg"] // shape["RM"] for rows in shape["rows"]]


def _tokens(state: Any, side: str, shape: dict[str, int], d: int, b: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Every key (or value) in the order sinks, codes, window: ``[B·G, L, P]`` and its scale ``[B·G, L]``
    (1 for fp16 tokens); the part decides how a lane reads it. Keys coded before RoPE are rebuilt
    (``_rebuilt_keys``)."""
    win = state.k_win if side == "k" else state.v_win
    parts, scales = [], []
    for x in (win.sinks, win.recent):
        got = _fp16_part(x, shape, d)
        parts.append(got)
        scales.append(None if got is None else torch.ones(got.shape[:2]))
    coded = state.qk if side == "k" else state.qv
    if coded is not None and state.format == "aquakv":  # the workspace's rows, a group per KV head
        y = state.rows[0 if side == "k" else 1].float()
        y = y.view(b, -1, shape["G"], d).transpose(1, 2).reshape(b * shape["G"], -1, d)
        parts.insert(1, _roped(y, state, shape, d, b) if side == "k" else y)
        scales.insert(1, torch.ones(y.shape[:2]))
    elif coded is not None:
        y, s = _coded_part(coded, state.quant, shape)
        if side == "k" and rope_kind(state) != 0:
            y = _rebuilt_keys(y, state, shape, d, b)
        parts.insert(1, y)
        scales.insert(1, s)
    return torch.cat([x for x in parts if x is not None], 1), torch.cat([x for x in scales if x is not None], 1)


def emulate(state: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float, sms: int = 132) -> torch.Tensor:
    """What ``higgs.attend_higgs`` computes on a GPU with ``sms`` SMs, ``[B, Hq, q_len, D]`` fp32, in torch."""
    b, hq, q_len, d = query.shape
    hkv = state.k_win.recent.shape[1]
    from_rows = state.format == "aquakv"
    (check_rows_state if from_rows else check_state)(state, d, hkv)
    quant = state.quant
    shape = rows_shape(hkv, d, hq, q_len) if from_rows else group_shape(quant, hkv, d, hq, q_len)
    groups, p, rm, g = shape["G"], shape["P"], shape["RM"], shape["g"]
    bg = b * groups
    ns, nr = state.n_sinks, state.n_recent
    parts = (ns, state.n_codes, nr)
    length = sum(parts)
    rows = query_rows(query, shape)
    q_plain = placed(rows, shape, q_len).reshape(bg, rm, p)
    pre = rope_kind(state) != 0 and not from_rows
    q_rot = q_plain if pre or from_rows else rotated_queries(rows, quant.signs, shape, q_len).reshape(bg, rm, p)
    keys, k_scale = _tokens(state, "k", shape, d, b)
    values, v_scale = _tokens(state, "v", shape, d, b)
    mask_t, kind, _ = mask_view(mask, b, hq, q_len, length)
    causal = mask is None and q_len > 1
    rt = row_tile(rm, pre, from_rows)
    tiles = -(-rm // rt)
    u_n = tokens_in_flight(rt, pre, from_rows)
    splits = plan(parts, bg * tiles, sms, p, u_n)
    n_split = sum(s for s, _ in splits)
    nseg = lane_groups(p)
    part_acc = torch.zeros(n_split, bg, tiles * rt, p)
    part_ml = torch.zeros(n_split, bg, tiles * rt, 2)
    heads = torch.arange(bg)
    b_of = (heads // groups).view(bg, 1, 1)
    lanes = torch.arange(nseg)
    for split in range(n_split):
        part, tb, te = split_range(split, parts, splits)
        for tile in range(tiles):
            row = tile * rt + torch.arange(rt)
            qr = (q_rot if part == 1 else q_plain)[:, (row).clamp(max=rm - 1)]  # [BG, RT, P]
            qr = torch.where((row < rm).view(1, rt, 1), qr, 0.0)
            hq_of = ((heads % groups).view(bg, 1) * shape["hpg"] * g + row // q_len).clamp(max=hq - 1).unsqueeze(1)
            i_of = (row % q_len).view(1, 1, rt)
            limit = (length - q_len + i_of + 1) if causal else torch.full_like(i_of, length)
            m = torch.full((bg, nseg, rt), NEG_INF)
            l_sum = torch.zeros(bg, nseg, rt)
            acc = torch.zeros(bg, nseg, rt, p)
            for base in range(tb, te, nseg * u_n):
                s, tokens = [], []
                for u in range(u_n):
                    t = base + u * nseg + lanes
                    tc = t.clamp(max=length - 1)
                    dot = torch.einsum("grp,gnp->gnr", qr, keys[:, tc])
                    x = dot * k_scale[:, tc].unsqueeze(-1) * scaling
                    x = torch.where((t >= te).view(1, nseg, 1) | (t.view(1, nseg, 1) >= limit), NEG_INF, x)
                    if kind == 1:
                        x = torch.where(mask_t[b_of, hq_of, i_of, tc.view(1, nseg, 1)] != 0, x, NEG_INF)
                    elif kind == 2:
                        x = x + mask_t[b_of, hq_of, i_of, tc.view(1, nseg, 1)]
                    s.append(x)
                    tokens.append((t, tc))
                s = torch.stack(s)  # [U, BG, nseg, RT]
                mx = torch.maximum(m, s.amax(0))
                seen = mx != NEG_INF
                alpha = torch.where(seen, torch.exp(m - mx), 1.0)
                prob = torch.where(seen, torch.exp(s - mx), 0.0)
                l_sum = torch.where(seen, l_sum * alpha + prob.sum(0), l_sum)
                m = torch.where(seen, mx, m)
                acc = acc * alpha.unsqueeze(-1)
                for u, (t, tc) in enumerate(tokens):
                    w = torch.where((t < te).view(1, nseg, 1), prob[u] * v_scale[:, tc].unsqueeze(-1), 0.0)
                    acc = acc + w.unsqueeze(-1) * values[:, tc].unsqueeze(2)
            top = m.amax(1)
            wgt = torch.where(m == NEG_INF, 0.0, torch.exp(m - top.unsqueeze(1)))
            empty = top == NEG_INF
            part_acc[split, :, row] = torch.where(empty.unsqueeze(-1), 0.0, (wgt.unsqueeze(-1) * acc).sum(1))
            part_ml[split, :, row, 0] = top
            part_ml[split, :, row, 1] = torch.where(empty, 0.0, (wgt * l_sum).sum(1))
    n1 = 0 if from_rows else splits[1][0]  # the merge's code splits: none to rotate back from rows
    return _merge(part_acc[:, :, :rm], part_ml[:, :, :rm], splits[0][0], n1, state.quant, shape, query.shape)


def _merge(
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    n0: int,
    n1: int,
    quant: Any,
    shape: dict[str, int],
    qshape: torch.Size,
) -> torch.Tensor:
    """``higgs_merge``: the splits' log-sum-exp, the rotated sums of the code splits ``[n0, n0 + n1)`` rotated
    back once per row (nothing where ``n1`` is 0), ``[B, Hq, Q, D]``."""
    b, hq, q_len, d = qshape
    groups, p, rm = shape["G"], shape["P"], shape["RM"]
    ms = part_ml[..., 0]
    top = ms.amax(0)
    w = torch.where(ms == NEG_INF, 0.0, torch.exp(ms - top))
    den = (w * part_ml[..., 1]).sum(0)
    coded = torch.zeros(part_acc.shape[0], dtype=torch.bool)
    coded[n0 : n0 + n1] = True
    weighted = w.unsqueeze(-1) * part_acc
    rot = weighted[coded].sum(0)  # [BG, RM, P]
    plain = weighted[~coded].sum(0)
    back = torch.zeros_like(rot)
    if n1:
        m = quant.outer.shape[0]
        back = rot @ rotation_entries(quant.outer, p // m, torch.arange(p)).T * p**-0.5 * quant.signs
    head = torch.arange(rm) // (shape["g"] * q_len)
    index = (head.unsqueeze(-1) * d + torch.arange(d)).expand(*rot.shape[:-1], d)
    out = (plain.gather(-1, index) + back.gather(-1, index)) / den.unsqueeze(-1)
    out = torch.where((top == NEG_INF).unsqueeze(-1), 0.0, out).view(b, groups * rm, d)
    return out[:, : hq * q_len].reshape(b, hq, q_len, d)


def attend(state: Any, rule: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> tuple:
    """The backend protocol over ``emulate``, as ``higgs.attend_higgs`` routes a step (a prompt to the torch
    reference): so a CPU test can run a model's attention through the kernel's arithmetic."""
    if query.shape[2] > PROMPT_QUERIES:
        from kvquant.formats.higgs import attend as reference

        return reference(state, rule, query, mask, scaling)
    return emulate(state, query, mask, scaling).to(query.dtype), Reads()
