// Decode QK^T over the plane layout: each CTA decides every channel's width from max|q| and the
// per-channel max |K| (AlignedKV), or per 64-token block from the block's exponent field
// (AlignedKV+), then loads plane B and C of a (block, channel) row only where the width needs
// them. A skipped plane is never touched; its bits are the fill from read_bits. The tail (the
// newest L mod 64 tokens, fp16) is one more, partial block. FULL=true is the 16-bit control: the
// same code reading every plane of every row, with no width rule.
//
// Grid (ceil(n_units / units_per_cta), B*Hkv), NUM_THREADS (256) threads. A launch takes the R rows
// row0 .. row0+R-1 of R_total. The widths need max|q| over all R_total
// rows: a launch holding only some of them (a chunk too large for shared memory, split by ops.py)
// gets it precomputed in q_max_bits; with q_max_bits null it is taken from the R rows it holds.
//
// The attention mask is applied to the logits written (mask_kind 1: bytes, 0 = masked -> -inf; 2: fp32
// added), at mask[b, head, pos, j] through the element strides of its broadcast view; row rr of a KV
// head is query head kvh * G + rr / q_len at position rr % q_len. Each CTA then writes, per row, the
// (max, sum exp(x - max)) of the logits of its tokens to partial_ml: the split softmax statistics that
// softmax.cu merges by log-sum-exp (ops.merge_softmax_partials is the same arithmetic in torch).
//
// Two kernels do this. qk_* (the tile kernel): a CTA turns each 64-token block into fp16 bits in shared
// memory, a thread per (channel, 16 tokens), then four lanes per (row, token) take the dot products; shared
// memory R*D floats (queries) + 2*D + max(D, 8) ints + D*TILE_STRIDE ushorts (one block, channel-major).
// qk_warp_* (the warp kernel, decode: at most 4 query rows a KV head): each warp takes whole blocks, lane
// (tg, cg) reads tokens 8tg..8tg+7 of channels cg, cg+4, ... straight from the planes (read8: a few byte
// permutes per 8 elements), multiplies in registers, and two shuffles sum the four channel groups; no tile
// and no barrier per block. Same arguments and the same results bit for bit: both sum a logit's channels in
// four groups c mod 4, each in ascending order, then (g0 + g1) + (g2 + g3).
#include "planes.cuh"

#define TILE_STRIDE 66

// e_q[c] = floor(log2 max|q_c|) over all R_total rows and, for the token rule, w_col[c] = the channel's width
// (written to wk by CTA 0); returns the largest e_q + e(max|K_c|), which BLOCKWISE widths are gaps from.
template <bool FULL, bool BLOCKWISE>
__device__ __forceinline__ int key_widths(const float* qs, const unsigned int* __restrict__ q_max_bits,
                                          const unsigned short* __restrict__ k_absmax, int* e_q, int* w_col,
                                          int* scratch, int* __restrict__ wk, int bh, int R, int D, int t12, int t8) {
    int max_p = ZERO_EXPONENT * 2;
    if (!FULL) {
        int local = ZERO_EXPONENT * 2;
        for (int c = threadIdx.x; c < D; c += blockDim.x) {
            unsigned int q_max = 0u;  // max |q| on the magnitude bits: exact, no -ftz flush
            if (q_max_bits != nullptr)
                q_max = q_max_bits[(long long)bh * D + c];
            else
                for (int r = 0; r < R; ++r) q_max = max(q_max, __float_as_uint(qs[r * D + c]) & 0x7FFFFFFFu);
            e_q[c] = floor_log2_bits(q_max);
            const int p = e_q[c] + floor_log2f(half_bits_to_float(k_absmax[(long long)bh * D + c]));
            w_col[c] = p;
            local = max(local, p);
        }
        max_p = block_max_int(local, scratch);
        for (int c = threadIdx.x; c < D; c += blockDim.x) {
            w_col[c] = width_from_gap(max_p - w_col[c], t12, t8);
            if (!BLOCKWISE && wk != nullptr && blockIdx.x == 0) wk[(long long)bh * D + c] = w_col[c];
        }
        __syncthreads();
    }
    return max_p;
}

// Both kernels start alike: this launch's R query rows into shared memory (qs [R * D]), then the key widths'
// inputs (e_q [D], w_col [D], a scratch of max(D, NUM_THREADS / 32) ints); `end` is the first byte after them.
struct QkSetup {
    float* qs;
    int* e_q;
    int* w_col;
    void* end;
    int max_p;
};

template <bool FULL, bool BLOCKWISE>
__device__ __forceinline__ QkSetup qk_setup(float* smem, const float* __restrict__ q,
                                            const unsigned int* __restrict__ q_max_bits,
                                            const unsigned short* __restrict__ k_absmax, int* __restrict__ wk, int R,
                                            int R_total, int row0, int D, int t12, int t8) {
    QkSetup setup;
    setup.qs = smem;
    setup.e_q = (int*)(setup.qs + R * D);
    setup.w_col = setup.e_q + D;
    int* scratch = setup.w_col + D;
    setup.end = scratch + max(D, NUM_THREADS / 32);
    const int bh = blockIdx.y;
    const float* q_rows = q + ((long long)bh * R_total + row0) * D;
    for (int i = threadIdx.x; i < R * D; i += blockDim.x) setup.qs[i] = q_rows[i];
    __syncthreads();
    setup.max_p = key_widths<FULL, BLOCKWISE>(setup.qs, q_max_bits, k_absmax, setup.e_q, setup.w_col, scratch, wk, bh,
                                              R, D, t12, t8);
    return setup;
}

// A (block, channel) row's width: 16 for the control, the channel's for the token rule, or AlignedKV+'s from the
// row's exponent byte (fields 0 count as 1, i.e. 2^-14), which the `writer` thread of the row stores in wk.
template <bool FULL, bool BLOCKWISE>
__device__ __forceinline__ int row_width(const unsigned char* __restrict__ k_exp, const int* e_q, const int* w_col,
                                         int* __restrict__ wk, long long blk, int c, int D, int bh, int nblk, int unit,
                                         int max_p, int t12, int t8, bool writer) {
    if (FULL) return 16;
    if (!BLOCKWISE) return w_col[c];
    const int width = width_from_gap(max_p - (e_q[c] + max((int)k_exp[blk * D + c], 1) - 15), t12, t8);
    if (writer && wk != nullptr) wk[((long long)bh * nblk + unit) * D + c] = width;
    return width;
}

// Logit j of row r (of this launch) scaled, masked and stored.
__device__ __forceinline__ void store_logit(float acc, int j, int r, float* __restrict__ logits, float scaling,
                                            const void* __restrict__ mask, int mask_kind, long long msb,
                                            long long msh, long long msq, long long msn, int G, int q_len, int hkv,
                                            int bh, int row0, int R_total, int L) {
    float x = acc * scaling;
    if (mask_kind != 0) {
        const int rr = row0 + r, head = (bh % hkv) * G + rr / q_len;
        const long long at = (long long)(bh / hkv) * msb + head * msh + (rr % q_len) * msq + j * msn;
        if (mask_kind == 1)
            x = ((const unsigned char*)mask)[at] != 0 ? x : NEG_INF;
        else
            x += ((const float*)mask)[at];
    }
    logits[((long long)bh * R_total + row0 + r) * L + j] = x;
}

// One warp per row over this CTA's tokens [t_begin, t_end) (written by this block: visible after the barrier
// before the call): the row's (max, sum exp(x - max)) into partial_ml.
__device__ __forceinline__ void store_partial_ml(const float* logits, float* __restrict__ partial_ml,
                                                 int bh, int R_total, int row0, int R, int L, int t_begin,
                                                 int t_end) {
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < R; r += blockDim.x >> 5) {
        const float* x = logits + ((long long)bh * R_total + row0 + r) * L;
        float m = NEG_INF;
        for (int j = t_begin + lane; j < t_end; j += 32) m = fmaxf(m, x[j]);
        for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
        float l = 0.0f;
        if (m != NEG_INF)
            for (int j = t_begin + lane; j < t_end; j += 32) l += expf(x[j] - m);
        for (int offset = 16; offset > 0; offset >>= 1) l += __shfl_xor_sync(0xFFFFFFFFu, l, offset);
        if (lane == 0) {
            float* at = partial_ml + (((long long)bh * R_total + row0 + r) * gridDim.x + blockIdx.x) * 2;
            at[0] = m;
            at[1] = l;
        }
    }
}

#define QK_PARAMS                                                                                                 \
    const float *__restrict__ q, const unsigned int *__restrict__ q_max_bits, const unsigned char *__restrict__ k_a, \
        const unsigned char *__restrict__ k_b, const unsigned char *__restrict__ k_c,                             \
        const unsigned short *__restrict__ tail_k, const unsigned short *__restrict__ k_absmax,                   \
        const unsigned char *__restrict__ k_exp, float *__restrict__ logits, int *__restrict__ wk,                \
        unsigned short *__restrict__ keys_out, float *__restrict__ partial_ml, const void *__restrict__ mask,     \
        int mask_kind, long long msb, long long msh, long long msq, long long msn, int G, int q_len, int hkv,    \
        int R, int R_total, int row0, int D, int nblk, int cap_blk, int n_tail, int units_per_cta, float scaling, \
        int t12, int t8
#define QK_ARGS                                                                                                   \
    q, q_max_bits, k_a, k_b, k_c, tail_k, k_absmax, k_exp, logits, wk, keys_out, partial_ml, mask, mask_kind, msb, \
        msh, msq, msn, G, q_len, hkv, R, R_total, row0, D, nblk, cap_blk, n_tail, units_per_cta, scaling, t12, t8
#define LOGIT_ARGS logits, scaling, mask, mask_kind, msb, msh, msq, msn, G, q_len, hkv, bh, row0, R_total, L

template <bool FULL, bool BLOCKWISE>
__device__ __forceinline__ void qk_impl(QK_PARAMS)
{
    extern __shared__ float smem[];
    const QkSetup setup = qk_setup<FULL, BLOCKWISE>(smem, q, q_max_bits, k_absmax, wk, R, R_total, row0, D, t12, t8);
    float* qs = setup.qs;
    const int *e_q = setup.e_q, *w_col = setup.w_col, max_p = setup.max_p;
    unsigned short* tile = (unsigned short*)setup.end;
    const int bh = blockIdx.y;
    const int L = nblk * 64 + n_tail;

    const int n_units = nblk + (n_tail > 0 ? 1 : 0);
    const int first = blockIdx.x * units_per_cta;
    const int last = min(n_units, first + units_per_cta);
    for (int unit = first; unit < last; ++unit) {
        int n_tok = 64;
        if (unit < nblk) {
            const long long blk = (long long)bh * cap_blk + unit;
#pragma unroll 2
            for (int i = threadIdx.x; i < D * 4; i += blockDim.x) {
                const int c = i >> 2, seg = i & 3;
                const int width =
                    row_width<FULL, BLOCKWISE>(k_exp, e_q, w_col, wk, blk, c, D, bh, nblk, unit, max_p, t12, t8, seg == 0);
                const long long row = blk * D + c;
                const uint4 a = *((const uint4*)(k_a + row * 64) + seg);
                uint2 b = make_uint2(0u, 0u), cc = make_uint2(0u, 0u);
                if (width >= 12) b = *((const uint2*)(k_b + row * 32) + seg);
                if (width == 16) cc = *((const uint2*)(k_c + row * 32) + seg);
                const unsigned long long b64 = ((unsigned long long)b.y << 32) | b.x;
                const unsigned long long c64 = ((unsigned long long)cc.y << 32) | cc.x;
                const unsigned int words[4] = {a.x, a.y, a.z, a.w};
                unsigned int* out = (unsigned int*)(tile + c * TILE_STRIDE + seg * 16);
#pragma unroll
                for (int t = 0; t < 16; t += 2) {
                    const unsigned int a0 = (words[t >> 2] >> (8 * (t & 3))) & 0xFFu;
                    const unsigned int a1 = (words[t >> 2] >> (8 * ((t + 1) & 3))) & 0xFFu;
                    const unsigned int lo = (a0 << 8) | (unsigned int)(((b64 >> (4 * t)) & 0xFu) << 4) |
                                            (unsigned int)((c64 >> (4 * t)) & 0xFu);
                    const unsigned int hi = (a1 << 8) | (unsigned int)(((b64 >> (4 * t + 4)) & 0xFu) << 4) |
                                            (unsigned int)((c64 >> (4 * t + 4)) & 0xFu);
                    out[t >> 1] = read_bits(lo, width) | (read_bits(hi, width) << 16);
                }
            }
        } else {
            n_tok = n_tail;
            const unsigned short* src = tail_k + (long long)bh * n_tail * D;
            for (int i = threadIdx.x; i < n_tail * D; i += blockDim.x) {
                const int tok = i / D, c = i - tok * D;
                tile[c * TILE_STRIDE + tok] = src[i];
            }
        }
        __syncthreads();
        if (keys_out != nullptr) {
            for (int i = threadIdx.x; i < n_tok * D; i += blockDim.x) {
                const int tok = i / D, c = i - tok * D;
                keys_out[((long long)bh * L + unit * 64 + tok) * D + c] = tile[c * TILE_STRIDE + tok];
            }
        }
        // Four lanes per (row, token), each a quarter of the channels: every thread has work even for
        // one query row. R * 256 is a multiple of the block, so whole warps reach the shuffles.
        for (int i = threadIdx.x; i < R * 256; i += blockDim.x) {
            const int part = i & 3, tok = (i >> 2) & 63, r = i >> 8;
            const float* qr = qs + r * D;
            float acc = 0.0f;
            if (tok < n_tok)
                for (int c = part; c < D; c += 4) acc += qr[c] * half_bits_to_float(tile[c * TILE_STRIDE + tok]);
            acc += __shfl_xor_sync(0xFFFFFFFFu, acc, 1);
            acc += __shfl_xor_sync(0xFFFFFFFFu, acc, 2);
            if (part == 0 && tok < n_tok) {
                store_logit(acc, unit * 64 + tok, r, LOGIT_ARGS);
            }
        }
        __syncthreads();
    }
    if (partial_ml != nullptr) store_partial_ml(logits, partial_ml, bh, R_total, row0, R, L, first * 64, min(L, last * 64));
}

// The warp kernel (decode: R <= RT <= 4 rows). Warp w of the CTA takes units first + w, first + w + 8, ...;
// in a plane block lane (tg, cg) = (lane & 7, lane >> 3) reads, for channels c = cg, cg + 4, ..., 8 bytes of
// plane A and 4 of B and C (each warp load: 4 adjacent channel rows, contiguous), B only at width >= 12 and C
// only at 16, and accumulates q_r[c] * k[c, 8tg + i] for its 8 tokens; the xor-8 and xor-16 shuffles add the
// four channel groups, and lane (tg, cg) stores tokens 8tg + 2cg and 8tg + 2cg + 1. Rows r >= R of the RT
// accumulated are neither read nor stored.
template <bool FULL, bool BLOCKWISE, int RT>
__device__ __forceinline__ void qk_warp_impl(QK_PARAMS) {
    extern __shared__ float smem[];
    const QkSetup setup = qk_setup<FULL, BLOCKWISE>(smem, q, q_max_bits, k_absmax, wk, R, R_total, row0, D, t12, t8);
    const float* qs = setup.qs;
    const int *e_q = setup.e_q, *w_col = setup.w_col, max_p = setup.max_p;
    const int bh = blockIdx.y;
    const int L = nblk * 64 + n_tail;

    const int lane = threadIdx.x & 31, tg = lane & 7, cg = lane >> 3;
    const int n_units = nblk + (n_tail > 0 ? 1 : 0);
    const int first = blockIdx.x * units_per_cta;
    const int last = min(n_units, first + units_per_cta);
    for (int unit = first + (threadIdx.x >> 5); unit < last; unit += NUM_THREADS / 32) {
        if (unit < nblk) {
            const long long blk = (long long)bh * cap_blk + unit;
            float acc[RT][8];
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] = 0.0f;
#pragma unroll 4
            for (int c = cg; c < D; c += 4) {
                const int width =
                    row_width<FULL, BLOCKWISE>(k_exp, e_q, w_col, wk, blk, c, D, bh, nblk, unit, max_p, t12, t8, tg == 0);
                const long long row = blk * D + c;
                const uint2 a = *((const uint2*)(k_a + row * 64) + tg);
                unsigned int b = 0u, cc = 0u;
                if (width >= 12) b = *((const unsigned int*)(k_b + row * 32) + tg);
                if (width == 16) cc = *((const unsigned int*)(k_c + row * 32) + tg);
                const uint4 h = read8(a, b, cc, width);
                if (keys_out != nullptr) {
                    unsigned short* at = keys_out + ((long long)bh * L + unit * 64 + tg * 8) * D + c;
#pragma unroll
                    for (int i = 0; i < 8; ++i) at[(long long)i * D] = half_of(h, i);
                }
                float k8[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) k8[i] = half_bits_to_float(half_of(h, i));
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    const float qv = r < R ? qs[r * D + c] : 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[r][i] += qv * k8[i];
                }
            }
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc[r][i] += __shfl_xor_sync(0xFFFFFFFFu, acc[r][i], 8);
                    acc[r][i] += __shfl_xor_sync(0xFFFFFFFFu, acc[r][i], 16);
                }
                if (r < R) {
                    const float x0 = cg == 0 ? acc[r][0] : (cg == 1 ? acc[r][2] : (cg == 2 ? acc[r][4] : acc[r][6]));
                    const float x1 = cg == 0 ? acc[r][1] : (cg == 1 ? acc[r][3] : (cg == 2 ? acc[r][5] : acc[r][7]));
                    const int j = unit * 64 + tg * 8 + cg * 2;
                    store_logit(x0, j, r, LOGIT_ARGS);
                    store_logit(x1, j + 1, r, LOGIT_ARGS);
                }
            }
        } else {
            // The tail (fp16, token-major) in the same order: lane (tg, cg) sums channels cg, cg + 4, ... of token
            // 8p + tg for passes p, and the same two shuffles add the groups (the tile kernel's order exactly).
            const unsigned short* src = tail_k + (long long)bh * n_tail * D;
            for (int tok0 = 0; tok0 < n_tail; tok0 += 8) {
                const int tok = tok0 + tg;
                float acc[RT];
#pragma unroll
                for (int r = 0; r < RT; ++r) acc[r] = 0.0f;
                if (tok < n_tail) {
                    for (int c = cg; c < D; c += 4) {
                        const unsigned short bits = src[(long long)tok * D + c];
                        if (keys_out != nullptr) keys_out[((long long)bh * L + unit * 64 + tok) * D + c] = bits;
                        const float k = half_bits_to_float(bits);
#pragma unroll
                        for (int r = 0; r < RT; ++r)
                            if (r < R) acc[r] += qs[r * D + c] * k;
                    }
                }
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], 8);
                    acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], 16);
                    if (r < R && cg == 0 && tok < n_tail) store_logit(acc[r], unit * 64 + tok, r, LOGIT_ARGS);
                }
            }
        }
    }
    __syncthreads();
    if (partial_ml != nullptr) store_partial_ml(logits, partial_ml, bh, R_total, row0, R, L, first * 64, min(L, last * 64));
}

#define QK_ENTRY(NAME, FULL, BLOCKWISE) \
    extern "C" __global__ void __launch_bounds__(NUM_THREADS) NAME(QK_PARAMS) { qk_impl<FULL, BLOCKWISE>(QK_ARGS); }
#define QK_WARP_ENTRY(NAME, FULL, BLOCKWISE, RT)                          \
    extern "C" __global__ void __launch_bounds__(NUM_THREADS) NAME(QK_PARAMS) { \
        qk_warp_impl<FULL, BLOCKWISE, RT>(QK_ARGS);                         \
    }

QK_ENTRY(qk_aligned, false, false)
QK_ENTRY(qk_aligned_blockwise, false, true)
QK_ENTRY(qk_full, true, false)
QK_WARP_ENTRY(qk_warp_aligned_r1, false, false, 1)
QK_WARP_ENTRY(qk_warp_aligned_r2, false, false, 2)
QK_WARP_ENTRY(qk_warp_aligned_r4, false, false, 4)
QK_WARP_ENTRY(qk_warp_blockwise_r1, false, true, 1)
QK_WARP_ENTRY(qk_warp_blockwise_r2, false, true, 2)
QK_WARP_ENTRY(qk_warp_blockwise_r4, false, true, 4)
QK_WARP_ENTRY(qk_warp_full_r1, true, false, 1)
QK_WARP_ENTRY(qk_warp_full_r2, true, false, 2)
QK_WARP_ENTRY(qk_warp_full_r4, true, false, 4)
