// HIGGS decoding pieces shared by the kernels that read HIGGS codes (higgs.cpp: attention over a
// higgs store; aquakv.cpp: AQUA-KV's residual decode): bit-packed codes, grid lookup, the inverse
// rotation kron(outer, S_p), and RoPE's cos/sin computed from int32 positions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace kvq {

// Code k of a row packed by kvquant.quant.bitpack (low bits first; 6-bit codes in 3-byte words of 4).
template <int BITS>
inline int code_at(const uint8_t* row, int64_t k) {
  if constexpr (BITS == 8) {
    return row[k];
  } else if constexpr (BITS == 4) {
    return (row[k >> 1] >> ((k & 1) * 4)) & 15;
  } else {
    const uint8_t* w = row + (k >> 2) * 3;
    const uint32_t word = uint32_t(w[0]) | uint32_t(w[1]) << 8 | uint32_t(w[2]) << 16;
    return int(word >> ((k & 3) * 6)) & 63;
  }
}

#if KVQ_AVX512 || KVQ_AVX2
// Codes k .. k+7 (k a multiple of 8, so 6-bit codes start on a word) as int32 lanes; reads only their bytes.
template <int BITS>
inline __m256i codes8(const uint8_t* row, int64_t k) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)));
  } else if constexpr (BITS == 4) {
    uint32_t w;
    std::memcpy(&w, row + k / 2, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(w)), shifts), _mm256_set1_epi32(15));
  } else {
    uint64_t w = 0;
    std::memcpy(&w, row + k / 4 * 3, 6);
    const int lo = int(w & 0xffffff), hi = int(w >> 24);
    const __m256i words = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
    return _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18)),
                            _mm256_set1_epi32(63));
  }
}
#endif

// The grid points of n consecutive codes from code k0 on, as 2n floats (d = 2): a 64-bit gather
// per 8 codes loads each point's two coordinates in order.
template <int BITS>
inline void lookup(const uint8_t* row, int64_t k0, int n, const float* grid, float* y) {
  int j = 0;
#if KVQ_AVX512
  if (k0 % 8 == 0) {
    const double* pts = reinterpret_cast<const double*>(grid);
    for (; j + 8 <= n; j += 8)
      _mm512_storeu_ps(y + 2 * j, _mm512_castpd_ps(_mm512_i32gather_pd(codes8<BITS>(row, k0 + j), pts, 8)));
  }
#elif KVQ_AVX2
  if (k0 % 8 == 0) {
    const double* pts = reinterpret_cast<const double*>(grid);
    for (; j + 8 <= n; j += 8) {
      const __m256i c = codes8<BITS>(row, k0 + j);
      _mm256_storeu_pd(reinterpret_cast<double*>(y + 2 * j), _mm256_i32gather_pd(pts, _mm256_castsi256_si128(c), 8));
      _mm256_storeu_pd(reinterpret_cast<double*>(y + 2 * j + 8),
                       _mm256_i32gather_pd(pts, _mm256_extracti128_si256(c, 1), 8));
    }
  }
#endif
  for (; j < n; ++j) {
    const int c = code_at<BITS>(row, k0 + j);
    y[2 * j] = grid[2 * c];
    y[2 * j + 1] = grid[2 * c + 1];
  }
}

#if KVQ_AVX512
// One in-register butterfly stage of stride h < 16: lanes without bit h get x + x[l^h], lanes with it x[l^h] - x.
template <int H>
inline __m512 stage(__m512 v) {
  __m512 p;
  if constexpr (H == 1) p = _mm512_permute_ps(v, 0xB1);
  else if constexpr (H == 2) p = _mm512_permute_ps(v, 0x4E);
  else if constexpr (H == 4) p = _mm512_shuffle_f32x4(v, v, 0xB1);
  else p = _mm512_shuffle_f32x4(v, v, 0x4E);
  constexpr __mmask16 high = H == 1 ? 0xAAAA : H == 2 ? 0xCCCC : H == 4 ? 0xF0F0 : 0xFF00;
  return _mm512_mask_sub_ps(_mm512_add_ps(v, p), high, p, v);
}
#elif KVQ_AVX2
// The same stage on 8 lanes (h = 1, 2, 4); h = 8 pairs two registers.
template <int H>
inline __m256 stage(__m256 v) {
  __m256 p;
  if constexpr (H == 1) p = _mm256_permute_ps(v, 0xB1);
  else if constexpr (H == 2) p = _mm256_permute_ps(v, 0x4E);
  else p = _mm256_permute2f128_ps(v, v, 0x01);
  constexpr int high = H == 1 ? 0xAA : H == 2 ? 0xCC : 0xF0;
  return _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), high);
}
#endif

// Unnormalised Walsh-Hadamard transform of p (a power of two) floats, Sylvester order (kvquant's fwht).
inline void fwht(float* x, int p) {
  int h = 1;
#if KVQ_AVX512
  if (p >= W) {
    for (int i = 0; i < p; i += W) {
      __m512 v = _mm512_loadu_ps(x + i);
      v = stage<8>(stage<4>(stage<2>(stage<1>(v))));
      _mm512_storeu_ps(x + i, v);
    }
    h = W;
  }
#elif KVQ_AVX2
  if (p >= W) {
    for (int i = 0; i < p; i += W) {
      const __m256 a = stage<4>(stage<2>(stage<1>(_mm256_loadu_ps(x + i))));
      const __m256 b = stage<4>(stage<2>(stage<1>(_mm256_loadu_ps(x + i + 8))));
      _mm256_storeu_ps(x + i, _mm256_add_ps(a, b));
      _mm256_storeu_ps(x + i + 8, _mm256_sub_ps(a, b));
    }
    h = W;
  }
#endif
  for (; h < p; h *= 2)
    for (int i = 0; i < p; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

struct Rotation {  // kron(outer [m, m], S_p), P = m * p
  const float* outer;
  int m, p, P;
};

// y <- kron(outer, S_p) y (unnormalised), in place; tmp holds P floats.
// Block i of out = sum_j c(i, j) in_j with c = outer (T: its transpose). Four output blocks at a time,
// each summed in a register over j (j in order, one fma each) and stored once: four independent fma
// chains per load, where summing into memory chained every fma on a store.
template <bool T>
inline void mix_blocks(const float* in, float* out, const Rotation& r) {
  constexpr int G = 4;
  for (int l = 0; l < r.p; l += W) {
    const mk lm = lanes(r.p - l);
    for (int i0 = 0; i0 < r.m; i0 += G) {
      const int g = std::min(G, r.m - i0);
      vf acc[G];
      for (int k = 0; k < G; ++k) acc[k] = zero();
      for (int j = 0; j < r.m; ++j) {
        const vf x = load(in + j * r.p + l, lm);
        for (int k = 0; k < G; ++k) {
          const int i = std::min(i0 + k, r.m - 1);  // past the last block: computed, never stored
          acc[k] = fma(set1(T ? r.outer[j * r.m + i] : r.outer[i * r.m + j]), x, acc[k]);
        }
      }
      for (int k = 0; k < g; ++k) store(out + (i0 + k) * r.p + l, acc[k], lm);
    }
  }
}

inline void rotate_back(float* y, float* tmp, const Rotation& r) {
  for (int i = 0; i < r.m; ++i) fwht(y + i * r.p, r.p);
  if (r.m == 1) return;
  mix_blocks<false>(y, tmp, r);
  std::copy(tmp, tmp + r.P, y);
}

// x <- x @ kron(outer, S_p) (unnormalised; Higgs.quantize's direction), in place; tmp holds P floats.
// Block i of the result is sum_j outer[j, i] (S_p x_j).
inline void rotate_forward(float* x, float* tmp, const Rotation& r) {
  for (int i = 0; i < r.m; ++i) fwht(x + i * r.p, r.p);
  if (r.m == 1) return;
  mix_blocks<true>(x, tmp, r);
  std::copy(tmp, tmp + r.P, x);
}

// cos and sin of 16 fp32 angles: Cody-Waite reduction by pi/2 with FMAs (exact steps for any
// angle a position reaches), then the Cephes minimax polynomials on [-pi/4, pi/4] (about 1 ulp).
#if KVQ_AVX512
inline void sincos16(__m512 x, __m512& s, __m512& c) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.636619772367581343f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.5703125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(4.837512969970703125e-4f), r);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(7.54978995489188216e-8f), r);
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 ps = _mm512_fmadd_ps(_mm512_set1_ps(-1.9515295891e-4f), z, _mm512_set1_ps(8.3321608736e-3f));
  ps = _mm512_fmadd_ps(ps, z, _mm512_set1_ps(-1.6666654611e-1f));
  ps = _mm512_fmadd_ps(_mm512_mul_ps(ps, z), r, r);
  __m512 pc = _mm512_fmadd_ps(_mm512_set1_ps(2.443315711809948e-5f), z, _mm512_set1_ps(-1.388731625493765e-3f));
  pc = _mm512_fmadd_ps(pc, z, _mm512_set1_ps(4.166664568298827e-2f));
  pc = _mm512_fmadd_ps(_mm512_mul_ps(pc, z), z, _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, _mm512_set1_ps(1.0f)));
  const __m512i q = _mm512_cvtps_epi32(n), one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
  const __mmask16 swap = _mm512_test_epi32_mask(q, one);
  const __mmask16 neg_s = _mm512_test_epi32_mask(q, two);
  const __mmask16 neg_c = _mm512_test_epi32_mask(_mm512_add_epi32(q, one), two);
  const __m512i sign = _mm512_set1_epi32(int(0x80000000u));
  const __m512 s0 = _mm512_mask_blend_ps(swap, ps, pc), c0 = _mm512_mask_blend_ps(swap, pc, ps);
  s = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(s0), neg_s, _mm512_castps_si512(s0), sign));
  c = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(c0), neg_c, _mm512_castps_si512(c0), sign));
}
#elif KVQ_AVX2
// sincos16's reduction and polynomials on 8 lanes; quadrant masks from integer compares.
inline void sincos8(__m256 x, __m256& s, __m256& c) {
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.636619772367581343f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.5703125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(4.837512969970703125e-4f), r);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(7.54978995489188216e-8f), r);
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 ps = _mm256_fmadd_ps(_mm256_set1_ps(-1.9515295891e-4f), z, _mm256_set1_ps(8.3321608736e-3f));
  ps = _mm256_fmadd_ps(ps, z, _mm256_set1_ps(-1.6666654611e-1f));
  ps = _mm256_fmadd_ps(_mm256_mul_ps(ps, z), r, r);
  __m256 pc = _mm256_fmadd_ps(_mm256_set1_ps(2.443315711809948e-5f), z, _mm256_set1_ps(-1.388731625493765e-3f));
  pc = _mm256_fmadd_ps(pc, z, _mm256_set1_ps(4.166664568298827e-2f));
  pc = _mm256_fmadd_ps(_mm256_mul_ps(pc, z), z, _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, _mm256_set1_ps(1.0f)));
  const __m256i q = _mm256_cvtps_epi32(n), one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2);
  const __m256 swap = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(q, one), one));
  const __m256i sign = _mm256_set1_epi32(int(0x80000000u));
  const __m256i neg_s = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(q, two), two), sign);
  const __m256i neg_c = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_add_epi32(q, one), two), two), sign);
  const __m256 s0 = _mm256_blendv_ps(ps, pc, swap), c0 = _mm256_blendv_ps(pc, ps, swap);
  s = _mm256_xor_ps(s0, _mm256_castsi256_ps(neg_s));
  c = _mm256_xor_ps(c0, _mm256_castsi256_ps(neg_c));
}
#endif

// The RoPE row of one position, as transformers' rotary modules compute it: angle_j = position *
// inv_freq_j (one fp32 product), both halves of cos/sin equal, times the attention scaling.
inline void rope_row(int32_t position, const float* inv_freq, float scale, int D, float* cs, float* sn) {
  const int h = D / 2;
  const float x = float(position);
  int j = 0;
#if KVQ_AVX512
  for (; j < h; j += W) {
    const mk m = lanes(h - j);
    __m512 s, c;
    sincos16(_mm512_mul_ps(_mm512_set1_ps(x), _mm512_maskz_loadu_ps(m, inv_freq + j)), s, c);
    s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
    c = _mm512_mul_ps(c, _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(cs + j, m, c);
    _mm512_mask_storeu_ps(cs + h + j, m, c);
    _mm512_mask_storeu_ps(sn + j, m, s);
    _mm512_mask_storeu_ps(sn + h + j, m, s);
  }
#elif KVQ_AVX2
  for (; j < h; j += 8) {
    const __m256i m = half_mask(h - j);
    __m256 s, c;
    sincos8(_mm256_mul_ps(_mm256_set1_ps(x), _mm256_maskload_ps(inv_freq + j, m)), s, c);
    s = _mm256_mul_ps(s, _mm256_set1_ps(scale));
    c = _mm256_mul_ps(c, _mm256_set1_ps(scale));
    _mm256_maskstore_ps(cs + j, m, c);
    _mm256_maskstore_ps(cs + h + j, m, c);
    _mm256_maskstore_ps(sn + j, m, s);
    _mm256_maskstore_ps(sn + h + j, m, s);
  }
#endif
  for (; j < h; ++j) {
    const float angle = x * inv_freq[j];
    cs[j] = cs[j + h] = std::cos(angle) * scale;
    sn[j] = sn[j + h] = std::sin(angle) * scale;
  }
}

}  // namespace kvq
