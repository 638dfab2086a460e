"""``codes.cu`` line for line in torch, on any device: what the CPU tests check the kernel's arithmetic with.

The same split (``codes.plan``), row tiles, lane groups and tokens in flight as a launch; each lane
group's online softmax over its tokens, the lanes' code words unpacked as the kernel does
(``lane_codes``), GEAR's outliers read by token from ``codes.outlier_rows``, the runs walked with the
kernel's cursor, ``A_t · (q B)`` in the scores and ``pa Bᵀ`` flushed when a group leaves a segment,
then the groups' merge and the splits' log-sum-exp merge. Vectorised over batch × KV heads only; slow,
for tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernels_cupy.codes import (
    RANK_MAX,
    TOKENS_IN_FLIGHT,
    check_geometry,
    check_state,
    lane_groups,
    mask_view,
    outlier_rows,
    plan,
    quant_rows,
    query_times_b,
    row_tile,
    segment_bases,
)

NEG_INF = float("-inf")


def lane_codes(rows: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Codes of packed rows ``[..., bytes]`` as fp32 ``[..., d]``, as codes.cu's lanes read them: lane
    ``sub`` loads the little-endian word of ``bits`` bytes at byte ``sub·bits`` (its 8 channels) and
    takes code ``j`` at bit ``j·bits``."""
    lanes = d // 8
    words = rows[..., : lanes * bits].reshape(*rows.shape[:-1], lanes, bits).to(torch.int64)
    word = sum(words[..., i] << (8 * i) for i in range(bits))
    shifts = torch.arange(8, device=rows.device) * bits
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*rows.shape[:-1], d).float()


class _Cursor:
    """codes.cu's ``Cursor``/``seek``: the low-rank segment ``[first, end)`` of run ``run`` (-1: none)."""

    def __init__(self) -> None:
        self.first, self.end, self.run, self.seg = 0, 0, -1, 0

    def copy(self) -> _Cursor:
        c = _Cursor()
        c.first, c.end, c.run, c.seg = self.first, self.end, self.run, self.seg
        return c

    def seek(self, t: int, runs: list[Any]) -> None:
        if self.first <= t < self.end:
            return
        self.run, self.first, self.end = -1, t, t + 1
        for i, run in enumerate(runs):
            nseg = run.a.shape[2]
            if run.start <= t < run.start + run.seg_len * nseg:
                sg = (t - run.start) // run.seg_len
                self.run, self.seg = i, sg
                self.first, self.end = run.start + sg * run.seg_len, run.start + (sg + 1) * run.seg_len
                return


def kernel_view(t: torch.Tensor, bh: int, rows: int) -> torch.Tensor:
    """``[BH, rows, inner]``: ``t``'s storage read as codes.cu reads a stream's tensor, row ``i`` of ``bh`` at
    element ``(bh·rows + i)·inner`` from the first (``rows`` a buffer's capacity where the launch passes one)."""
    inner = math.prod(t.shape[3:])
    return t.as_strided((bh, rows, inner), (rows * inner, inner, 1))


class _Stream:
    """One stream as codes.cu addresses it (flat ``[BH, …]`` views), with GEAR's dense outlier patch."""

    def __init__(self, stream: Any, bh: int, d: int, gear: bool) -> None:
        store, q = stream.store, stream.store.q
        self.n = store.length
        self.window = stream.window.reshape(bh, -1, d).float()
        self.codes = self.scale = self.zero = None
        if q is not None:  # from the tensors' storage, as the launch passes them (quant_rows) and the kernel indexes
            (codes, scale, zero), rows, groups = quant_rows(q, q.axis == 3)
            self.codes = kernel_view(codes, bh, rows)
            self.scale, self.zero = (kernel_view(t, bh, groups).float() for t in (scale, zero))
        self.runs = store.runs if gear else []
        self.patch = self.patched = None
        if gear and store.index is not None:  # patch_outliers: token t's outliers from its row pointers
            row_ptr, pos, val = (x.reshape(bh, -1) for x in outlier_rows(store.index, store.value, self.n, d))
            self.patch = torch.zeros(bh, self.n, d)
            self.patched = torch.zeros(bh, self.n, d, dtype=torch.bool)
            for i in range(bh):
                for t in range(self.n):
                    for o in range(int(row_ptr[i, t]), int(row_ptr[i, t + 1])):
                        ch = int(pos[i, o]) - t * d
                        self.patch[i, t, ch] = float(val[i, o])
                        self.patched[i, t, ch] = True

    def a_row(self, c: _Cursor, t: int, b: int, h: int) -> torch.Tensor:
        """``A[t, :]`` of the cursor's segment, ``[BH, rank]`` fp32."""
        a = self.runs[c.run].a
        return a[:, :, c.seg, t - c.first].reshape(b * h, -1).float()

    def b_mat(self, c: _Cursor, b: int, h: int) -> torch.Tensor:
        """``B`` of the cursor's segment, ``[BH, D, rank]`` fp32."""
        bm = self.runs[c.run].b
        return bm[:, :, c.seg].reshape(b * h, bm.shape[-2], -1).float()

    def outliers(self, x: torch.Tensor, c: _Cursor, t: int, b: int, h: int) -> torch.Tensor:
        """``x`` with token ``t``'s outliers written as value − (A Bᵀ)[t, c]."""
        if self.patch is None:
            return x
        lr = torch.zeros_like(x)
        if c.run >= 0:
            lr = torch.einsum("ij,icj->ic", self.a_row(c, t, b, h), self.b_mat(c, b, h))
        return torch.where(self.patched[:, t], self.patch[:, t] - lr, x)


def _key_row(s: _Stream, t: int, g: int, bits: int, d: int) -> torch.Tensor:
    if t < s.n:
        return lane_codes(s.codes[:, t], bits, d) * s.scale[:, t // g] + s.zero[:, t // g]
    return s.window[:, t - s.n]


def _value_row(s: _Stream, t: int, g: int, bits: int, d: int) -> torch.Tensor:
    if t < s.n:
        groups = torch.arange(d) // g
        return lane_codes(s.codes[:, t], bits, d) * s.scale[:, t, groups] + s.zero[:, t, groups]
    return s.window[:, t - s.n]


def emulate(
    fmt: str, state: Any, query: torch.Tensor, mask: torch.Tensor | None, scaling: float, sms: int = 132
) -> torch.Tensor:
    """What ``codes._attend`` computes on a GPU with ``sms`` SMs, ``[B, Hq, q_len, D]`` fp32, in torch."""
    b, hq, q_len, d = query.shape
    hkv = state.k.window.shape[1]
    check_geometry(d, hq, hkv)
    check_state(state, d)
    gear = fmt == "gear"
    bits, g = state.bits, state.group_size
    length, rows, bh = state.length, (hq // hkv) * q_len, b * hkv
    q32 = query.float().reshape(bh, rows, d)
    ks, vs = _Stream(state.k, bh, d, gear), _Stream(state.v, bh, d, gear)
    qb = query_times_b(q32.view(b, hkv, rows, d), ks.runs).reshape(bh, -1, rows, RANK_MAX) if gear else None
    bases = segment_bases(ks.runs)
    mask_t, kind, _ = mask_view(mask, b, hq, q_len, length)
    causal = mask is None and q_len > 1
    rt = row_tile(fmt, rows)
    tiles = -(-rows // rt)
    u_n = TOKENS_IN_FLIGHT[(fmt, rt)]
    n_split, chunk = plan(length, bh * tiles, sms, d, u_n)
    nseg = lane_groups(d)
    part_acc = torch.zeros(n_split, bh, rows, d)
    part_ml = torch.zeros(n_split, bh, rows, 2)
    heads = torch.arange(bh)
    for split in range(n_split):
        tb, te = split * chunk, min(length, (split + 1) * chunk)
        for tile in range(tiles):
            row0 = tile * rt
            nrows = min(rt, rows - row0)
            qr = q32[:, row0 : row0 + nrows]
            hq_of = (heads % hkv).unsqueeze(1) * (hq // hkv) + (row0 + torch.arange(nrows)) // q_len
            i_of = ((row0 + torch.arange(nrows)) % q_len).expand(bh, nrows)
            b_of = (heads // hkv).unsqueeze(1).expand(bh, nrows)
            limit = (length - q_len + i_of + 1) if causal else torch.full_like(i_of, length)
            groups = []
            for group in range(nseg):
                m = torch.full((bh, nrows), NEG_INF)
                l_sum = torch.zeros(bh, nrows)
                acc = torch.zeros(bh, nrows, d)
                pa = torch.zeros(bh, nrows, RANK_MAX)
                kc, vc = _Cursor(), _Cursor()
                for base in range(tb, te, nseg * u_n):
                    tokens = [base + u * nseg + group for u in range(u_n)]
                    s = []
                    for t in tokens:
                        if t >= te:
                            s.append(torch.full((bh, nrows), NEG_INF))
                            continue
                        lr = torch.zeros(bh, nrows)
                        k = _key_row(ks, t, g, bits, d)
                        if gear and t < ks.n:
                            kc.seek(t, ks.runs)
                            k = ks.outliers(k, kc, t, b, hkv)
                            if kc.run >= 0:
                                a = ks.a_row(kc, t, b, hkv)
                                qbs = qb[:, bases[kc.run] + kc.seg, row0 : row0 + nrows, : a.shape[-1]]
                                lr = torch.einsum("ij,irj->ir", a, qbs)
                        x = (torch.einsum("ird,id->ir", qr, k) + lr) * scaling
                        x = torch.where(limit <= t, NEG_INF, x)
                        if kind == 1:
                            x = torch.where(mask_t[b_of, hq_of, i_of, t] != 0, x, NEG_INF)
                        elif kind == 2:
                            x = x + mask_t[b_of, hq_of, i_of, t]
                        s.append(x)
                    s = torch.stack(s)  # [U, BH, rows]
                    mx = torch.maximum(m, s.amax(0))
                    seen = mx != NEG_INF
                    alpha = torch.where(seen, torch.exp(m - mx), 1.0)
                    p = torch.where(seen, torch.exp(s - mx), 0.0)
                    l_sum = torch.where(seen, l_sum * alpha + p.sum(0), l_sum)
                    m = torch.where(seen, mx, m)
                    acc = acc * alpha.unsqueeze(-1)
                    pa = pa * alpha.unsqueeze(-1)
                    for u, t in enumerate(tokens):
                        if t >= te:
                            continue
                        v = _value_row(vs, t, g, bits, d)
                        if gear and t < vs.n:
                            prev = vc.copy()
                            vc.seek(t, vs.runs)
                            if prev.run >= 0 and (prev.run, prev.seg) != (vc.run, vc.seg):
                                acc, pa = _flush(vs, prev, acc, pa, b, hkv)
                            v = vs.outliers(v, vc, t, b, hkv)
                            if vc.run >= 0:
                                a = vs.a_row(vc, t, b, hkv)
                                pa[..., : a.shape[-1]] += p[u].unsqueeze(-1) * a.unsqueeze(1)
                        acc = acc + p[u].unsqueeze(-1) * v.unsqueeze(1)
                if gear and vc.run >= 0:
                    acc, pa = _flush(vs, vc, acc, pa, b, hkv)
                groups.append((m, l_sum, acc))
            gm = torch.stack([x[0] for x in groups])
            top = gm.amax(0)
            w = torch.where(gm == NEG_INF, 0.0, torch.exp(gm - top))
            o = (w.unsqueeze(-1) * torch.stack([x[2] for x in groups])).sum(0)
            den = (w * torch.stack([x[1] for x in groups])).sum(0)
            empty = top == NEG_INF
            part_acc[split, :, row0 : row0 + nrows] = torch.where(empty.unsqueeze(-1), 0.0, o)
            part_ml[split, :, row0 : row0 + nrows, 0] = top
            part_ml[split, :, row0 : row0 + nrows, 1] = torch.where(empty, 0.0, den)
    ms = part_ml[..., 0]
    top = ms.amax(0)
    w = torch.where(ms == NEG_INF, 0.0, torch.exp(ms - top))
    den = (w * part_ml[..., 1]).sum(0)
    out = (w.unsqueeze(-1) * part_acc).sum(0) / den.unsqueeze(-1)
    out = torch.where((top == NEG_INF).unsqueeze(-1), 0.0, out)
    return out.view(b, hq, q_len, d)


def _flush(
    s: _Stream, c: _Cursor, acc: torch.Tensor, pa: torch.Tensor, b: int, h: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A lane group leaving a value segment: ``acc += pa Bᵀ``, ``pa`` starts again."""
    bm = s.b_mat(c, b, h)
    acc = acc + torch.einsum("irj,icj->irc", pa[..., : bm.shape[-1]], bm)
    return acc, torch.zeros_like(pa)
