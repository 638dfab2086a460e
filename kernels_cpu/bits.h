// fp16 bit patterns read at fewer bits, as kvquant.bits defines the read: the kept bits, the
// dropped ones filled with 1000..., except that a read whose kept bits are +-0 gives +-0 (and, for
// truncation, +-inf and NaN are returned unchanged). Two sources:
// - truncation: an fp16 element, keep its top `keep` bits (6..16);
// - AlignedKV's planes: plane A (the high byte) and nibbles of planes B and C (mantissa bits 7..4
//   and 3..0, two elements per byte, the even one in the low nibble), read at 8, 12 or 16 bits.
// Both give 16 fp32 lanes, so the loaders feed the driver's buffers directly.
#pragma once

#include "simd.h"

namespace kvq {

struct Keep {  // a truncated read: kept-bit mask and fill of one width
  uint16_t mask = 0xffff, fill = 0;
  explicit Keep(int keep = 16)
      : mask(uint16_t(0xffffu << (16 - keep))), fill(uint16_t(keep < 16 ? 1u << (15 - keep) : 0u)) {}
};

inline uint16_t keep_scalar(uint16_t x, Keep k) {
  if ((x & 0x7c00) == 0x7c00) return x;  // inf keeps its bits (the mask keeps them all), NaN too
  const uint16_t kept = x & k.mask;
  return (kept & 0x7fff) == 0 ? kept : uint16_t(kept | k.fill);
}

// One element of the planes at WB bits: a = plane A byte, bn/cn = its B and C nibbles.
template <int WB>
inline uint16_t plane_scalar(uint8_t a, uint8_t bn, uint8_t cn) {
  if constexpr (WB == 16) return uint16_t(a << 8 | bn << 4 | cn);
  const uint16_t kept = WB == 8 ? uint16_t(a << 8) : uint16_t(a << 8 | bn << 4);
  return (kept & 0x7fff) == 0 ? kept : uint16_t(kept | (WB == 8 ? 0x80 : 0x08));
}

inline uint8_t nibble(const uint8_t* p, int i) { return (p[i / 2] >> (4 * (i % 2))) & 0x0f; }

#if KVQ_AVX512

// n (<= 16) fp16 elements truncated to k; lanes past n are 0.
[[gnu::always_inline]] inline vf half_keep(const uint16_t* p, mk m, Keep k) {
  const __m256i x = _mm256_maskz_loadu_epi16(m, p);
  const __m256i kept = _mm256_and_si256(x, _mm256_set1_epi16(short(k.mask)));
  const __mmask16 special =
      _mm256_cmpeq_epi16_mask(_mm256_and_si256(x, _mm256_set1_epi16(0x7c00)), _mm256_set1_epi16(0x7c00));
  const __mmask16 live = _mm256_test_epi16_mask(kept, _mm256_set1_epi16(0x7fff));
  const __m256i r = _mm256_or_si256(kept, _mm256_maskz_mov_epi16(live, _mm256_set1_epi16(short(k.fill))));
  return _mm512_cvtph_ps(_mm256_mask_mov_epi16(r, special, x));
}

// 16 nibbles (8 bytes, the even element in the low nibble) as 16 bytes 0..15; n elements, the rest 0.
inline __m128i nibble_bytes(const uint8_t* p, int n) {
  const __m128i v = n >= W ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))
                           : _mm_maskz_loadu_epi8(lanes((n + 1) / 2), p);
  const __m128i low = _mm_set1_epi8(0x0f);
  __m128i x = _mm_unpacklo_epi8(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low));
  return n >= W ? x : _mm_maskz_mov_epi8(lanes(n), x);
}

// n (< 16) consecutive elements of the planes at WB bits, lanes past n 0: masked loads, byte unpacks.
template <int WB>
[[gnu::noinline]] vf planes_part(const uint8_t* a, const uint8_t* b, const uint8_t* c, int n) {
  const __m128i av = _mm_maskz_loadu_epi8(lanes(n), a);
  const __mmask16 live_a = _mm_test_epi8_mask(av, _mm_set1_epi8(0x7f));
  __m128i low;  // the low byte of each element: B<<4 | C, or B<<4 | fill, or the fill
  if constexpr (WB == 8) {
    low = _mm_maskz_mov_epi8(live_a, _mm_set1_epi8(char(0x80)));
  } else {
    const __m128i bn = nibble_bytes(b, n);
    low = _mm_slli_epi16(bn, 4);  // nibbles < 16: no bit crosses into the next byte
    if constexpr (WB == 12) {
      const __mmask16 live = live_a | _mm_test_epi8_mask(bn, bn);
      low = _mm_or_si128(low, _mm_maskz_mov_epi8(live, _mm_set1_epi8(0x08)));
    } else {
      low = _mm_or_si128(low, nibble_bytes(c, n));
    }
  }
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_unpackhi_epi8(low, av), _mm_unpacklo_epi8(low, av)));
}

// 16 consecutive elements of the planes at WB bits. Each plane is broadcast-loaded into both
// 128-bit lanes (a load, no shuffle uop) and placed by one in-lane byte shuffle, so the work stays
// off the one shuffle port: with 512-bit code in flight, Intel cores run vector uops on two ports
// only. TINY applies the +-0 rule; without it (no element's plane A reads as +-0, as PlaneStore
// records) the fill is a plain OR. Fewer than 16 elements: planes_part.
template <int WB, bool TINY = true>
[[gnu::always_inline]] inline vf planes16(const uint8_t* a, const uint8_t* b, const uint8_t* c, int n) {
  if (n < W) [[unlikely]] return planes_part<WB>(a, b, c, n);
  const __m256i to_high = _mm256_setr_epi8(-1, 0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7,  //
                                           -1, 8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15);
  const __m256i hi = _mm256_shuffle_epi8(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))), to_high);  // a << 8
  if constexpr (WB == 8) {
    // kept magnitude > 0 (>= 0x100) gives min = 0x80, magnitude 0 gives 0
    const __m256i magnitude = _mm256_and_si256(hi, _mm256_set1_epi16(0x7f00));
    const __m256i fill = TINY ? _mm256_min_epu16(magnitude, _mm256_set1_epi16(0x80)) : _mm256_set1_epi16(0x80);
    return _mm512_cvtph_ps(_mm256_or_si256(hi, fill));
  } else {
    // byte j of a nibble plane to the low byte of words 2j and 2j+1 (lane 0: bytes 0..3, lane 1: 4..7)
    const __m256i spread = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,  //
                                            4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
    int64_t bw;
    std::memcpy(&bw, b, 8);
    // even words: low nibble << 4; odd words: the high nibble in place (masked below)
    const __m256i bn = _mm256_sllv_epi16(_mm256_shuffle_epi8(_mm256_set1_epi64x(bw), spread),
                                         _mm256_setr_epi16(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0));
    const __m256i nib_hi = _mm256_set1_epi16(0xf0);
    if constexpr (WB == 12) {
      const __m256i x = _mm256_ternarylogic_epi32(hi, bn, nib_hi, 0xf8);  // hi | (bn & 0xf0)
      const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi16(0x7ff0));  // > 0 means >= 0x10
      const __m256i fill = TINY ? _mm256_min_epu16(magnitude, _mm256_set1_epi16(0x08)) : _mm256_set1_epi16(0x08);
      return _mm512_cvtph_ps(_mm256_or_si256(x, fill));
    } else {
      int64_t cw;
      std::memcpy(&cw, c, 8);
      const __m256i cn = _mm256_srlv_epi16(_mm256_shuffle_epi8(_mm256_set1_epi64x(cw), spread),
                                           _mm256_setr_epi16(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
      const __m256i low = _mm256_ternarylogic_epi32(nib_hi, bn, cn, 0xca);  // 0xf0 ? bn : cn, bitwise
      return _mm512_cvtph_ps(_mm256_or_si256(hi, low));
    }
  }
}

// 64 consecutive elements of the planes at WB bits (a: 64 bytes of plane A; b, c: 32 bytes of B and C
// nibbles) in four vectors, elements in the order of byte unpacks: out[0] = 0-7 and 16-23, out[1] = 32-39
// and 48-55, out[2] = 8-15 and 24-31, out[3] = 40-47 and 56-63 (order64 restores 0-63). A consumer whose
// sum does not care (a channel's key tokens scored into per-token sums, a value row added into per-channel
// sums) keeps that order until its results are written. Why: each nibble plane is spread to its 64
// elements' low bytes by one zero-extension and a multishift (AVX512-VBMI; else two shifts and a bitwise
// select), the low bytes are interleaved with plane A by two unpacks, and every vector op covers 64
// elements; planes16 spends ~10 vector ops on 16, so a 12-bit read cost more than a 16-bit fp16 load
// (kernels_cpu/README.md).
template <int WB, bool TINY = true>
[[gnu::always_inline]] inline void planes64(const uint8_t* a, const uint8_t* b, const uint8_t* c, vf* out) {
  const __m512i av = _mm512_loadu_si512(a);
  __m512i low;  // the low byte of each element, in element order
  if constexpr (WB == 8) {
    low = TINY ? _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(av, _mm512_set1_epi8(0x7f)), _mm512_set1_epi8(char(0x80)))
               : _mm512_set1_epi8(char(0x80));
  } else {
#if defined(__AVX512VBMI__)
    // Each 4 bytes of a nibble plane (8 elements) zero-extended into a qword, then one multishift puts
    // element k's nibble (bits 4k..4k+3) into byte k: B's at bits 4k-4.. (its nibble in the byte's high
    // half; the byte of element 0 wraps into the qword's zero top), C's at bits 4k.. (in the low half).
    // Why: 2 ops a plane where the shifts below take 4.
    auto spread = [](const uint8_t* p, int64_t offsets) {
      const __m512i q = _mm512_cvtepu32_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return _mm512_multishift_epi64_epi8(_mm512_set1_epi64(offsets), q);
    };
    low = spread(b, 0x1814100c0804003c);
#else
    // byte j of a nibble plane zero-extended into word j: the even element's nibble shifted up into the low
    // byte's high half, the odd one's into the high byte's high half (0x00f0 ? bw << 4 : bw << 8, bitwise)
    const __m512i bw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    low = _mm512_ternarylogic_epi32(_mm512_slli_epi16(bw, 4), _mm512_slli_epi16(bw, 8), _mm512_set1_epi16(0x00f0), 0xe4);
#endif
    // each byte's high half now holds its element's B nibble (the low half is not yet defined)
    if constexpr (WB == 12) {
      if constexpr (TINY) {  // the fill only where plane A's magnitude bits or the B nibble are not 0
        low = _mm512_and_si512(low, _mm512_set1_epi8(char(0xf0)));
        const __m512i kept = _mm512_ternarylogic_epi32(av, _mm512_set1_epi8(0x7f), low, 0xea);  // (a & 0x7f) | low
        low = _mm512_or_si512(low, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(kept, kept), _mm512_set1_epi8(0x08)));
      } else {
        low = _mm512_ternarylogic_epi32(low, _mm512_set1_epi8(char(0xf0)), _mm512_set1_epi8(0x08), 0xea);  // low & 0xf0 | 0x08
      }
    } else {
#if defined(__AVX512VBMI__)
      const __m512i cn = spread(c, 0x1c1814100c080400);
#else  // C: the even element's low nibble in place, the odd one's high nibble shifted right
      const __m512i cw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
      const __m512i cn = _mm512_ternarylogic_epi32(cw, _mm512_slli_epi16(cw, 4), _mm512_set1_epi16(0x00ff), 0xe4);
#endif
      low = _mm512_ternarylogic_epi32(low, cn, _mm512_set1_epi8(char(0xf0)), 0xe4);  // 0xf0 ? low : cn
    }
  }
  const __m512i w0 = _mm512_unpacklo_epi8(low, av), w1 = _mm512_unpackhi_epi8(low, av);
  out[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(w0));
  out[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w0, 1));
  out[2] = _mm512_cvtph_ps(_mm512_castsi512_si256(w1));
  out[3] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w1, 1));
}

// planes64's order back to elements 0-15, 16-31, 32-47, 48-63.
inline void order64(vf* v) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vf x0 = _mm512_permutex2var_ps(v[0], first, v[2]), x1 = _mm512_permutex2var_ps(v[0], second, v[2]);
  const vf x2 = _mm512_permutex2var_ps(v[1], first, v[3]), x3 = _mm512_permutex2var_ps(v[1], second, v[3]);
  v[0] = x0;
  v[1] = x1;
  v[2] = x2;
  v[3] = x3;
}

// The inverse of order64, in place on 64 floats: elements 0-63 into planes64's order.
inline void unorder64(float* x) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vf n0 = _mm512_loadu_ps(x), n1 = _mm512_loadu_ps(x + 16), n2 = _mm512_loadu_ps(x + 32), n3 = _mm512_loadu_ps(x + 48);
  _mm512_storeu_ps(x, _mm512_permutex2var_ps(n0, first, n1));
  _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(n2, first, n3));
  _mm512_storeu_ps(x + 32, _mm512_permutex2var_ps(n0, second, n1));
  _mm512_storeu_ps(x + 48, _mm512_permutex2var_ps(n2, second, n3));
}

#elif KVQ_AVX2

inline vf halves(__m256i x) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(x)), _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1))};
}

// n (<= 16) fp16 elements truncated to k; lanes past n are 0. The AVX-512 path's rule with vector
// compares in place of mask registers.
[[gnu::always_inline]] inline vf half_keep(const uint16_t* p, mk m, Keep k) {
  __m256i x;
  if (m >= W) {
    x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    alignas(32) uint16_t t[W] = {};
    for (int i = 0; i < m; ++i) t[i] = p[i];
    x = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
  }
  const __m256i exp = _mm256_set1_epi16(0x7c00);
  const __m256i kept = _mm256_and_si256(x, _mm256_set1_epi16(short(k.mask)));
  const __m256i special = _mm256_cmpeq_epi16(_mm256_and_si256(x, exp), exp);
  const __m256i dead = _mm256_cmpeq_epi16(_mm256_and_si256(kept, _mm256_set1_epi16(0x7fff)), _mm256_setzero_si256());
  const __m256i r = _mm256_or_si256(kept, _mm256_andnot_si256(dead, _mm256_set1_epi16(short(k.fill))));
  return halves(_mm256_blendv_epi8(r, x, special));
}

template <int WB>
inline vf planes_part(const uint8_t* a, const uint8_t* b, const uint8_t* c, int n) {
  alignas(32) uint16_t h[W] = {};
  for (int i = 0; i < lanes(n); ++i) h[i] = plane_scalar<WB>(a[i], WB > 8 ? nibble(b, i) : 0, WB > 12 ? nibble(c, i) : 0);
  return halves(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
}

// 16 nibbles (8 bytes, the even element in the low nibble) as 16 bytes in element order: `high` puts each
// in the byte's high half (B, read as bits 7..4 of the element's low byte), else in the low half (C).
template <bool HIGH>
[[gnu::always_inline]] inline __m128i nibbles16(const uint8_t* p) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(HIGH ? char(0xf0) : char(0x0f));
  const __m128i even = _mm_and_si128(HIGH ? _mm_slli_epi16(x, 4) : x, mask);
  const __m128i odd = _mm_and_si128(HIGH ? x : _mm_srli_epi16(x, 4), mask);
  return _mm_unpacklo_epi8(even, odd);
}

// 16 consecutive elements of the planes at WB bits. Each element's low byte (B and C nibbles, or the
// fill) is put together in one 16-byte register in element order and interleaved with the plane-A bytes
// into two 8-word halves, so every step is a 128-bit op: Zen 1 splits 256-bit ops in two, and with the
// 256-bit byte shuffles this replaced, every element read at 12 bits took 1.55x fused fp16's time, now
// 1.22x (32x128, 16K, `scripts/bench_kernels_cpu.py --planes`). TINY applies the +-0 rule (the fill only
// where the kept bits are not +-0); without it the fill is a plain OR.
template <int WB, bool TINY = true>
[[gnu::always_inline]] inline vf planes16(const uint8_t* a, const uint8_t* b, const uint8_t* c, int n) {
  if (n < W) [[unlikely]] return planes_part<WB>(a, b, c, n);
  const __m128i av = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i zero = _mm_setzero_si128();
  __m128i low;
  if constexpr (WB == 16) {
    low = _mm_or_si128(nibbles16<true>(b), nibbles16<false>(c));
  } else {
    const __m128i bn = WB == 12 ? nibbles16<true>(b) : zero;
    low = _mm_or_si128(bn, _mm_set1_epi8(WB == 8 ? char(0x80) : char(0x08)));
    if constexpr (TINY) {  // kept bits +-0: plane A's magnitude bits and the B nibble all 0
      const __m128i kept = _mm_or_si128(_mm_and_si128(av, _mm_set1_epi8(0x7f)), bn);
      low = _mm_andnot_si128(_mm_cmpeq_epi8(kept, zero), low);
    }
  }
  return {_mm256_cvtph_ps(_mm_unpacklo_epi8(low, av)), _mm256_cvtph_ps(_mm_unpackhi_epi8(low, av))};
}

// 32 consecutive elements of the planes at WB bits (a: 32 bytes of plane A; b, c: 16 bytes of B and C
// nibbles) as out[0] = elements 0-15, out[1] = 16-31. Why 256-bit ops: Zen 2 and later run them at full
// width, and each nibble plane then costs one broadcast load, one in-lane byte shuffle (byte j to the bytes
// of elements 2j and 2j+1), a shift, a blend and a mask for 32 elements, where planes16 spends five
// 128-bit ops on 16. The unpacks interleave within 128-bit lanes, so lane 0 of the unpacked words holds
// elements 0-7 (8-15), lane 1 16-23 (24-31): converting lane by lane gives element order back for free.
template <int WB, bool TINY = true>
[[gnu::always_inline]] inline void planes32(const uint8_t* a, const uint8_t* b, const uint8_t* c, vf* out) {
  const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i zero = _mm256_setzero_si256();
  __m256i low;
  auto spread = [](const uint8_t* p) {  // nibble byte j (elements 2j, 2j+1) into both bytes of word j
    const __m256i dup = _mm256_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7,  //
                                         8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), dup);
  };
  const __m256i even = _mm256_set1_epi16(0x00ff);  // the bytes of even elements
  __m256i bn = zero;
  if constexpr (WB > 8) {  // B into each byte's high half: the even element's low nibble shifted up
    const __m256i x = spread(b);
    bn = _mm256_and_si256(_mm256_blendv_epi8(x, _mm256_slli_epi16(x, 4), even), _mm256_set1_epi8(char(0xf0)));
  }
  if constexpr (WB == 16) {  // C into the low half: the odd element's high nibble shifted down
    const __m256i x = spread(c);
    low = _mm256_or_si256(bn, _mm256_and_si256(_mm256_blendv_epi8(_mm256_srli_epi16(x, 4), x, even), _mm256_set1_epi8(0x0f)));
  } else {
    low = _mm256_or_si256(bn, _mm256_set1_epi8(WB == 8 ? char(0x80) : char(0x08)));
    if constexpr (TINY) {  // kept bits +-0: plane A's magnitude bits and the B nibble all 0
      const __m256i kept = _mm256_or_si256(_mm256_and_si256(av, _mm256_set1_epi8(0x7f)), bn);
      low = _mm256_andnot_si256(_mm256_cmpeq_epi8(kept, zero), low);
    }
  }
  const __m256i w0 = _mm256_unpacklo_epi8(low, av), w1 = _mm256_unpackhi_epi8(low, av);
  out[0] = {_mm256_cvtph_ps(_mm256_castsi256_si128(w0)), _mm256_cvtph_ps(_mm256_castsi256_si128(w1))};
  out[1] = {_mm256_cvtph_ps(_mm256_extracti128_si256(w0, 1)), _mm256_cvtph_ps(_mm256_extracti128_si256(w1, 1))};
}

// AVX2's block readers (planes32, planes16) give elements in order: there is no planes64 order to undo.
inline void order64(vf*) {}
inline void unorder64(float*) {}

#else

// The fp16 patterns are put together per element, then converted 16 at a time (F16C on AVX2).
inline vf half_keep(const uint16_t* p, mk m, Keep k) {
  uint16_t h[W] = {};
  for (int i = 0; i < m; ++i) h[i] = keep_scalar(p[i], k);
  return load_half_full(h);
}

template <int WB, bool TINY = true>
inline vf planes16(const uint8_t* a, const uint8_t* b, const uint8_t* c, int n) {
  uint16_t h[W] = {};
  for (int i = 0; i < lanes(n); ++i) h[i] = plane_scalar<WB>(a[i], WB > 8 ? nibble(b, i) : 0, WB > 12 ? nibble(c, i) : 0);
  return load_half_full(h);
}

#endif

}  // namespace kvq
