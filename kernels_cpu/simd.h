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
#define KVQ_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KVQ_PORTABLE)
#define KVQ_AVX512 0
#define KVQ_AVX2 1  // a 16-lane vector is two 8-lane halves (Zen 2/3, older Intel)
#include <immintrin.h>
#else
#define KVQ_AVX512 0
#define KVQ_AVX2 0
#endif

namespace kvq {

constexpr int W = 16;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float half_to_float(uint16_t h) {
#if KVQ_AVX512 || KVQ_AVX2
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

#elif KVQ_AVX2

struct vf {
  __m256 lo, hi;
};
struct vi {
  __m256i lo, hi;
};
using mk = int;  // number of live lanes, as on the portable path

inline mk lanes(int n) { return n >= W ? W : n <= 0 ? 0 : n; }
// lanes 0 .. n-1 of an 8-lane half set (n may be <= 0 or >= 8)
inline __m256i half_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf set1(float x) {
  const __m256 v = _mm256_set1_ps(x);
  return {v, v};
}
inline vf load(const float* p, mk m) {
  if (m >= W) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  return {_mm256_maskload_ps(p, half_mask(m)), _mm256_maskload_ps(p + 8, half_mask(m - 8))};
}
inline void store(float* p, vf v, mk m) {
  if (m >= W) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
    return;
  }
  _mm256_maskstore_ps(p, half_mask(m), v.lo);
  _mm256_maskstore_ps(p + 8, half_mask(m - 8), v.hi);
}
inline vf load_half_full(const uint16_t* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(x)), _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1))};
}
inline vf load_half(const uint16_t* p, mk m) {
  if (m >= W) return load_half_full(p);
  alignas(32) uint16_t t[W] = {};
  if (m > 0) std::memcpy(t, p, size_t(m) * 2);
  return load_half_full(t);
}
inline vf fma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf add(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float hsum8(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hsum(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float hmax(vf a, mk m) {
  const __m256 ninf = _mm256_set1_ps(NEG_INF);
  __m256 x = _mm256_max_ps(_mm256_blendv_ps(ninf, a.lo, _mm256_castsi256_ps(half_mask(m))),
                           _mm256_blendv_ps(ninf, a.hi, _mm256_castsi256_ps(half_mask(m - 8))));
  __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  y = _mm_max_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
}
// lane i of the result is v[idx[i]] (idx in 0..15): each half gathers from both halves of v.
inline __m256 permute_half(__m256i idx, vf v) {
  const __m256i seven = _mm256_set1_epi32(7);
  const __m256i within = _mm256_and_si256(idx, seven);
  const __m256 from_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, seven));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(v.lo, within), _mm256_permutevar8x32_ps(v.hi, within), from_hi);
}
inline vf permute(vi idx, vf v) { return {permute_half(idx.lo, v), permute_half(idx.hi, v)}; }
inline vi index_vector(const int* idx) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + 8))};
}
// lane i = hsum of s[i] for 8 vectors: three rounds of horizontal adds and one 128-bit exchange.
inline __m256 hsum8x8(const __m256* s) {
  const __m256 t0 = _mm256_hadd_ps(s[0], s[1]), t1 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 t2 = _mm256_hadd_ps(s[4], s[5]), t3 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline vf hsum16(const vf* v) {
  __m256 s[W];
  for (int i = 0; i < W; ++i) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {hsum8x8(s), hsum8x8(s + 8)};
}

// 16 codes packed low bits first, 8/BITS per byte, as kvquant.quant.integer.pack writes them, as
// floats: ``bits`` holds them low bits first (2-bit: 32 bits; 4-bit: 64 bits).
template <int BITS>
inline vf codes_from(uint64_t bits) {
  if constexpr (BITS == 2) {
    const __m256i w = _mm256_set1_epi32(int(uint32_t(bits)));
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), three);
    const __m256i hi =
        _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)), three);
    return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
  } else {
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), f = _mm256_set1_epi32(15);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(uint32_t(bits))), sh), f);
    const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(uint32_t(bits >> 32))), sh), f);
    return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
  }
}

template <int BITS>
inline vf unpack_full(const uint8_t* p) {
  if constexpr (BITS == 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8)))};
  } else {
    uint64_t w = 0;
    std::memcpy(&w, p, 2 * BITS);
    return codes_from<BITS>(w);
  }
}

// The first n (< 16 allowed) codes; lanes past n are 0 and no byte past them is read.
template <int BITS>
inline vf unpack_codes(const uint8_t* p, int n) {
  if (n >= W) return unpack_full<BITS>(p);
  if constexpr (BITS == 8) {
    alignas(16) uint8_t t[W] = {};
    if (n > 0) std::memcpy(t, p, size_t(n));
    return unpack_full<8>(t);
  } else {
    uint64_t w = 0;
    for (int i = 0; i < (n * BITS + 7) / 8; ++i) w |= uint64_t(p[i]) << (8 * i);
    vf r = codes_from<BITS>(w);  // codes past n come from the partly read last byte: clear them
    return {_mm256_and_ps(r.lo, _mm256_castsi256_ps(half_mask(n))),
            _mm256_and_ps(r.hi, _mm256_castsi256_ps(half_mask(n - 8)))};
  }
}

// exp(x) for x <= 0 (scores minus their running max); lanes below -87 (and -inf) give exactly 0.
// The AVX-512 path's polynomial; 2^n is built in the exponent field (n >= -126: a normal number).
inline __m256 vexp8(__m256 x) {
  const __m256 floor = _mm256_set1_ps(-87.0f);
  const __m256 live = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);
  x = _mm256_max_ps(x, floor);
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}
inline vf vexp(vf x) { return {vexp8(x.lo), vexp8(x.hi)}; }

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
