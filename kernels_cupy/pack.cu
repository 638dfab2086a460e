// Append: fp16 K/V tokens -> plane layout, with the per-channel max |K|, AlignedKV+'s per-block key
// exponent fields and the block rule's value exponent fields (per value_block tokens and channel, the
// largest exponent field of plane A) written in the same pass (kvquant.formats.planes.PlaneStore
// .append/_store_blocks).
//
// Grid (ceil(T / 64), B*H), NUM_THREADS threads, dynamic shared memory 64 * (D + 2) * 2 bytes.
// Tile x covers tokens [64x, 64x + 64) of the chunk. Every token updates k_absmax; tokens below
// n_full (a multiple of 64) are written to the planes as block blk0 + x.
#include "planes.cuh"

#define TILE_STRIDE 66  // ushorts per channel row in shared memory: 33 words, conflict-free columns

// Max on one fp16 magnitude through a CAS on its aligned 32-bit word (needs a 4-byte aligned tensor
// with an even number of elements; 16-bit atomicCAS is not declared under every NVRTC).
__device__ __forceinline__ void atomic_max_u16(unsigned short* address, unsigned short value) {
    const unsigned long long at = (unsigned long long)address;
    unsigned int* word = (unsigned int*)(at & ~3ull);
    const unsigned int shift = (at & 2ull) ? 16u : 0u;
    unsigned int old = *((volatile unsigned int*)word);
    while (((old >> shift) & 0xFFFFu) < value) {
        const unsigned int desired = (old & ~(0xFFFFu << shift)) | ((unsigned int)value << shift);
        const unsigned int seen = atomicCAS(word, old, desired);
        if (seen == old) break;
        old = seen;
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) pack_kv(
    const unsigned short* __restrict__ k,  // [BH, T, D] fp16 bits
    const unsigned short* __restrict__ v,  // [BH, T, D]
    int T, int n_full, int D,
    unsigned char* __restrict__ k_a,        // [BH, cap_blk, D, 64]
    unsigned char* __restrict__ k_b,        // [BH, cap_blk, D, 32]
    unsigned char* __restrict__ k_c,        // [BH, cap_blk, D, 32]
    unsigned char* __restrict__ v_a,        // [BH, cap_blk * 64, D]
    unsigned char* __restrict__ v_b,        // [BH, cap_blk * 64, D / 2]
    unsigned char* __restrict__ v_c,        // [BH, cap_blk * 64, D / 2]
    unsigned char* __restrict__ k_exp,      // [BH, cap_blk, D], or null
    unsigned char* __restrict__ v_exp,      // [BH, cap_blk * 64 / value_block, D], or null
    unsigned short* __restrict__ k_absmax,  // [BH, D] fp16 bits, updated in place
    int cap_blk, int blk0, int value_block,
    int* __restrict__ flags)                // [2]: a high byte reads as +-0 in K, in V (null: no whole block)
{
    extern __shared__ unsigned short tile[];  // [D][TILE_STRIDE]
    const int bh = blockIdx.y;
    const int t0 = blockIdx.x * 64;
    const int nt = min(64, T - t0);
    const bool full_block = t0 + 64 <= n_full;
    const unsigned short* k_tile = k + ((long long)bh * T + t0) * D;

    for (int i = threadIdx.x; i < nt * D; i += blockDim.x) {
        const int tok = i / D, c = i - tok * D;
        tile[c * TILE_STRIDE + tok] = k_tile[i];
    }
    __syncthreads();

    const long long blk = (long long)bh * cap_blk + blk0 + blockIdx.x;
    bool tiny_k = false, tiny_v = false;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        unsigned int magnitude = 0u, field = 0u;
        for (int tok = 0; tok < nt; ++tok) {
            const unsigned int bits = tile[c * TILE_STRIDE + tok];
            magnitude = max(magnitude, bits & 0x7FFFu);
            field = max(field, (bits >> 10) & 0x1Fu);
            tiny_k = tiny_k || (full_block && (bits & 0x7F00u) == 0u);
        }
        atomic_max_u16(k_absmax + (long long)bh * D + c, (unsigned short)magnitude);
        if (full_block && k_exp != nullptr) k_exp[blk * D + c] = (unsigned char)field;
    }
    if (full_block) {
        for (int i = threadIdx.x; i < D * 32; i += blockDim.x) {
            const int c = i >> 5, pair = i & 31;
            const unsigned int two = *((const unsigned int*)(tile + c * TILE_STRIDE) + pair);
            const unsigned int lo = two & 0xFFFFu, hi = two >> 16;
            const long long row = blk * D + c;
            *((unsigned short*)(k_a + row * 64) + pair) = (unsigned short)((lo >> 8) | (hi & 0xFF00u));
            k_b[row * 32 + pair] = (unsigned char)(((lo >> 4) & 0xFu) | (hi & 0xF0u));
            k_c[row * 32 + pair] = (unsigned char)((lo & 0xFu) | ((hi & 0xFu) << 4));
        }
        const int half = D >> 1;
        const unsigned short* v_tile = v + ((long long)bh * T + t0) * D;
        const long long tok0 = ((long long)bh * cap_blk + blk0 + blockIdx.x) * 64;
        for (int i = threadIdx.x; i < 64 * half; i += blockDim.x) {
            const int tok = i / half, pair = i - tok * half;
            const unsigned int two = *((const unsigned int*)(v_tile + tok * D) + pair);
            const unsigned int lo = two & 0xFFFFu, hi = two >> 16;
            const long long row = tok0 + tok;
            *((unsigned short*)(v_a + row * D) + pair) = (unsigned short)((lo >> 8) | (hi & 0xFF00u));
            v_b[row * half + pair] = (unsigned char)(((lo >> 4) & 0xFu) | (hi & 0xF0u));
            v_c[row * half + pair] = (unsigned char)((lo & 0xFu) | ((hi & 0xFu) << 4));
            tiny_v = tiny_v || (lo & 0x7F00u) == 0u || (hi & 0x7F00u) == 0u;
        }
        if (v_exp != nullptr) {  // one byte per (value block, channel): the largest (bits >> 10) & 31
            const int per_tile = 64 / value_block;
            for (int i = threadIdx.x; i < per_tile * D; i += blockDim.x) {
                const int sub = i / D, c = i - sub * D;
                unsigned int field = 0u;
                for (int tok = sub * value_block; tok < (sub + 1) * value_block; ++tok)
                    field = max(field, ((unsigned int)v_tile[tok * D + c] >> 10) & 0x1Fu);
                v_exp[(((long long)bh * cap_blk + blk0 + blockIdx.x) * per_tile + sub) * D + c] = (unsigned char)field;
            }
        }
    }
    if (tiny_k) atomicOr(flags, 1);
    if (tiny_v) atomicOr(flags + 1, 1);
}
