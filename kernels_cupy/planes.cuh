// Shared device helpers for the AlignedKV plane layout (see kvquant/alignment.py, kvquant/bits.py).
//
// An fp16 element is split into plane A (high byte), plane B (bits 7..4) and plane C (bits 3..0);
// B and C hold two elements per byte, the even element in the low nibble. A read of 8 or 12 bits
// fills the bits it did not load with 1000... unless its kept bits are +-0 (then +-0) or its
// exponent field is 31 (inf stays inf). Everything here needs only the bits that were loaded.
//
// No headers: the sources compile unchanged with nvcc (CI, PTX only) and NVRTC (CuPy RawModule).
#pragma once

#define ZERO_EXPONENT (-1024)
#define NO_CONTRIBUTION (1 << 20)
#define EO_CLAMP 16384
#define NUM_THREADS 256
#define NEG_INF (__int_as_float(0xff800000))

// fp16 bits -> fp32, exact (PTX cvt; no cuda_fp16.h needed).
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The bits a read of `width` (8, 12, 16) gives, from the loaded bits (unloaded planes are zero).
__device__ __forceinline__ unsigned int read_bits(unsigned int kept, int width) {
    const unsigned int fill = width == 8 ? 0x80u : (width == 12 ? 0x8u : 0u);
    const bool as_is = ((kept & 0x7FFFu) == 0u) || (((kept >> 10) & 0x1Fu) == 31u);
    return as_is ? kept : (kept | fill);
}

// prmt.b32: byte i of the result is byte (nibble i of s) of {x (0-3), y (4-7)}.
__device__ __forceinline__ unsigned int byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    unsigned int r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(s));
    return r;
}

__device__ __forceinline__ unsigned int fill4_of_width(int width) {
    return width == 8 ? 0x80808080u : (width == 12 ? 0x08080808u : 0u);
}

// read_bits' fill for four elements at once: `lo` their low bytes as loaded (unloaded nibbles zero), `hi`
// their plane-A bytes, `fill4` the width's fill byte four times. Adding 0x7F to a byte's low 7 bits sets its
// top bit exactly when they are not all zero, and no carry leaves the byte; a field of 31 is 0x7C under 0x7C.
__device__ __forceinline__ unsigned int fill_low_bytes(unsigned int lo, unsigned int hi, unsigned int fill4) {
    const unsigned int nonzero =
        (((hi & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | ((lo & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | lo) & 0x80808080u;
    const unsigned int exp31 = ((hi & 0x7C7C7C7Cu) + 0x04040404u) & 0x80808080u;
    return lo | (fill4 & (((nonzero & ~exp31) >> 7) * 0xFFu));
}

// Eight consecutive elements of one plane row read at `width`, each as read_bits gives it: `a` their plane-A
// bytes (element i in byte i), `b` / `c` their B / C nibbles (element i at bits 4i; zero where not loaded).
// Word i (x, y, z, w) holds elements 2i (low half) and 2i + 1 (high half) as fp16 bits. launch.read8_words is
// this in Python.
__device__ __forceinline__ uint4 read8(uint2 a, unsigned int b, unsigned int c, int width) {
    const unsigned int even = ((b << 4) & 0xF0F0F0F0u) | (c & 0x0F0F0F0Fu);  // byte k: element 2k's low byte
    const unsigned int odd = (b & 0xF0F0F0F0u) | ((c >> 4) & 0x0F0F0F0Fu);   // byte k: element 2k + 1's
    const unsigned int fill4 = fill4_of_width(width);
    const unsigned int lo03 = fill_low_bytes(byte_perm(even, odd, 0x5140u), a.x, fill4);
    const unsigned int lo47 = fill_low_bytes(byte_perm(even, odd, 0x7362u), a.y, fill4);
    return make_uint4(byte_perm(lo03, a.x, 0x5140u), byte_perm(lo03, a.x, 0x7362u), byte_perm(lo47, a.y, 0x5140u),
                      byte_perm(lo47, a.y, 0x7362u));
}

// fp16 bits of element i of a read8 result.
__device__ __forceinline__ unsigned short half_of(const uint4& w, int i) {
    const unsigned int word = i < 2 ? w.x : (i < 4 ? w.y : (i < 6 ? w.z : w.w));
    return (unsigned short)(word >> (16 * (i & 1)));
}

// floor(log2|x|) from the fp32 magnitude bits, exact for subnormals; zero -> ZERO_EXPONENT. Integer-only,
// so CuPy's -ftz=true cannot flush it.
__device__ __forceinline__ int floor_log2_bits(unsigned int magnitude) {
    if (magnitude == 0u) return ZERO_EXPONENT;
    const int field = (int)(magnitude >> 23);
    if (field == 0) return -118 - __clz(magnitude);
    return field - 127;
}

__device__ __forceinline__ int floor_log2f(float x) { return floor_log2_bits(__float_as_uint(x) & 0x7FFFFFFFu); }

// fp32 multiply and add rounded to nearest that keep subnormals whatever -ftz says (CuPy passes -ftz=true);
// the torch reference does not flush, and the value rule takes exponents of these results.
__device__ __forceinline__ float mul_exact_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float add_exact_rn(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// The precision-alignment tiers: thresholds are integer ceilings of (t12, t8), since gaps are integers.
__device__ __forceinline__ int width_from_gap(int gap, int t12, int t8) {
    return gap >= t8 ? 8 : (gap >= t12 ? 12 : 16);
}

// Exponent field of an 8-bit read of plane A counted as in kvquant.alignment: fields 0 (zero, subnormal) as 2^-15.
__device__ __forceinline__ int plane_a_field(unsigned int a) { return (int)((a >> 2) & 0x1Fu); }

// |v8|: the magnitude an 8-bit read of a high byte gives.
__device__ __forceinline__ float high_byte_magnitude(unsigned int a) {
    const unsigned int bits = read_bits(a << 8, 8) & 0x7FFFu;
    return half_bits_to_float((unsigned short)bits);
}

// Max over `count` ints held by all threads of the block; `scratch` holds NUM_THREADS / 32 ints.
__device__ __forceinline__ int block_max_int(int value, int* scratch) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const int other = __shfl_xor_sync(0xFFFFFFFFu, value, offset);
        value = other > value ? other : value;
    }
    const int warp = threadIdx.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[warp] = value;
    __syncthreads();
    int result = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) result = scratch[w] > result ? scratch[w] : result;
    return result;
}

// O_est's fixed summation order (kvquant.alignment.pairwise_sum): adjacent pairs, zero-padded to a power
// of two, streamed with one pending partial per tree level (a binary counter: adding the n-th addend
// merges the levels whose bits carry). Levels are indexed by unrolled constants so they stay in
// registers; PAIRWISE_LEVELS levels take up to 2^PAIRWISE_LEVELS - 1 addends.
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

// Loads that bypass L1 (ld.global.cg): the last CTA of a grid reads what other CTAs wrote.
__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int load_cg(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Whether this CTA is the last of `expected` CTAs sharing counter[0] to finish (every thread gets the
// answer). Its writes before the call are visible to that last CTA; the last CTA resets the counter to
// zero for the next launch (or graph replay) once it has read what it needs, via release_ticket.
__device__ __forceinline__ bool last_to_finish(unsigned int* counter, unsigned int expected, int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag = atomicAdd(counter, 1u) == expected - 1u;
    __syncthreads();
    const bool last = *flag != 0;
    if (last) __threadfence();
    return last;
}

__device__ __forceinline__ int warp_max_int(int v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    return v;
}

__device__ __forceinline__ int warp_min_int(int v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    return v;
}
