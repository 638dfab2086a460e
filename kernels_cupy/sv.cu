// Decode SV over the plane layout, with AlignedKV's value rule (kvquant.alignment.value_widths).
//
// 1. topk_partial / value_exponents: the strided top-k of the scores (argmax of each residue class
//    j mod k, first index on ties), O_est[c] = sum_r s_r * |v8(j_r, c)| from plane A only, summed in
//    the reference's fixed pairwise order (PairwiseSum), and e(O_est) per channel, minimised over
//    the query rows sharing the KV head.
// 2. sv_*: one token row per lane segment; plane A is loaded, the row's gap
//    min_c[e(O_est[c]) - e(v8)] - e(max_rows s_j) decides its width, and only then are planes B
//    and C loaded where the width needs them. Partial sums per CTA; the caller adds the CTAs up.
//    sv_full_* is the 16-bit control: the same code, every plane, no rule.
#include "planes.cuh"

// Grid (n_splits, BH*R), blockDim a multiple of 32 >= min(k, 256). Split s scans rows i of the
// strided view [ceil(L/k), k] in [s*rows_per_split, (s+1)*rows_per_split).
extern "C" __global__ void topk_partial(
    const float* __restrict__ scores,  // [BH*R, L]
    float* __restrict__ best_val,      // [BH*R, n_splits, k]
    int* __restrict__ best_idx,        // [BH*R, n_splits, k]
    int L, int k, int rows_per_split)
{
    const int row = blockIdx.y, split = blockIdx.x, n_splits = gridDim.x;
    const float* s = scores + (long long)row * L;
    const int i0 = split * rows_per_split;
    for (int r = threadIdx.x; r < k; r += blockDim.x) {
        unsigned int best = 0u;  // scores are >= 0, so their bits order as they do (and -ftz cannot tie them)
        int index = -1;
        const int n_i = r < L ? (L - 1 - r) / k + 1 : 0;  // strided rows i with i*k + r < L
        const int i_end = min(i0 + rows_per_split, n_i);
#pragma unroll 4
        for (int i = i0; i < i_end; ++i) {
            const int j = i * k + r;
            const unsigned int value = __float_as_uint(s[j]);
            if (index < 0 || value > best) {
                best = value;
                index = j;
            }
        }
        const long long out = ((long long)row * n_splits + split) * k + r;
        best_val[out] = __uint_as_float(best);
        best_idx[out] = index;
    }
}

// O_est's fixed summation order (kernels_cupy.reference.pairwise_sum): adjacent pairs, zero-padded
// to a power of two, streamed with one pending partial per tree level (a binary counter: adding
// the n-th addend merges the levels whose bits carry). Levels are indexed by unrolled constants so
// they stay in registers; PAIRWISE_LEVELS levels take up to 2^PAIRWISE_LEVELS - 1 addends.
#define PAIRWISE_LEVELS 16
struct PairwiseSum {
    float level[PAIRWISE_LEVELS];
    unsigned int count;
    __device__ void init() {
        count = 0u;
#pragma unroll
        for (int j = 0; j < PAIRWISE_LEVELS; ++j) level[j] = 0.0f;
    }
    __device__ void add(float x) {
        float carry = x;
        bool pending = true;  // no break: a loop of constant indices keeps level[] in registers
#pragma unroll
        for (int j = 0; j < PAIRWISE_LEVELS; ++j) {
            if (pending) {
                if ((count >> j) & 1u) {
                    carry = add_exact_rn(level[j], carry);  // left subtree + right subtree
                } else {
                    level[j] = carry;
                    pending = false;
                }
            }
        }
        ++count;
    }
    // The pending partials, lowest level first: the zero padding leaves each one the right
    // operand of the next higher one.
    __device__ float result() const {
        float out = 0.0f;
        bool any = false;
#pragma unroll
        for (int j = 0; j < PAIRWISE_LEVELS; ++j) {
            if ((count >> j) & 1u) {
                out = any ? add_exact_rn(level[j], out) : level[j];
                any = true;
            }
        }
        return out;
    }
};

// Grid (BH), NUM_THREADS threads, dynamic shared memory R*k*(4+4) bytes for the R rows
// row0 .. row0+R-1 of R_total. Row chunks (row0 > 0) fold their minimum into what the earlier
// chunks wrote, so a chunk too large for shared memory is several launches on one stream.
extern "C" __global__ void __launch_bounds__(NUM_THREADS) value_exponents(
    const float* __restrict__ best_val,   // [BH*R_total, n_splits, k]
    const int* __restrict__ best_idx,     // [BH*R_total, n_splits, k]
    const unsigned char* __restrict__ v_a,      // [BH, cap_tok, D]
    const unsigned short* __restrict__ tail_v,  // [BH, n_tail, D] fp16 bits
    int* __restrict__ e_o,                // [BH, D]: e(O_est) + 15, min over rows, clamped
    int R, int R_total, int row0, int D, int k, int n_splits, int n_full, int cap_tok, int n_tail)
{
    extern __shared__ float smem[];
    const int k_eff = min(k, n_full + n_tail);
    float* top_s = smem;                  // [R, k]
    int* top_j = (int*)(top_s + R * k);   // [R, k]
    const int bh = blockIdx.x;
    for (int i = threadIdx.x; i < R * k_eff; i += blockDim.x) {
        const int r = i / k_eff, res = i - r * k_eff;
        unsigned int best = 0u;
        int index = -1;
        for (int split = 0; split < n_splits; ++split) {
            const long long at = (((long long)bh * R_total + row0 + r) * n_splits + split) * k + res;
            const int j = best_idx[at];
            const unsigned int value = __float_as_uint(best_val[at]);
            if (j >= 0 && (index < 0 || value > best)) {
                best = value;
                index = j;
            }
        }
        top_s[r * k + res] = __uint_as_float(best);
        top_j[r * k + res] = index;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        int e_min = 0x7FFFFFFF;
        for (int r = 0; r < R; ++r) {
            PairwiseSum sum;
            sum.init();
            for (int res = 0; res < k_eff; ++res) {
                const int j = top_j[r * k + res];
                const unsigned int a = j < n_full ? v_a[((long long)bh * cap_tok + j) * D + c]
                                                  : (tail_v[((long long)bh * n_tail + (j - n_full)) * D + c] >> 8);
                sum.add(mul_exact_rn(top_s[r * k + res], high_byte_magnitude(a)));
            }
            e_min = min(e_min, floor_log2f(sum.result()));
        }
        const int e = max(-EO_CLAMP, min(EO_CLAMP, e_min)) + 15;
        const long long at = (long long)bh * D + c;
        e_o[at] = row0 > 0 ? min(e, e_o[at]) : e;
    }
}

template <int CPT>
struct Lanes;
template <>
struct Lanes<4> {
    typedef unsigned int A;
    typedef unsigned short BC;
    typedef uint2 Tail;
};
template <>
struct Lanes<8> {
    typedef uint2 A;
    typedef unsigned int BC;
    typedef uint4 Tail;
};

template <int CPT>
__device__ __forceinline__ unsigned int byte_of(const typename Lanes<CPT>::A& a, int i);
template <>
__device__ __forceinline__ unsigned int byte_of<4>(const unsigned int& a, int i) { return (a >> (8 * i)) & 0xFFu; }
template <>
__device__ __forceinline__ unsigned int byte_of<8>(const uint2& a, int i) {
    return ((i < 4 ? a.x : a.y) >> (8 * (i & 3))) & 0xFFu;
}

template <int CPT>
__device__ __forceinline__ unsigned short half_of(const typename Lanes<CPT>::Tail& t, int i);
template <>
__device__ __forceinline__ unsigned short half_of<4>(const uint2& t, int i) {
    return (unsigned short)(((i < 2 ? t.x : t.y) >> (16 * (i & 1))) & 0xFFFFu);
}
template <>
__device__ __forceinline__ unsigned short half_of<8>(const uint4& t, int i) {
    const unsigned int w = i < 2 ? t.x : (i < 4 ? t.y : (i < 6 ? t.z : t.w));
    return (unsigned short)((w >> (16 * (i & 1))) & 0xFFFFu);
}

#define TOKENS_PER_STEP 4

// Grid (n_chunks, BH), NUM_THREADS threads; dynamic shared memory D ints + NUM_THREADS/32 * RC * D floats.
// Lanes are grouped in segments of SEG (a power of two >= D / CPT); a segment reads one token row
// per step, lane l holding channels [l*CPT, l*CPT + CPT). Rows row0 .. row0+RC-1 are accumulated;
// the width rule looks at all R rows. wv is written by the chunk with row0 == 0.
template <int RC, int CPT, bool FULL>
__device__ __forceinline__ void sv_impl(
    const float* __restrict__ scores,           // [BH, R, L]
    const unsigned char* __restrict__ v_a,      // [BH, cap_tok, D]
    const unsigned char* __restrict__ v_b,      // [BH, cap_tok, D / 2]
    const unsigned char* __restrict__ v_c,      // [BH, cap_tok, D / 2]
    const unsigned short* __restrict__ tail_v,  // [BH, n_tail, D]
    const int* __restrict__ e_o,                // [BH, D]
    float* __restrict__ partial,                // [BH, n_chunks, R, D]
    int* __restrict__ wv,                       // [BH, n_full]; null: not written
    unsigned short* __restrict__ values_out,    // [BH, L, D] fp16 bits of what was read; null: not written
    int R, int row0, int D, int seg, int n_full, int cap_tok, int n_tail, int tokens_per_cta, int t12, int t8)
{
    typedef typename Lanes<CPT>::A AType;
    typedef typename Lanes<CPT>::BC BCType;
    typedef typename Lanes<CPT>::Tail TailType;
    extern __shared__ int shared[];
    int* e_s = shared;                            // [D]
    float* sums = (float*)(shared + D);           // [NUM_THREADS / 32][RC * D]

    const int bh = blockIdx.y, chunk = blockIdx.x, n_chunks = gridDim.x;
    const int L = n_full + n_tail;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int seg_lane = lane & (seg - 1);
    const int slot = threadIdx.x / seg, n_slots = blockDim.x / seg;
    const int lanes_used = D / CPT;
    const bool active = seg_lane < lanes_used;
    const int c0 = seg_lane * CPT;
    const unsigned int seg_mask = seg == 32 ? 0xFFFFFFFFu : (((1u << seg) - 1u) << (lane & ~(seg - 1)));

    if (!FULL)
        for (int c = threadIdx.x; c < D; c += blockDim.x) e_s[c] = e_o[(long long)bh * D + c];
    __syncthreads();

    float acc[RC][CPT];
#pragma unroll
    for (int r = 0; r < RC; ++r)
#pragma unroll
        for (int i = 0; i < CPT; ++i) acc[r][i] = 0.0f;

    const float* s_head = scores + (long long)bh * R * L;
    const int begin = chunk * tokens_per_cta;
    const int end = min(L, begin + tokens_per_cta);
    for (int base = begin + slot; base < end; base += n_slots * TOKENS_PER_STEP) {
        AType a[TOKENS_PER_STEP] = {};
        int width[TOKENS_PER_STEP];
#pragma unroll
        for (int u = 0; u < TOKENS_PER_STEP; ++u) {
            const int j = base + u * n_slots;
            width[u] = 16;
            if (j < min(end, n_full) && active) a[u] = *(const AType*)(v_a + ((long long)bh * cap_tok + j) * D + c0);
        }
        if (!FULL) {
#pragma unroll
            for (int u = 0; u < TOKENS_PER_STEP; ++u) {
                const int j = base + u * n_slots;
                int gap_c = 0x7FFFFFFF;
                if (j < min(end, n_full) && active)
#pragma unroll
                    for (int i = 0; i < CPT; ++i) gap_c = min(gap_c, e_s[c0 + i] - plane_a_field(byte_of<CPT>(a[u], i)));
                for (int offset = seg >> 1; offset > 0; offset >>= 1)
                    gap_c = min(gap_c, __shfl_xor_sync(seg_mask, gap_c, offset));
                if (j < min(end, n_full)) {
                    unsigned int s_max = 0u;  // scores are >= 0: their bits order as they do; no -ftz flush
                    for (int r = 0; r < R; ++r) s_max = max(s_max, __float_as_uint(s_head[(long long)r * L + j]));
                    const int gap = s_max == 0u ? NO_CONTRIBUTION : gap_c - floor_log2_bits(s_max);
                    width[u] = width_from_gap(gap, t12, t8);
                    if (wv != nullptr && seg_lane == 0) wv[(long long)bh * n_full + j] = width[u];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < TOKENS_PER_STEP; ++u) {
            const int j = base + u * n_slots;
            if (j >= end || !active) continue;
            float value[CPT];
            unsigned short bits[CPT];
            if (j < n_full) {
                const long long row = (long long)bh * cap_tok + j;
                BCType b = 0, c = 0;
                if (width[u] >= 12) b = *(const BCType*)(v_b + row * (D / 2) + c0 / 2);
                if (width[u] == 16) c = *(const BCType*)(v_c + row * (D / 2) + c0 / 2);
#pragma unroll
                for (int i = 0; i < CPT; ++i) {
                    const unsigned int kept = (byte_of<CPT>(a[u], i) << 8) |
                                              (unsigned int)(((b >> (4 * i)) & 0xFu) << 4) |
                                              (unsigned int)((c >> (4 * i)) & 0xFu);
                    bits[i] = (unsigned short)read_bits(kept, width[u]);
                }
            } else {
                const TailType t = *(const TailType*)(tail_v + ((long long)bh * n_tail + (j - n_full)) * D + c0);
#pragma unroll
                for (int i = 0; i < CPT; ++i) bits[i] = half_of<CPT>(t, i);
            }
#pragma unroll
            for (int i = 0; i < CPT; ++i) value[i] = half_bits_to_float(bits[i]);
            if (values_out != nullptr && row0 == 0)
#pragma unroll
                for (int i = 0; i < CPT; ++i) values_out[((long long)bh * L + j) * D + c0 + i] = bits[i];
#pragma unroll
            for (int r = 0; r < RC; ++r) {
                const float s = s_head[(long long)(row0 + r) * L + j];
#pragma unroll
                for (int i = 0; i < CPT; ++i) acc[r][i] += s * value[i];
            }
        }
    }

    // Sum the segments of each warp, then the warps of the CTA.
#pragma unroll
    for (int r = 0; r < RC; ++r)
#pragma unroll
        for (int i = 0; i < CPT; ++i)
            for (int offset = 16; offset >= seg; offset >>= 1)
                acc[r][i] += __shfl_xor_sync(0xFFFFFFFFu, acc[r][i], offset);
    if (lane < seg && active)
#pragma unroll
        for (int r = 0; r < RC; ++r)
#pragma unroll
            for (int i = 0; i < CPT; ++i) sums[(warp * RC + r) * D + c0 + i] = acc[r][i];
    __syncthreads();
    const int n_warps = blockDim.x >> 5;
    for (int i = threadIdx.x; i < RC * D; i += blockDim.x) {
        float total = 0.0f;
        for (int w = 0; w < n_warps; ++w) total += sums[w * RC * D + i];
        const int r = i / D, c = i - r * D;
        partial[(((long long)bh * n_chunks + chunk) * R + row0 + r) * D + c] = total;
    }
}

#define SV_ENTRY(NAME, RC, CPT, FULL)                                                                         \
    extern "C" __global__ void __launch_bounds__(NUM_THREADS) NAME(                                           \
        const float* scores, const unsigned char* v_a, const unsigned char* v_b, const unsigned char* v_c,     \
        const unsigned short* tail_v, const int* e_o, float* partial, int* wv, unsigned short* values_out,    \
        int R, int row0, int D, int seg, int n_full, int cap_tok, int n_tail, int tokens_per_cta, int t12,    \
        int t8) {                                                                                             \
        sv_impl<RC, CPT, FULL>(scores, v_a, v_b, v_c, tail_v, e_o, partial, wv, values_out, R, row0, D, seg,  \
                               n_full, cap_tok, n_tail, tokens_per_cta, t12, t8);                             \
    }

#define SV_ENTRIES(RC)                              \
    SV_ENTRY(sv_aligned_r##RC##_c4, RC, 4, false)   \
    SV_ENTRY(sv_aligned_r##RC##_c8, RC, 8, false)   \
    SV_ENTRY(sv_full_r##RC##_c4, RC, 4, true)       \
    SV_ENTRY(sv_full_r##RC##_c8, RC, 8, true)

SV_ENTRIES(1)
SV_ENTRIES(2)
SV_ENTRIES(3)
SV_ENTRIES(4)
SV_ENTRIES(5)
SV_ENTRIES(6)
SV_ENTRIES(7)
SV_ENTRIES(8)
