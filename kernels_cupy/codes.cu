// Decode attention over integer codes (KIVI, kvquant.formats.codes) and GEAR (kvquant.formats.gear),
// read as stored: codes dequantized in registers, never written out. The torch reference is
// kvquant.formats.codes.attend; kernels_cupy/codes_emulate.py is this file line for line in torch.
//
// Layout (kvquant.quant.integer, contiguous tensors; bh = b * Hkv + h):
// - keys: codes [BH, nk_rows, D*BITS/8] (channel c at bits (c % (8/BITS))*BITS of byte c*BITS/8),
//   scale/zero fp16 [BH, ngk, D] (per channel, group t / G); the fp16 window [BH, wk, D] after them;
// - values: codes [BH, nv, D*BITS/8], scale/zero fp16 [BH, nv, D/G] (per token, group c / G); window.
// A stream's rows per bh may exceed its tokens: a store's buffer (kvquant.formats.base.RowBuffer) is read in
// place with its capacity as the row stride (rows; keys' scale groups: groups), codes.rows_of.
// Token t of the sequence (length L = nk + wk = nv + wv) is code row t below nk (nv), else window row
// t - nk (t - nv): the window is one more segment of the same split.
//
// Grid (n_split, BH, row tiles), CODES_THREADS threads. A CTA reads the keys [split*chunk, +chunk) for
// RT query rows of one KV head (rows j*Q + i: GQA head j of the group, query position i; the query
// and the output are [BH, R, D] fp32). A lane holds 8 channels (D a multiple of 8); LPT lanes (a power
// of two >= D/8) read one token, so a warp reads 32/LPT consecutive tokens per load and the CTA's
// NSEG = 4*32/LPT lane groups each run their own online softmax over tokens
// base + u*NSEG + group (u < U), U tokens in flight. The groups are merged in shared memory at the
// end; each CTA writes (m, l, unnormalised acc) per row, and codes_merge takes the log-sum-exp of the
// splits.
//
// GEAR adds, per stream: outliers sorted by position with a row pointer per token (built by
// codes.py), which replace the reconstruction; in registers an outlier is written as
// value - (A B^T)[t, c], so that with the low-rank term it is exactly the value. The low-rank term
// is never expanded: scores get A_t . (q B) (q B precomputed per segment and row, qb
// [BH, segments, R, CODES_RANK]), values accumulate pa = sum_t p_t A_t per lane group and add
// pa B^T when the group leaves the segment. Runs (kvquant LowRankRun) are rows of CODES_RUN_FIELDS
// int64: start, seg_len, nseg, rank, first segment (in qb), A pointer and its strides (b, h, s, t, j),
// B pointer and its strides (b, h, s, c, j).
//
// No headers (as planes.cuh): nvcc (CI, PTX) and NVRTC compile it unchanged.

#define CODES_THREADS 128
#define CODES_WARPS (CODES_THREADS / 32)
#define CODES_RANK 8
#define CODES_RUN_FIELDS 18
#define CODES_NEG_INF (__int_as_float(0xff800000))
#define CODES_FULL_MASK 0xffffffffu

__device__ __forceinline__ float codes_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// An integer code < 2^23 as fp32, exactly: 2^23 + c from its bits, minus 2^23 (no slow int->float).
__device__ __forceinline__ float code_value(unsigned int c) { return __int_as_float(0x4B000000u | c) - 8388608.0f; }

// The 8 codes of channels 8*sub .. 8*sub+7 of a packed row: 2 bits -> one 16-bit word, 4 -> 32, 8 -> 64.
template <int BITS>
__device__ __forceinline__ void lane_codes(const unsigned char* row, int sub, float (&x)[8]) {
    if constexpr (BITS == 2) {
        const unsigned int w = *reinterpret_cast<const unsigned short*>(row + 2 * sub);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = code_value((w >> (2 * j)) & 3u);
    } else if constexpr (BITS == 4) {
        const unsigned int w = *reinterpret_cast<const unsigned int*>(row + 4 * sub);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = code_value((w >> (4 * j)) & 15u);
    } else {
        const uint2 w = *reinterpret_cast<const uint2*>(row + 8 * sub);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = code_value(((j < 4 ? w.x : w.y) >> (8 * (j & 3))) & 255u);
    }
}

// 8 consecutive fp16 values (16-byte aligned) as fp32.
__device__ __forceinline__ void load_half8(const unsigned short* p, float (&x)[8]) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = codes_h2f((unsigned short)((u[j >> 1] >> (16 * (j & 1))) & 0xFFFFu));
}

// One stream (K or V) as stored, plus GEAR's outliers and runs (null for KIVI).
struct Stream {
    const unsigned char* codes;
    const unsigned short *scale, *zero, *window;
    int n, rows, groups, w;  // coded tokens, code rows per bh (padded, or a buffer's capacity: its row stride),
                             // scale rows per bh (keys' groups; values use rows), window tokens
    const int* row_ptr;      // [BH, n + 1]: outliers of token t are [row_ptr[t], row_ptr[t + 1])
    const int* pos;          // [BH, n_out] int32 positions t*D + c, sorted
    const unsigned short* val;
    int n_out;
    const long long* runs;
    int n_runs;
};

// The low-rank segment a lane group is in: tokens [first, end) of run `run` (-1: none), segment seg.
struct Cursor {
    int first, end, run, seg;
};

__device__ __forceinline__ void seek(Cursor& c, int t, const Stream& s) {
    if (t >= c.first && t < c.end) return;
    c.run = -1;
    c.first = t;
    c.end = t + 1;
    for (int i = 0; i < s.n_runs; ++i) {
        const long long* d = s.runs + i * CODES_RUN_FIELDS;
        const long long start = d[0], len = d[1], nseg = d[2];
        if (t >= start && t < start + len * nseg) {
            const int sg = (int)((t - start) / len);
            c.run = i;
            c.seg = sg;
            c.first = (int)(start + sg * len);
            c.end = (int)(start + (sg + 1) * len);
            return;
        }
    }
}

__device__ __forceinline__ int run_rank(const Stream& s, const Cursor& c) { return (int)s.runs[c.run * CODES_RUN_FIELDS + 3]; }

// A[t, j] of the cursor's segment.
__device__ __forceinline__ float a_elem(const Stream& s, const Cursor& c, int b, int h, int t, int j) {
    const long long* d = s.runs + c.run * CODES_RUN_FIELDS;
    const unsigned short* a = reinterpret_cast<const unsigned short*>(d[5]);
    return codes_h2f(a[b * d[6] + h * d[7] + c.seg * d[8] + (t - c.first) * d[9] + j * d[10]]);
}

// B[ch, j] of the cursor's segment.
__device__ __forceinline__ float b_elem(const Stream& s, const Cursor& c, int b, int h, int ch, int j) {
    const long long* d = s.runs + c.run * CODES_RUN_FIELDS;
    const unsigned short* bp = reinterpret_cast<const unsigned short*>(d[11]);
    return codes_h2f(bp[b * d[12] + h * d[13] + c.seg * d[14] + ch * d[15] + j * d[16]]);
}

// GEAR: the outliers of token t that fall in this lane's channels, written as value - (A B^T)[t, c].
__device__ __forceinline__ void patch_outliers(const Stream& s, const Cursor& c, int bh, int b, int h, int t, int D,
                                               int c0, float (&x)[8]) {
    if (s.row_ptr == nullptr) return;  // GEAR-L: no outliers
    const int* rp = s.row_ptr + (long long)bh * (s.n + 1);
    const int o0 = rp[t], o1 = rp[t + 1];
    for (int o = o0; o < o1; ++o) {
        const int ch = s.pos[(long long)bh * s.n_out + o] - t * D;
        if (ch < c0 || ch >= c0 + 8) continue;
        float lr = 0.0f;
        if (c.run >= 0) {
            const int rank = run_rank(s, c);
            for (int j = 0; j < rank; ++j) lr = fmaf(a_elem(s, c, b, h, t, j), b_elem(s, c, b, h, ch, j), lr);
        }
        const float v = codes_h2f(s.val[(long long)bh * s.n_out + o]) - lr;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (ch == c0 + j) x[j] = v;
    }
}

// Keys: token t's 8 channels from c0 (codes below n, else the window).
template <int BITS>
__device__ __forceinline__ void key_row(const Stream& s, int bh, int t, int D, int G, int sub, float (&x)[8]) {
    const int c0 = 8 * sub;
    if (t < s.n) {
        const int bytes = D * BITS / 8;
        lane_codes<BITS>(s.codes + ((long long)bh * s.rows + t) * bytes, sub, x);
        float sc[8], ze[8];
        const long long g = (long long)bh * s.groups + t / G;
        load_half8(s.scale + g * D + c0, sc);
        load_half8(s.zero + g * D + c0, ze);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = fmaf(x[j], sc[j], ze[j]);
    } else {
        load_half8(s.window + ((long long)bh * s.w + (t - s.n)) * D + c0, x);
    }
}

// Values: token t's 8 channels from c0 (groups of G channels per token).
template <int BITS>
__device__ __forceinline__ void value_row(const Stream& s, int bh, int t, int D, int G, int sub, float (&x)[8]) {
    const int c0 = 8 * sub;
    if (t < s.n) {
        const int bytes = D * BITS / 8;
        lane_codes<BITS>(s.codes + ((long long)bh * s.rows + t) * bytes, sub, x);
        const long long row = ((long long)bh * s.rows + t) * (D / G);  // scale rows share the codes' stride
        if (G % 8 == 0) {  // the lane's 8 channels share one group
            const float sc = codes_h2f(s.scale[row + c0 / G]), ze = codes_h2f(s.zero[row + c0 / G]);
#pragma unroll
            for (int j = 0; j < 8; ++j) x[j] = fmaf(x[j], sc, ze);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int g = (c0 + j) / G;
                x[j] = fmaf(x[j], codes_h2f(s.scale[row + g]), codes_h2f(s.zero[row + g]));
            }
        }
    } else {
        load_half8(s.window + ((long long)bh * s.w + (t - s.n)) * D + c0, x);
    }
}

template <int BITS, int RT, int U, bool GEAR>
__device__ __forceinline__ void attend_codes(
    const float* __restrict__ q, Stream ks, Stream vs, const float* __restrict__ qb, int qb_segs,
    const void* mask, int mask_kind, long long mb, long long mh, long long mq, long long mt, int Hkv, int g, int Q,
    int R, int D, int G, int L, int chunk, int causal, float scaling, int lpt, float* __restrict__ part_acc,
    float* __restrict__ part_ml) {
    extern __shared__ float smem[];
    const int split = blockIdx.x, bh = blockIdx.y, row0 = blockIdx.z * RT;
    const int b = bh / Hkv, h = bh % Hkv;
    const int nrows = min(RT, R - row0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gpw = 32 / lpt, nseg = CODES_WARPS * gpw;
    const int group = warp * gpw + lane / lpt, sub = lane % lpt, c0 = 8 * sub;
    const bool active = c0 < D;

    float qr[RT][8], acc[RT][8], m[RT], l[RT];
    long long moff[RT];
    int limit[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        const int row = row0 + r;
        const bool ok = r < nrows && active;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            qr[r][j] = ok ? q[((long long)bh * R + row) * D + c0 + j] : 0.0f;
            acc[r][j] = 0.0f;
        }
        m[r] = CODES_NEG_INF;
        l[r] = 0.0f;
        const int hq = h * g + row / Q, i = row % Q;
        moff[r] = b * mb + hq * mh + i * mq;
        limit[r] = r >= nrows ? 0 : (causal ? L - Q + i + 1 : L);
    }
    float pa[GEAR ? RT : 1][CODES_RANK];
#pragma unroll
    for (int r = 0; r < (GEAR ? RT : 1); ++r)
#pragma unroll
        for (int j = 0; j < CODES_RANK; ++j) pa[r][j] = 0.0f;
    Cursor kc = {0, 0, -1, 0}, vc = {0, 0, -1, 0};

    const int tb = split * chunk, te = min(L, tb + chunk);
    for (int base = tb; base < te; base += nseg * U) {
        float s[U][RT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * nseg + group;
            float k[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) k[j] = 0.0f;
            float lr[RT];
#pragma unroll
            for (int r = 0; r < RT; ++r) lr[r] = 0.0f;
            if (t < te) {
                if (GEAR && t < ks.n) {
                    seek(kc, t, ks);
                    if (active) {
                        key_row<BITS>(ks, bh, t, D, G, sub, k);
                        patch_outliers(ks, kc, bh, b, h, t, D, c0, k);
                    }
                    if (kc.run >= 0) {  // A_t . (q B), the same in every lane of the group
                        const int rank = run_rank(ks, kc);
                        const long long sg = ks.runs[kc.run * CODES_RUN_FIELDS + 4] + kc.seg;
                        for (int j = 0; j < rank; ++j) {
                            const float a = a_elem(ks, kc, b, h, t, j);
#pragma unroll
                            for (int r = 0; r < RT; ++r) {
                                if (r >= nrows) break;
                                lr[r] = fmaf(a, qb[(((long long)bh * qb_segs + sg) * R + row0 + r) * CODES_RANK + j],
                                             lr[r]);
                            }
                        }
                    }
                } else if (active) {
                    key_row<BITS>(ks, bh, t, D, G, sub, k);
                }
            }
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                float x = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) x = fmaf(qr[r][j], k[j], x);
                s[u][r] = x;
            }
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                for (int o = lpt >> 1; o > 0; o >>= 1) s[u][r] += __shfl_xor_sync(CODES_FULL_MASK, s[u][r], o);
                float x = (s[u][r] + lr[r]) * scaling;
                if (t >= te || t >= limit[r]) {
                    x = CODES_NEG_INF;
                } else if (mask_kind == 1) {
                    if (!reinterpret_cast<const unsigned char*>(mask)[moff[r] + t * mt]) x = CODES_NEG_INF;
                } else if (mask_kind == 2) {
                    x += reinterpret_cast<const float*>(mask)[moff[r] + t * mt];
                }
                s[u][r] = x;
            }
        }
        // Online softmax over the U tokens, per row (every lane of a group holds the same numbers).
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            float mx = m[r];
#pragma unroll
            for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][r]);
            if (mx == CODES_NEG_INF) {
#pragma unroll
                for (int u = 0; u < U; ++u) s[u][r] = 0.0f;
                continue;
            }
            const float alpha = expf(m[r] - mx);  // 0 while m is -inf
            float sum = 0.0f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u][r] = expf(s[u][r] - mx);
                sum += s[u][r];
            }
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r][j] *= alpha;
            if constexpr (GEAR) {
#pragma unroll
                for (int j = 0; j < CODES_RANK; ++j) pa[r][j] *= alpha;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * nseg + group;
            if (t >= te) continue;
            float v[8];
            if (GEAR && t < vs.n) {
                const Cursor prev = vc;
                seek(vc, t, vs);
                if (prev.run >= 0 && (prev.run != vc.run || prev.seg != vc.seg)) {
                    // Leaving a segment: acc += pa B^T, then pa starts again.
                    const int rank = run_rank(vs, prev);
#pragma unroll
                    for (int j = 0; j < CODES_RANK; ++j) {
                        if (j >= rank) break;
                        float bj[8];
#pragma unroll
                        for (int x = 0; x < 8; ++x) bj[x] = active ? b_elem(vs, prev, b, h, c0 + x, j) : 0.0f;
#pragma unroll
                        for (int r = 0; r < RT; ++r)
#pragma unroll
                            for (int x = 0; x < 8; ++x) acc[r][x] = fmaf(pa[r][j], bj[x], acc[r][x]);
                    }
#pragma unroll
                    for (int r = 0; r < RT; ++r)
#pragma unroll
                        for (int j = 0; j < CODES_RANK; ++j) pa[r][j] = 0.0f;
                }
                if (active) {
                    value_row<BITS>(vs, bh, t, D, G, sub, v);
                    patch_outliers(vs, vc, bh, b, h, t, D, c0, v);
                }
                if (vc.run >= 0) {
                    const int rank = run_rank(vs, vc);
#pragma unroll
                    for (int j = 0; j < CODES_RANK; ++j) {
                        if (j >= rank) break;
                        const float a = a_elem(vs, vc, b, h, t, j);
#pragma unroll
                        for (int r = 0; r < RT; ++r) pa[r][j] = fmaf(s[u][r], a, pa[r][j]);
                    }
                }
            } else if (active) {
                value_row<BITS>(vs, bh, t, D, G, sub, v);
            }
            if (active) {
#pragma unroll
                for (int r = 0; r < RT; ++r)
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[r][j] = fmaf(s[u][r], v[j], acc[r][j]);
            }
        }
    }
    if (GEAR && vc.run >= 0) {
        const int rank = run_rank(vs, vc);
#pragma unroll
        for (int j = 0; j < CODES_RANK; ++j) {
            if (j >= rank) break;
            float bj[8];
#pragma unroll
            for (int x = 0; x < 8; ++x) bj[x] = active ? b_elem(vs, vc, b, h, c0 + x, j) : 0.0f;
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int x = 0; x < 8; ++x) acc[r][x] = fmaf(pa[r][j], bj[x], acc[r][x]);
        }
    }

    // Merge the lane groups: smem m, l [nseg][RT], acc [nseg][RT][8*lpt].
    const int dp = 8 * lpt;
    float* sm_m = smem;
    float* sm_l = smem + nseg * RT;
    float* sm_acc = smem + 2 * nseg * RT;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        if (sub == 0) {
            sm_m[group * RT + r] = m[r];
            sm_l[group * RT + r] = l[r];
        }
        if (active) {
#pragma unroll
            for (int j = 0; j < 8; ++j) sm_acc[(group * RT + r) * dp + c0 + j] = acc[r][j];
        }
    }
    __syncthreads();
    const long long n_bh = gridDim.y;
    for (int i = threadIdx.x; i < nrows * D; i += CODES_THREADS) {
        const int r = i / D, c = i % D;
        float mx = CODES_NEG_INF;
        for (int gi = 0; gi < nseg; ++gi) mx = fmaxf(mx, sm_m[gi * RT + r]);
        float o = 0.0f, den = 0.0f;
        if (mx != CODES_NEG_INF) {
            for (int gi = 0; gi < nseg; ++gi) {
                const float mg = sm_m[gi * RT + r];
                if (mg == CODES_NEG_INF) continue;
                const float wgt = expf(mg - mx);
                o = fmaf(wgt, sm_acc[(gi * RT + r) * dp + c], o);
                den = fmaf(wgt, sm_l[gi * RT + r], den);
            }
        }
        const long long prow = ((long long)split * n_bh + bh) * R + row0 + r;
        part_acc[prow * D + c] = o;
        if (c == 0) {
            part_ml[prow * 2] = mx;
            part_ml[prow * 2 + 1] = den;
        }
    }
}

// The splits of each row (rows = BH * R, one block each): the log-sum-exp merge into out [rows, D]
// fp32; a row that sees no key gives zeros.
extern "C" __global__ void codes_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                       int n_split, int rows, int D, float* __restrict__ out) {
    const int row = blockIdx.x;
    float mx = CODES_NEG_INF;
    for (int sp = 0; sp < n_split; ++sp) mx = fmaxf(mx, part_ml[((long long)sp * rows + row) * 2]);
    float den = 0.0f;
    if (mx != CODES_NEG_INF) {
        for (int sp = 0; sp < n_split; ++sp) {
            const float ms = part_ml[((long long)sp * rows + row) * 2];
            if (ms != CODES_NEG_INF) den = fmaf(expf(ms - mx), part_ml[((long long)sp * rows + row) * 2 + 1], den);
        }
    }
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float o = 0.0f;
        if (mx != CODES_NEG_INF) {
            for (int sp = 0; sp < n_split; ++sp) {
                const float ms = part_ml[((long long)sp * rows + row) * 2];
                if (ms != CODES_NEG_INF) o = fmaf(expf(ms - mx), part_acc[((long long)sp * rows + row) * D + c], o);
            }
            o /= den;
        }
        out[(long long)row * D + c] = o;
    }
}

#define CODES_KERNEL(NAME, BITS, RT, U, GEAR)                                                                         \
    extern "C" __global__ void __launch_bounds__(CODES_THREADS, 1) NAME(                                               \
        const float* q,                                                                                                \
        const unsigned char* kcodes, const unsigned short* kscale, const unsigned short* kzero, int kn, int krows,     \
        int kgroups, const unsigned short* kwin, int kw, const int* krp, const int* kpos, const unsigned short* kval,  \
        int knout, const long long* kruns, int knruns,                                                                 \
        const unsigned char* vcodes, const unsigned short* vscale, const unsigned short* vzero, int vn, int vrows,     \
        const unsigned short* vwin, int vw, const int* vrp, const int* vpos, const unsigned short* vval, int vnout,    \
        const long long* vruns, int vnruns,                                                                            \
        const float* qb, int qb_segs, const void* mask, int mask_kind, long long mb, long long mh, long long mq,       \
        long long mt, int Hkv, int g, int Q, int R, int D, int G, int L, int chunk, int causal, float scaling,         \
        int lpt, float* part_acc, float* part_ml) {                                                                    \
        const Stream ks = {kcodes, kscale, kzero, kwin, kn, krows, kgroups, kw, krp, kpos, kval, knout, kruns, knruns}; \
        const Stream vs = {vcodes, vscale, vzero, vwin, vn, vrows, 0, vw, vrp, vpos, vval, vnout, vruns, vnruns};      \
        attend_codes<BITS, RT, U, GEAR>(q, ks, vs, qb, qb_segs, mask, mask_kind, mb, mh, mq, mt, Hkv, g, Q, R, D, G, \
                                        L, chunk, causal, scaling, lpt, part_acc, part_ml);                          \
    }

#define CODES_ROWS(BITS)                                  \
    CODES_KERNEL(codes_kivi_b##BITS##_r1, BITS, 1, 4, false) \
    CODES_KERNEL(codes_kivi_b##BITS##_r2, BITS, 2, 4, false) \
    CODES_KERNEL(codes_kivi_b##BITS##_r4, BITS, 4, 4, false) \
    CODES_KERNEL(codes_kivi_b##BITS##_r8, BITS, 8, 2, false) \
    CODES_KERNEL(codes_gear_b##BITS##_r1, BITS, 1, 4, true)  \
    CODES_KERNEL(codes_gear_b##BITS##_r2, BITS, 2, 4, true)  \
    CODES_KERNEL(codes_gear_b##BITS##_r4, BITS, 4, 2, true)

CODES_ROWS(2)
CODES_ROWS(4)
CODES_ROWS(8)

// ---------------------------------------------------------------------------------------------------------------
// A KIVI value token's coding, written into its store's buffers in place: kvquant.quant.integer.quantize of a row
// along channels (groups of G channels, checked=True: every value finite and within fp16's range), in the same
// fp32 operations, each rounded as torch rounds it (explicit .rn: no contraction into an FMA), so the codes,
// scales and zeros are torch's. x: fp16 [B, H, t, D] by element strides (xb, xh, xt; channels contiguous);
// codes [BH, rows, D*BITS/8] and scale/zero fp16 [BH, rows, D/G] from row row0 (rows: the buffers' capacity).
// Grid (t, BH), one warp: lanes take groups, then whole bytes of the packed row (no two lanes write one byte).

__device__ __forceinline__ unsigned short quant_f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// fp32 operations rounded to nearest, never contracted into an FMA and keeping subnormals whatever -ftz says.
#define QUANT_RN(NAME, OP)                                                  \
    __device__ __forceinline__ float NAME(float a, float b) {               \
        float r;                                                            \
        asm(OP " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));                  \
        return r;                                                           \
    }
QUANT_RN(quant_sub, "sub.rn.f32")
QUANT_RN(quant_add, "add.rn.f32")
QUANT_RN(quant_mul, "mul.rn.f32")
QUANT_RN(quant_div, "div.rn.f32")
__device__ __forceinline__ float quant_rint(float a) {  // half to even, as torch.round
    float r;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
// The next fp16 value toward -inf (down) or +inf (up), bit by bit, as torch's nextafter on fp16 (finite input).
__device__ __forceinline__ unsigned short quant_next_down(unsigned short h) {
    if ((h & 0x7FFFu) == 0) return 0x8001u;  // +-0 -> -smallest subnormal
    return (h & 0x8000u) ? (unsigned short)(h + 1) : (unsigned short)(h - 1);
}
__device__ __forceinline__ unsigned short quant_next_up(unsigned short h) {
    if ((h & 0x7FFFu) == 0) return 0x0001u;
    return (h & 0x8000u) ? (unsigned short)(h - 1) : (unsigned short)(h + 1);
}

template <int BITS>
__device__ __forceinline__ void quantize_value_row(const unsigned short* __restrict__ x, long long xb, long long xh,
                                                   long long xt, int H, unsigned char* __restrict__ codes,
                                                   unsigned short* __restrict__ scale, unsigned short* __restrict__ zero,
                                                   int rows, int row0, int D, int G) {
    constexpr int STEPS = (1 << BITS) - 1;
    __shared__ unsigned char code[256];
    const int t = blockIdx.x, bh = blockIdx.y, lane = threadIdx.x;
    const unsigned short* xr = x + (long long)(bh / H) * xb + (long long)(bh % H) * xh + (long long)t * xt;
    const long long row = (long long)bh * rows + row0 + t;
    const int groups = D / G;
    for (int gi = lane; gi < groups; gi += 32) {
        float lo = __int_as_float(0x7f800000), hi = CODES_NEG_INF;
        for (int c = gi * G; c < (gi + 1) * G; ++c) {
            const float v = codes_h2f(xr[c]);
            lo = fminf(lo, v);
            hi = fmaxf(hi, v);
        }
        // _outward_fp16: zero = lo rounded down to fp16, scale = (hi - zero) / STEPS rounded up
        unsigned short zb = quant_f2h(lo);
        if (codes_h2f(zb) > lo) zb = quant_next_down(zb);
        const float zf = codes_h2f(zb);
        unsigned short sb = quant_f2h(quant_div(quant_sub(hi, zf), (float)STEPS));
        if (quant_add(zf, quant_mul((float)STEPS, codes_h2f(sb))) < hi) sb = quant_next_up(sb);
        const float sf = codes_h2f(sb);
        scale[row * groups + gi] = sb;
        zero[row * groups + gi] = zb;
        const float div = sf == 0.0f ? 1.0f : sf;
        for (int c = gi * G; c < (gi + 1) * G; ++c) {
            const float q = quant_rint(quant_div(quant_sub(codes_h2f(xr[c]), zf), div));
            code[c] = (unsigned char)fminf(fmaxf(q, 0.0f), (float)STEPS);
        }
    }
    __syncwarp();
    constexpr int PER = 8 / BITS;
    const int bytes = (D * BITS + 7) / 8;
    for (int j = lane; j < bytes; j += 32) {
        unsigned int v = 0;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int c = j * PER + i;
            if (c < D) v |= (unsigned int)code[c] << (BITS * i);
        }
        codes[row * bytes + j] = (unsigned char)v;
    }
}

#define QUANTIZE_VALUES(BITS)                                                                                         \
    extern "C" __global__ void __launch_bounds__(32) quantize_values_b##BITS(                                         \
        const unsigned short* x, long long xb, long long xh, long long xt, int H, unsigned char* codes,               \
        unsigned short* scale, unsigned short* zero, int rows, int row0, int D, int G) {                              \
        quantize_value_row<BITS>(x, xb, xh, xt, H, codes, scale, zero, rows, row0, D, G);                            \
    }

QUANTIZE_VALUES(2)
QUANTIZE_VALUES(4)
QUANTIZE_VALUES(8)
