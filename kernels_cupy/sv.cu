// Decode SV over the plane layout, split over CTAs, partials merged by the last CTA of each KV head.
//
// The scores are probabilities already normalised over the whole row (softmax.cu), so the merge of the
// splits is a plain sum, taken in split order (deterministic). Three modes share one body:
// - MODE_BLOCK (kvquant.alignment.block_value_widths): a warp takes 32 consecutive tokens, which lie in
//   one block of value_block (a multiple of 32) tokens; the block's width comes first, from v_exp, e(O_est)
//   and the largest score of the block's tokens over every row, so all 32 tokens are read at one width
//   (warp-uniform) and planes A, B and C are loaded together, never one after the other.
// - MODE_TOKEN (kvquant.alignment.value_widths, the paper): each token's width from its plane-A row, then B/C.
// - MODE_FULL: the 16-bit control, every plane, no rule.
//
// PERM (the `_p` kernels) assembles a lane's fp16 bits 8 at a time with byte permutes (planes.cuh read8)
// instead of an element at a time (read_bits): the same bits, fewer instructions.
//
// Grid (n_chunks, BH), NUM_THREADS threads; dynamic shared memory D ints + (NUM_THREADS / 32) * RC * D floats.
// A lane holds CPT channels (16: one 16-byte load of plane A and 8 of B and C; 8 where D is not a
// multiple of 16); seg lanes (a power of two >= D / CPT) read one token row, so a warp reads 32 / seg
// consecutive rows per step, one contiguous run of each plane. Rows are accumulated RC at a time (the
// CTA's tokens re-read for each group of RC rows).
#include "planes.cuh"

#define MODE_FULL 0
#define MODE_TOKEN 1
#define MODE_BLOCK 2
// Token steps of a warp whose loads are in flight together (the paper's rule loads B/C only after A:
// fewer steps keep its registers unspilled).
#define STEPS_OF(MODE) ((MODE) == MODE_TOKEN ? 2 : 4)

template <int CPT>
struct Planes;
template <>
struct Planes<16> {
    typedef uint4 A;
    typedef uint2 BC;
};
template <>
struct Planes<8> {
    typedef uint2 A;
    typedef unsigned int BC;
};

__device__ __forceinline__ unsigned int byte_of(const uint4& a, int i) {
    const unsigned int w = i < 4 ? a.x : (i < 8 ? a.y : (i < 12 ? a.z : a.w));
    return (w >> (8 * (i & 3))) & 0xFFu;
}
__device__ __forceinline__ unsigned int byte_of(const uint2& a, int i) { return ((i < 4 ? a.x : a.y) >> (8 * (i & 3))) & 0xFFu; }
__device__ __forceinline__ unsigned int nibble_of(const uint2& b, int i) { return ((i < 8 ? b.x : b.y) >> (4 * (i & 7))) & 0xFu; }
__device__ __forceinline__ unsigned int nibble_of(const unsigned int& b, int i) { return (b >> (4 * i)) & 0xFu; }

// A lane's CPT plane elements read at `width` as fp16 bits (read8, eight at a time).
__device__ __forceinline__ void read_row(const uint4& a, const uint2& b, const uint2& c, int width,
                                         unsigned short* bits) {
    const uint4 lo = read8(make_uint2(a.x, a.y), b.x, c.x, width), hi = read8(make_uint2(a.z, a.w), b.y, c.y, width);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        bits[i] = half_of(lo, i);
        bits[8 + i] = half_of(hi, i);
    }
}
__device__ __forceinline__ void read_row(const uint2& a, const unsigned int& b, const unsigned int& c, int width,
                                         unsigned short* bits) {
    const uint4 w = read8(a, b, c, width);
#pragma unroll
    for (int i = 0; i < 8; ++i) bits[i] = half_of(w, i);
}

// fp16 bits of CPT tail channels (fp16 in memory): 16-byte loads.
template <int CPT>
__device__ __forceinline__ void load_tail(const unsigned short* at, unsigned short* bits) {
#pragma unroll
    for (int q = 0; q < CPT / 8; ++q) {
        const uint4 t = *((const uint4*)at + q);
        const unsigned int w[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) bits[q * 8 + i] = (unsigned short)((w[i >> 1] >> (16 * (i & 1))) & 0xFFFFu);
    }
}

// The block rule's width of the block holding token blk_tok0 (its first token), the same in every lane:
// gap = min_c (e_o[c] - v_exp[blk, c]) - e(max of the block's scores over all rows); no contribution -> 8.
__device__ __forceinline__ int block_width(const float* s_head, int R, int L, const unsigned char* v_exp_bh,
                                           const int* e_sh, int D, int blk_tok0, int value_block, int t12,
                                           int t8, int lane) {
    const unsigned char* ex = v_exp_bh + (long long)(blk_tok0 / value_block) * D;
    int gap_c = 0x7FFFFFFF;
    for (int c = lane; c < D; c += 32) gap_c = min(gap_c, e_sh[c] - (int)ex[c]);
    int s_max = 0;  // scores are >= 0: their bits order as they do (no -ftz flush)
    for (int t = lane; t < value_block; t += 32)
        for (int r = 0; r < R; ++r) s_max = max(s_max, (int)__float_as_uint(s_head[(long long)r * L + blk_tok0 + t]));
    gap_c = warp_min_int(gap_c);
    s_max = warp_max_int(s_max);
    const int gap = s_max == 0 ? NO_CONTRIBUTION : gap_c - floor_log2_bits((unsigned int)s_max);
    return width_from_gap(gap, t12, t8);
}

template <int RC, int CPT, int MODE, bool PERM>
__device__ __forceinline__ void sv_impl(
    const float* __restrict__ scores,           // [BH, R, L] probabilities
    const unsigned char* __restrict__ v_a,      // [BH, n_full, D]
    const unsigned char* __restrict__ v_b,      // [BH, n_full, D / 2]
    const unsigned char* __restrict__ v_c,      // [BH, n_full, D / 2]
    const unsigned short* __restrict__ tail_v,  // [BH, n_tail, D] fp16 bits
    const unsigned char* __restrict__ v_exp,    // [BH, n_full / value_block, D] (MODE_BLOCK)
    const int* __restrict__ e_o,                // [BH, D]: e(O_est) + 15 (MODE_BLOCK, MODE_TOKEN)
    float* __restrict__ partial,                // [BH, n_chunks, R, D]
    float* __restrict__ out,                    // [BH, R, D]
    unsigned int* __restrict__ counter,         // [BH], zero before and after
    int* __restrict__ wv,                       // [BH, n_full]; null: not written
    unsigned short* __restrict__ values_out,    // [BH, L, D] fp16 bits of what was read; null: not written
    int R, int D, int seg, int n_full, int n_tail, int tokens_per_cta, int value_block, int t12, int t8)
{
    typedef typename Planes<CPT>::A AType;
    typedef typename Planes<CPT>::BC BCType;
    constexpr int STEPS = STEPS_OF(MODE);
    extern __shared__ int shared[];
    __shared__ int last_flag;
    int* e_sh = shared;                   // [D]
    float* sums = (float*)(shared + D);   // [NUM_THREADS / 32][RC * D]

    const int bh = blockIdx.y, chunk = blockIdx.x, n_chunks = gridDim.x;
    const int L = n_full + n_tail;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int seg_lane = lane & (seg - 1), slot = lane / seg, per_step = 32 / seg;
    const int c0 = seg_lane * CPT;
    const bool active = c0 < D;

    if (MODE != MODE_FULL)
        for (int c = threadIdx.x; c < D; c += blockDim.x) e_sh[c] = e_o[(long long)bh * D + c];
    __syncthreads();

    const float* s_head = scores + (long long)bh * R * L;
    const unsigned char* v_exp_bh = MODE == MODE_BLOCK ? v_exp + (long long)bh * (n_full / value_block) * D : v_exp;
    const int begin = chunk * tokens_per_cta, end = min(L, begin + tokens_per_cta);
    for (int r0 = 0; r0 < R; r0 += RC) {
        float acc[RC][CPT];
#pragma unroll
        for (int r = 0; r < RC; ++r)
#pragma unroll
            for (int i = 0; i < CPT; ++i) acc[r][i] = 0.0f;

        // Warp groups of 32 tokens: n_full and tokens_per_cta are multiples of 64, so a group is all plane
        // tokens (and then inside [begin, end)) or all tail tokens.
        for (int g0 = begin + warp * 32; g0 < end; g0 += n_warps * 32) {
            const bool plane = g0 < n_full;
            int group_width = 16;
            if (MODE == MODE_BLOCK && plane) {
                group_width = block_width(s_head, R, L, v_exp_bh, e_sh, D, g0 - g0 % value_block, value_block, t12,
                                          t8, lane);
                if (wv != nullptr && r0 == 0) wv[(long long)bh * n_full + g0 + lane] = group_width;
            }
            for (int s0 = 0; s0 < seg; s0 += STEPS) {
                AType a[STEPS];
                BCType b[STEPS], c[STEPS];
                int width[STEPS];
                bool valid[STEPS];
#pragma unroll
                for (int u = 0; u < STEPS; ++u) {
                    const int j = g0 + (s0 + u) * per_step + slot;
                    valid[u] = s0 + u < seg && j < end;
                    width[u] = group_width;
                    a[u] = AType{};
                    b[u] = BCType{};
                    c[u] = BCType{};
                    if (plane && valid[u] && active) a[u] = *(const AType*)(v_a + ((long long)bh * n_full + j) * D + c0);
                }
                if (MODE == MODE_TOKEN && plane) {
#pragma unroll
                    for (int u = 0; u < STEPS; ++u) {
                        const int j = g0 + (s0 + u) * per_step + slot;
                        int gap_c = 0x7FFFFFFF;
                        if (valid[u] && active)
#pragma unroll
                            for (int i = 0; i < CPT; ++i) gap_c = min(gap_c, e_sh[c0 + i] - plane_a_field(byte_of(a[u], i)));
                        for (int offset = seg >> 1; offset > 0; offset >>= 1)  // every lane: no divergence here
                            gap_c = min(gap_c, __shfl_xor_sync(0xFFFFFFFFu, gap_c, offset));
                        if (valid[u]) {
                            unsigned int s_max = 0u;
                            for (int r = 0; r < R; ++r) s_max = max(s_max, __float_as_uint(s_head[(long long)r * L + j]));
                            const int gap = s_max == 0u ? NO_CONTRIBUTION : gap_c - floor_log2_bits(s_max);
                            width[u] = width_from_gap(gap, t12, t8);
                            if (wv != nullptr && r0 == 0 && seg_lane == 0) wv[(long long)bh * n_full + j] = width[u];
                        }
                    }
                }
                if (plane) {
#pragma unroll
                    for (int u = 0; u < STEPS; ++u) {
                        const int j = g0 + (s0 + u) * per_step + slot;
                        const long long at = ((long long)bh * n_full + j) * (D / 2) + c0 / 2;
                        if (valid[u] && active && width[u] >= 12) b[u] = *(const BCType*)(v_b + at);
                        if (valid[u] && active && width[u] == 16) c[u] = *(const BCType*)(v_c + at);
                    }
                }
#pragma unroll
                for (int u = 0; u < STEPS; ++u) {
                    const int j = g0 + (s0 + u) * per_step + slot;
                    if (!valid[u] || !active) continue;
                    unsigned short bits[CPT];
                    if (plane && PERM) {
                        read_row(a[u], b[u], c[u], width[u], bits);
                    } else if (plane) {
#pragma unroll
                        for (int i = 0; i < CPT; ++i) {
                            const unsigned int kept = (byte_of(a[u], i) << 8) | (nibble_of(b[u], i) << 4) | nibble_of(c[u], i);
                            bits[i] = (unsigned short)read_bits(kept, width[u]);
                        }
                    } else {
                        load_tail<CPT>(tail_v + ((long long)bh * n_tail + (j - n_full)) * D + c0, bits);
                    }
                    if (values_out != nullptr && r0 == 0)
#pragma unroll
                        for (int i = 0; i < CPT; ++i) values_out[((long long)bh * L + j) * D + c0 + i] = bits[i];
#pragma unroll
                    for (int r = 0; r < RC; ++r) {
                        const float s = r0 + r < R ? s_head[(long long)(r0 + r) * L + j] : 0.0f;
#pragma unroll
                        for (int i = 0; i < CPT; ++i) acc[r][i] += s * half_bits_to_float(bits[i]);
                    }
                }
            }
        }

        // The lanes holding the same channels (one per token slot), then the warps of the CTA, in order.
#pragma unroll
        for (int r = 0; r < RC; ++r)
#pragma unroll
            for (int i = 0; i < CPT; ++i)
                for (int offset = 16; offset >= seg; offset >>= 1)
                    acc[r][i] += __shfl_xor_sync(0xFFFFFFFFu, acc[r][i], offset);
        if (slot == 0 && active)
#pragma unroll
            for (int r = 0; r < RC; ++r)
#pragma unroll
                for (int i = 0; i < CPT; ++i) sums[(warp * RC + r) * D + c0 + i] = acc[r][i];
        __syncthreads();
        for (int i = threadIdx.x; i < RC * D; i += blockDim.x) {
            const int r = i / D, ch = i - r * D;
            if (r0 + r >= R) continue;
            float total = 0.0f;
            for (int w = 0; w < n_warps; ++w) total += sums[w * RC * D + i];
            partial[(((long long)bh * n_chunks + chunk) * R + r0 + r) * D + ch] = total;
        }
        __syncthreads();  // sums is reused by the next group of rows
    }

    if (!last_to_finish(counter + bh, (unsigned int)n_chunks, &last_flag)) return;
    for (int i = threadIdx.x; i < R * D; i += blockDim.x) {  // the splits summed in split order
        float total = 0.0f;
        for (int ch = 0; ch < n_chunks; ++ch) total += load_cg(partial + ((long long)bh * n_chunks + ch) * R * D + i);
        out[(long long)bh * R * D + i] = total;
    }
    if (threadIdx.x == 0) counter[bh] = 0u;
}

// sv_token_r1_c16_p spills 12 bytes at ptxas's own register choice (64): it asks for two CTAs a SM, which lets
// ptxas take 112 registers; 0 (every other kernel) asks for nothing.
#define SV_MIN_CTAS(RC, CPT, MODE, PERM) ((MODE) == MODE_TOKEN && (PERM) && (RC) == 1 && (CPT) == 16 ? 2 : 0)
#define SV_ENTRY(NAME, RC, CPT, MODE, PERM)                                                                     \
    extern "C" __global__ void __launch_bounds__(NUM_THREADS, SV_MIN_CTAS(RC, CPT, MODE, PERM)) NAME(                    \
        const float* scores, const unsigned char* v_a, const unsigned char* v_b, const unsigned char* v_c,      \
        const unsigned short* tail_v, const unsigned char* v_exp, const int* e_o, float* partial, float* out,   \
        unsigned int* counter, int* wv, unsigned short* values_out, int R, int D, int seg, int n_full,          \
        int n_tail, int tokens_per_cta, int value_block, int t12, int t8) {                                     \
        sv_impl<RC, CPT, MODE, PERM>(scores, v_a, v_b, v_c, tail_v, v_exp, e_o, partial, out, counter, wv,            \
                               values_out, R, D, seg, n_full, n_tail, tokens_per_cta, value_block, t12, t8);    \
    }

#define SV_ENTRIES(RC, SUFFIX, PERM)                                        \
    SV_ENTRY(sv_full_r##RC##_c16##SUFFIX, RC, 16, MODE_FULL, PERM)          \
    SV_ENTRY(sv_full_r##RC##_c8##SUFFIX, RC, 8, MODE_FULL, PERM)            \
    SV_ENTRY(sv_token_r##RC##_c16##SUFFIX, RC, 16, MODE_TOKEN, PERM)        \
    SV_ENTRY(sv_token_r##RC##_c8##SUFFIX, RC, 8, MODE_TOKEN, PERM)          \
    SV_ENTRY(sv_block_r##RC##_c16##SUFFIX, RC, 16, MODE_BLOCK, PERM)        \
    SV_ENTRY(sv_block_r##RC##_c8##SUFFIX, RC, 8, MODE_BLOCK, PERM)

SV_ENTRIES(1, , false)
SV_ENTRIES(2, , false)
SV_ENTRIES(4, , false)
SV_ENTRIES(1, _p, true)
SV_ENTRIES(2, _p, true)
SV_ENTRIES(4, _p, true)
