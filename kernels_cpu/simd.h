// 16-lane fp32 vectors: AVX-512 (+F16C) intrinsics where the build machine has them, plain loops
// otherwise, so the kernels in attention.cpp are written once. Every load and store takes a lane
// count: a head dim that is not a multiple of 16 (8, 80, ...) is handled by masking, never by
// reading past a row.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__) && \
    !defined(KVQ_PORTABLE)
#define KVQ_AVX512 1
#include <immintrin.h>
#else
#define KVQ_AVX512 0
#endif

namespace kvq {

constexpr int W = 16;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float half_to_float(uint16_t h) {
#if KVQ_AVX512
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while (!(man & 0x400u));
    bits = sign | uint32_t(112 - e) << 23 | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

#if KVQ_AVX512

using vf = __m512;
using vi = __m512i;
using mk = __mmask16;

inline mk lanes(int n) { return n >= W ? mk(0xffff) : n <= 0 ? mk(0) : mk((1u << n) - 1u); }
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p, mk m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store(float* p, vf v, mk m) { _mm512_mask_storeu_ps(p, m, v); }
inline vf load_half(const uint16_t* p, mk m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline vf load_half_full(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float hsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float hmax(vf a, mk m) { return _mm512_mask_reduce_max_ps(m, a); }
inline vf permute(vi idx, vf v) { return _mm512_permutexvar_ps(idx, v); }
inline vi index_vector(const int* idx) { return _mm512_loadu_si512(idx); }

// 16 sums of 16 vectors: lane i of the result is hsum(v[i]), in four rounds of shuffle-and-add
// (about 2 operations a vector instead of 8 for a horizontal reduction each).
inline vf hsum16(const vf* v) {
  vf a[8], b[4], c[2];
  // Each round halves the inputs; a lane always holds a partial sum of one input vector, and the
  // last round leaves lane i = hsum(v[i]).
  for (int i = 0; i < 8; ++i) {
    vf x = v[2 * i], y = v[2 * i + 1];
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {
    vf x = a[2 * i], y = a[2 * i + 1];
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))));
  }
  for (int i = 0; i < 2; ++i) {
    vf x = b[2 * i], y = b[2 * i + 1];
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// 16 codes packed low bits first, 8/BITS per byte, as kvquant.quant.integer.pack writes them, as
// floats: one broadcast load, a shift per lane, a mask and a conversion.
template <int BITS>
inline vf codes_from(vi words) {
  if constexpr (BITS == 2) {
    const vi sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, sh), _mm512_set1_epi32(3)));
  } else {
    const vi half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const vi sh = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    words = _mm512_permutexvar_epi32(half, words);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, sh), _mm512_set1_epi32(15)));
  }
}

template <int BITS>
inline vf unpack_full(const uint8_t* p) {
  if constexpr (BITS == 2) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    return codes_from<2>(_mm512_set1_epi32(int(w)));
  } else if constexpr (BITS == 4) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    return codes_from<4>(_mm512_set1_epi64(int64_t(w)));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
}

// The first n (< 16 allowed) codes; lanes past n are 0 and no byte past them is read.
template <int BITS>
inline vf unpack_codes(const uint8_t* p, int n) {
  if (n >= W) return unpack_full<BITS>(p);
  if constexpr (BITS == 8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes(n), p)));
  } else {
    uint64_t w = 0;
    for (int i = 0; i < (n * BITS + 7) / 8; ++i) w |= uint64_t(p[i]) << (8 * i);
    return codes_from<BITS>(BITS == 2 ? _mm512_set1_epi32(int(w)) : _mm512_set1_epi64(int64_t(w)));
  }
}

// exp(x) for x <= 0 (scores minus their running max); lanes below -87 (and -inf) give exactly 0.
inline vf vexp(vf x) {
  const mk live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  vf p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(live, p, n);
}

#else  // portable: the same operations as loops the compiler may vectorise

struct vf {
  float v[W];
};
struct vi {
  int v[W];
};
using mk = int;  // number of live lanes

inline mk lanes(int n) { return n >= W ? W : n <= 0 ? 0 : n; }
inline vf zero() { return vf{}; }
inline vf set1(float x) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = x;
  return r;
}
inline vf load(const float* p, mk m) {
  vf r{};
  for (int i = 0; i < m; ++i) r.v[i] = p[i];
  return r;
}
inline void store(float* p, vf v, mk m) {
  for (int i = 0; i < m; ++i) p[i] = v.v[i];
}
inline vf load_half(const uint16_t* p, mk m) {
  vf r{};
  for (int i = 0; i < m; ++i) r.v[i] = half_to_float(p[i]);
  return r;
}
inline vf load_half_full(const uint16_t* p) { return load_half(p, W); }
#define KVQ_LANEWISE(name, expr)        \
  inline vf name(vf a, vf b) {          \
    vf r;                               \
    for (int i = 0; i < W; ++i) {       \
      const float x = a.v[i], y = b.v[i]; \
      r.v[i] = (expr);                  \
    }                                   \
    return r;                           \
  }
KVQ_LANEWISE(mul, x * y)
KVQ_LANEWISE(add, x + y)
KVQ_LANEWISE(sub, x - y)
KVQ_LANEWISE(vmax, x > y ? x : y)
#undef KVQ_LANEWISE
inline vf fma(vf a, vf b, vf c) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline float hsum(vf a) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += a.v[i];
  return s;
}
inline float hmax(vf a, mk m) {
  float s = NEG_INF;
  for (int i = 0; i < m; ++i) s = a.v[i] > s ? a.v[i] : s;
  return s;
}
inline vf permute(vi idx, vf v) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = v.v[idx.v[i]];
  return r;
}
inline vi index_vector(const int* idx) {
  vi r;
  for (int i = 0; i < W; ++i) r.v[i] = idx[i];
  return r;
}
inline vf hsum16(const vf* v) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = hsum(v[i]);
  return r;
}
template <int BITS>
inline vf unpack_codes(const uint8_t* p, int n) {
  vf r{};
  const int per = 8 / BITS, m = (1 << BITS) - 1;
  for (int i = 0; i < lanes(n); ++i) r.v[i] = float((p[i / per] >> (BITS * (i % per))) & m);
  return r;
}
template <int BITS>
inline vf unpack_full(const uint8_t* p) {
  return unpack_codes<BITS>(p, W);
}
inline vf vexp(vf x) {
  vf r;
  for (int i = 0; i < W; ++i) r.v[i] = x.v[i] < -87.0f ? 0.0f : std::exp(x.v[i]);
  return r;
}

#endif

}  // namespace kvq
