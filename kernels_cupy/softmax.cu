// Softmax, strided top-k and e(O_est) in one launch (kvquant.alignment.output_exponents on fp32 scores).
//
// Grid (n_splits, R, BH), NUM_THREADS threads, dynamic shared memory max(NUM_THREADS, k) * 8 bytes.
// CTA (split, row, bh) owns tokens [split * span, (split + 1) * span) of one query row (span a multiple
// of k when k > 0):
// 1. normalize != 0: merge the row's per-QK-CTA statistics (m_i, l_i) by log-sum-exp
//    (m = max m_i, l = sum l_i * exp(m_i - m), in QK-CTA order, the same in every CTA of the row) and
//    overwrite its logits with probabilities exp(x - m) / l (0 where x = -inf or the row is all masked:
//    torch's softmax then nan_to_num(0)). normalize == 0: the scores are already probabilities.
// 2. k > 0: the argmax of each residue class j mod k among its tokens (first index on ties), into
//    best_val/best_idx.
// 3. k > 0 and e_o not null: the last CTA of the KV head (a ticket on counter[bh]) merges the splits in
//    index order and sums O_est[c] = sum_res s * |v8(j, c)| in the reference's pairwise order for every
//    row, writing e(O_est) + 15 (min over rows, clamped) to e_o; it resets counter[bh] to zero.
#include "planes.cuh"

extern "C" __global__ void __launch_bounds__(NUM_THREADS) softmax_topk(
    float* __restrict__ scores,                 // [BH, R, L]: logits in, probabilities out (normalize)
    const float* __restrict__ partial_ml,       // [BH, R, n_qk, 2]
    float* __restrict__ best_val,               // [BH, R, n_splits, k]
    int* __restrict__ best_idx,                 // [BH, R, n_splits, k]
    const unsigned char* __restrict__ v_a,      // [BH, n_full, D]
    const unsigned short* __restrict__ tail_v,  // [BH, n_tail, D] fp16 bits
    int* __restrict__ e_o,                      // [BH, D], or null
    unsigned int* __restrict__ counter,         // [BH], zero before and after
    int R, int L, int D, int k, int span, int n_qk, int n_full, int n_tail, int normalize)
{
    extern __shared__ float smem[];
    __shared__ int last_flag;
    const int split = blockIdx.x, n_splits = gridDim.x, row = blockIdx.y, bh = blockIdx.z;
    float* s = scores + ((long long)bh * R + row) * L;
    const int tok0 = split * span, tok1 = min(L, tok0 + span);

    if (normalize) {
        const float* ml = partial_ml + ((long long)bh * R + row) * n_qk * 2;
        float m = NEG_INF;
        for (int i = 0; i < n_qk; ++i) m = fmaxf(m, ml[2 * i]);
        float l = 0.0f;
        if (m != NEG_INF)
            for (int i = 0; i < n_qk; ++i)
                if (ml[2 * i] != NEG_INF) l += ml[2 * i + 1] * expf(ml[2 * i] - m);
        for (int j = tok0 + threadIdx.x; j < tok1; j += blockDim.x) {
            const float x = s[j];
            s[j] = (m == NEG_INF || x == NEG_INF) ? 0.0f : expf(x - m) / l;
        }
        __syncthreads();  // the probabilities this block wrote are what the top-k scans
    }
    if (k <= 0) return;

    // Strided rows i (token i * k + res) of this split: [i0, i0 + span / k).
    const int i0 = tok0 / k, i_span = span / k;
    const long long out_base = ((long long)bh * R + row) * n_splits + split;
    if (k <= (int)blockDim.x) {
        const int groups = blockDim.x / k, res = threadIdx.x % k, grp = threadIdx.x / k;
        unsigned int best = 0u;  // scores are >= 0: their bits order as they do
        int index = -1;
        if (grp < groups) {
            const int n_i = res < L ? (L - 1 - res) / k + 1 : 0;
            const int i_end = min(i0 + i_span, n_i);
            for (int i = i0 + grp; i < i_end; i += groups) {
                const unsigned int value = __float_as_uint(s[i * k + res]);
                if (index < 0 || value > best) {
                    best = value;
                    index = i * k + res;
                }
            }
        }
        unsigned int* val_sh = (unsigned int*)smem;
        int* idx_sh = (int*)(val_sh + blockDim.x);
        val_sh[threadIdx.x] = best;
        idx_sh[threadIdx.x] = index;
        __syncthreads();
        if (threadIdx.x < k) {
            for (int g = 1; g < groups; ++g) {  // groups interleave rows: ties go to the smaller index
                const unsigned int value = val_sh[g * k + res];
                const int j = idx_sh[g * k + res];
                if (j >= 0 && (index < 0 || value > best || (value == best && j < index))) {
                    best = value;
                    index = j;
                }
            }
            best_val[out_base * k + res] = __uint_as_float(best);
            best_idx[out_base * k + res] = index;
        }
    } else {
        for (int res = threadIdx.x; res < k; res += blockDim.x) {
            unsigned int best = 0u;
            int index = -1;
            const int n_i = res < L ? (L - 1 - res) / k + 1 : 0;
            const int i_end = min(i0 + i_span, n_i);
            for (int i = i0; i < i_end; ++i) {
                const unsigned int value = __float_as_uint(s[i * k + res]);
                if (index < 0 || value > best) {
                    best = value;
                    index = i * k + res;
                }
            }
            best_val[out_base * k + res] = __uint_as_float(best);
            best_idx[out_base * k + res] = index;
        }
    }
    if (e_o == nullptr) return;
    if (!last_to_finish(counter + bh, (unsigned int)(n_splits * R), &last_flag)) return;

    // The last CTA of this KV head: e(O_est) over all rows, as kernels_cupy.reference.estimated_output.
    const int k_eff = min(k, L);
    float* top_s = smem;                // [k]
    int* top_j = (int*)(top_s + k);     // [k]
    int e_min = 0x7FFFFFFF;
    for (int r = 0; r < R; ++r) {
        __syncthreads();  // the previous row's candidates are no longer read
        for (int res = threadIdx.x; res < k_eff; res += blockDim.x) {
            unsigned int best = 0u;
            int index = -1;
            for (int sp = 0; sp < n_splits; ++sp) {  // splits in index order: strictly greater keeps the first
                const long long at = (((long long)bh * R + r) * n_splits + sp) * k + res;
                const int j = load_cg(best_idx + at);
                const unsigned int value = __float_as_uint(load_cg(best_val + at));
                if (j >= 0 && (index < 0 || value > best)) {
                    best = value;
                    index = j;
                }
            }
            top_s[res] = __uint_as_float(best);
            top_j[res] = index;
        }
        __syncthreads();
        if ((int)threadIdx.x < D) {  // D <= NUM_THREADS (ops.check_head_dim): channel c = threadIdx.x
            const int c = threadIdx.x;
            PairwiseSum sum;
            sum.init();
            for (int res = 0; res < k_eff; ++res) {
                const int j = top_j[res];
                const unsigned int a = j < n_full ? v_a[((long long)bh * n_full + j) * D + c]
                                                  : (tail_v[((long long)bh * n_tail + (j - n_full)) * D + c] >> 8);
                sum.add(mul_exact_rn(top_s[res], high_byte_magnitude(a)));
            }
            e_min = min(e_min, floor_log2f(sum.result()));
        }
    }
    if ((int)threadIdx.x < D) e_o[(long long)bh * D + threadIdx.x] = max(-EO_CLAMP, min(EO_CLAMP, e_min)) + 15;
    if (threadIdx.x == 0) counter[bh] = 0u;
}
