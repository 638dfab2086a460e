// Decode QK^T over the plane layout: each CTA decides every channel's width from max|q| and the
// per-channel max |K| (AlignedKV), or per 64-token block from the block's exponent field
// (AlignedKV+), then loads plane B and C of a (block, channel) row only where the width needs
// them. A skipped plane is never touched; its bits are the fill from read_bits. The tail (the
// newest L mod 64 tokens, fp16) is one more, partial block. FULL=true is the 16-bit control: the
// same code reading every plane of every row, with no width rule.
//
// Grid (ceil(n_units / units_per_cta), B*Hkv), NUM_THREADS (256) threads. Dynamic shared memory:
// R*D floats (queries) + 3*D ints + D*TILE_STRIDE ushorts (one dequantised block, channel-major).
// A launch takes the R rows row0 .. row0+R-1 of R_total. The widths need max|q| over all R_total
// rows: a launch holding only some of them (a chunk too large for shared memory, split by ops.py)
// gets it precomputed in q_max_bits; with q_max_bits null it is taken from the R rows it holds.
//
// The attention mask is applied to the logits written (mask_kind 1: bytes, 0 = masked -> -inf; 2: fp32
// added), at mask[b, head, pos, j] through the element strides of its broadcast view; row rr of a KV
// head is query head kvh * G + rr / q_len at position rr % q_len. Each CTA then writes, per row, the
// (max, sum exp(x - max)) of the logits of its tokens to partial_ml: the split softmax statistics that
// softmax.cu merges by log-sum-exp (ops.merge_softmax_partials is the same arithmetic in torch).
#include "planes.cuh"

#define TILE_STRIDE 66

template <bool FULL, bool BLOCKWISE>
__device__ __forceinline__ void qk_impl(
    const float* __restrict__ q,               // [BH, R_total, D]
    const unsigned int* __restrict__ q_max_bits,  // [BH, D] max |q| bits over the R_total rows, or null
    const unsigned char* __restrict__ k_a,      // [BH, cap_blk, D, 64]
    const unsigned char* __restrict__ k_b,      // [BH, cap_blk, D, 32]
    const unsigned char* __restrict__ k_c,      // [BH, cap_blk, D, 32]
    const unsigned short* __restrict__ tail_k,  // [BH, n_tail, D] fp16 bits
    const unsigned short* __restrict__ k_absmax,// [BH, D] fp16 bits
    const unsigned char* __restrict__ k_exp,    // [BH, cap_blk, D] (BLOCKWISE)
    float* __restrict__ logits,                 // [BH, R_total, L]
    int* __restrict__ wk,                       // [BH, D] or [BH, nblk, D]; null: not written
    unsigned short* __restrict__ keys_out,      // [BH, L, D] fp16 bits of what was read; null: not written
    float* __restrict__ partial_ml,             // [BH, R_total, gridDim.x, 2]: (max, sum exp) per CTA; or null
    const void* __restrict__ mask,              // null, bytes (kind 1) or fp32 (kind 2)
    int mask_kind, long long msb, long long msh, long long msq, long long msn, int G, int q_len, int hkv,
    int R, int R_total, int row0, int D, int nblk, int cap_blk, int n_tail, int units_per_cta, float scaling,
    int t12, int t8)
{
    extern __shared__ float smem[];
    float* qs = smem;                                   // [R * D]
    int* e_q = (int*)(qs + R * D);                      // [D]
    int* w_col = e_q + D;                               // [D]
    int* scratch = w_col + D;                           // [D] (>= NUM_THREADS / 32)
    unsigned short* tile = (unsigned short*)(scratch + max(D, NUM_THREADS / 32));

    const int bh = blockIdx.y;
    const int L = nblk * 64 + n_tail;
    const float* q_rows = q + ((long long)bh * R_total + row0) * D;
    for (int i = threadIdx.x; i < R * D; i += blockDim.x) qs[i] = q_rows[i];
    __syncthreads();

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
                int width = 16;
                if (!FULL) {
                    if (BLOCKWISE) {
                        const int field = max((int)k_exp[blk * D + c], 1);
                        width = width_from_gap(max_p - (e_q[c] + field - 15), t12, t8);
                        if (seg == 0 && wk != nullptr) wk[((long long)bh * nblk + unit) * D + c] = width;
                    } else {
                        width = w_col[c];
                    }
                }
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
                const int j = unit * 64 + tok;
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
        }
        __syncthreads();
    }
    if (partial_ml == nullptr) return;
    // One warp per row over this CTA's tokens (written above by this block: visible after the barrier).
    const int lane = threadIdx.x & 31, t_begin = first * 64, t_end = min(L, last * 64);
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

#define QK_ENTRY(NAME, FULL, BLOCKWISE)                                                                           \
    extern "C" __global__ void __launch_bounds__(NUM_THREADS) NAME(                                               \
        const float* q, const unsigned int* q_max_bits, const unsigned char* k_a, const unsigned char* k_b,       \
        const unsigned char* k_c, const unsigned short* tail_k, const unsigned short* k_absmax,                   \
        const unsigned char* k_exp, float* logits, int* wk, unsigned short* keys_out, float* partial_ml,          \
        const void* mask, int mask_kind, long long msb, long long msh, long long msq, long long msn, int G,       \
        int q_len, int hkv, int R, int R_total, int row0, int D, int nblk, int cap_blk, int n_tail,               \
        int units_per_cta, float scaling, int t12, int t8) {                                                      \
        qk_impl<FULL, BLOCKWISE>(q, q_max_bits, k_a, k_b, k_c, tail_k, k_absmax, k_exp, logits, wk, keys_out,     \
                                 partial_ml, mask, mask_kind, msb, msh, msq, msn, G, q_len, hkv, R, R_total,      \
                                 row0, D, nblk, cap_blk, n_tail, units_per_cta, scaling, t12, t8);                \
    }

QK_ENTRY(qk_aligned, false, false)
QK_ENTRY(qk_aligned_blockwise, false, true)
QK_ENTRY(qk_full, true, false)
