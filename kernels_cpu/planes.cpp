// AlignedKV's bit planes (kvquant.alignment.PlaneStore), read in place at the widths the rules chose.
//
// Keys are stored channel-major per 64-token block, so the key loader fills the driver's buffer
// channel-major too (16 tokens of one channel per vector: plane A bytes, B and C nibbles, each read
// only where the channel's width needs it) and the driver scores it with dot_channels. Values are
// token-major: each token's row is read at its own width, and a 16-token group whose tokens share
// one width (v_block >= 16) takes one branch for the whole group. The fp16 tails are read whole.
// Software prefetch, PF tokens ahead, of plane A and of the B/C planes the widths read there
// (per-column key widths: the current block's; values: the widest in the group ahead); with cold
// caches it measured a few percent faster than none (A/B in one run, 16K tokens, noisy).
#include <atomic>

#include "bits.h"
#include "kernels.h"

// Block readers (block_scores, value_rows64) for AVX-512 and AVX2; the portable build reads through the buffer.
#define KVQ_BLOCKS (KVQ_AVX512 || KVQ_AVX2)

namespace kvq {

namespace {

constexpr int KB = 64;  // tokens per key block (kvquant.alignment.BLOCK)
constexpr int32_t ZERO_EXPONENT = -1024;      // kvquant.bits.ZERO_EXPONENT: floor_log2 of 0
constexpr int32_t NO_CONTRIBUTION = 1 << 20;  // kvquant.alignment.NO_CONTRIBUTION: the gap of an unread token
constexpr int PFB = 2;                        // key blocks prefetched ahead (PF tokens)
constexpr int PFW = 256;  // plane-A rows prefetched ahead by the paper rule's width loop (token_widths16)
constexpr int64_t RESCORE_BUDGET = 512;  // (key, query row) scores rule_from_fp32 may redo in fp64 per item
constexpr double HEAVY = 0x1p-7;          // a probability whose key it rescores once an item has an open unit
constexpr int PFE = 2;    // groups of 16 exponent rows prefetched ahead by the block rule's (block_widths16)
constexpr int PF1 = 16;  // value rows' plane A also prefetched this many tokens ahead into L1 (its loads then hit L1)

// kvquant.bits.floor_log2 of an fp64 value: the exponent field, frexp only for subnormals.
inline int32_t floor_log2(double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, 8);
  const int32_t field = int32_t((bits >> 52) & 0x7ff);
  if (field != 0) return field - 1023;
  if (x == 0.0) return ZERO_EXPONENT;
  int e;
  std::frexp(x, &e);
  return e - 1;
}

// out = exp(in) for in <= 0 (-inf included). AVX-512: 2^k * P(r), r = in - k ln 2 in two fma steps, P
// the degree-13 Taylor polynomial (truncation < 5e-18 for |r| <= ln2 / 2), scaled by scalef (so
// subnormal results round once); within a few ulp of libm's exp, as far from it as torch's own
// vectorized exp is. AVX2: the same polynomial and rounding (exp4); elsewhere libm's exp.
#if KVQ_AVX512
inline __m512d exp8(__m512d v) {
  constexpr double C[14] = {1.0,           1.0,           1.0 / 2,        1.0 / 6,         1.0 / 24,
                            1.0 / 120,     1.0 / 720,     1.0 / 5040,     1.0 / 40320,     1.0 / 362880,
                            1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800};
  v = _mm512_max_pd(v, _mm512_set1_pd(-746.0));  // exp(-746) rounds to 0 (and keeps -inf out of r)
  const __m512d k = _mm512_roundscale_pd(_mm512_mul_pd(v, _mm512_set1_pd(1.4426950408889634)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512d r = _mm512_fnmadd_pd(k, _mm512_set1_pd(0.6931471803691238), v);
  r = _mm512_fnmadd_pd(k, _mm512_set1_pd(1.9082149292705877e-10), r);
  __m512d p = _mm512_set1_pd(C[13]);
  for (int j = 12; j >= 0; --j) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(C[j]));
  return _mm512_scalef_pd(p, k);
}
#elif KVQ_AVX2
// exp8's polynomial on N vectors of 4 lanes, step by step across them (N independent chains of 13 fma: one at
// a time, the scheduler fills with a few chains' waiting ops). Where a lane's 2^k * P(r) may be subnormal
// (k < -1021), 2^k is taken as two normal powers of two, so that the result is rounded once, as scalef rounds
// it; elsewhere both products are exact, so one power gives the same bits.
template <int N>
inline void exp4(__m256d* v) {
  constexpr double C[14] = {1.0,           1.0,           1.0 / 2,        1.0 / 6,         1.0 / 24,
                            1.0 / 120,     1.0 / 720,     1.0 / 5040,     1.0 / 40320,     1.0 / 362880,
                            1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800};
  auto pow2 = [](__m256d j) {  // j integral, -1022 <= j <= 0: the low bits of j + 1.5 * 2^52 hold j
    const __m256i bits = _mm256_castpd_si256(_mm256_add_pd(j, _mm256_set1_pd(0x1.8p52)));
    return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(bits, _mm256_set1_epi64x(1023)), 52));
  };
  __m256d k[N], r[N], p[N], tiny = _mm256_setzero_pd();
  for (int i = 0; i < N; ++i) {
    r[i] = _mm256_max_pd(v[i], _mm256_set1_pd(-746.0));
    k[i] = _mm256_round_pd(_mm256_mul_pd(r[i], _mm256_set1_pd(1.4426950408889634)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r[i] = _mm256_fnmadd_pd(k[i], _mm256_set1_pd(0.6931471803691238), r[i]);
    tiny = _mm256_or_pd(tiny, _mm256_cmp_pd(k[i], _mm256_set1_pd(-1021.0), _CMP_LT_OQ));
  }
  for (int i = 0; i < N; ++i) r[i] = _mm256_fnmadd_pd(k[i], _mm256_set1_pd(1.9082149292705877e-10), r[i]);
  for (int i = 0; i < N; ++i) p[i] = _mm256_fmadd_pd(_mm256_set1_pd(C[13]), r[i], _mm256_set1_pd(C[12]));
  for (int j = 11; j >= 0; --j)
    for (int i = 0; i < N; ++i) p[i] = _mm256_fmadd_pd(p[i], r[i], _mm256_set1_pd(C[j]));
  if (_mm256_movemask_pd(tiny) == 0) {
    for (int i = 0; i < N; ++i) v[i] = _mm256_mul_pd(p[i], pow2(k[i]));
    return;
  }
  for (int i = 0; i < N; ++i) {
    const __m256d k1 = _mm256_floor_pd(_mm256_mul_pd(k[i], _mm256_set1_pd(0.5)));
    v[i] = _mm256_mul_pd(_mm256_mul_pd(p[i], pow2(k1)), pow2(_mm256_sub_pd(k[i], k1)));
  }
}
#endif

inline void exp_nonpositive(const double* in, double* out, int64_t n) {
#if KVQ_AVX512
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm512_storeu_pd(out + i, exp8(_mm512_loadu_pd(in + i)));
  if (i < n) {
    const __mmask8 m = __mmask8((1u << (n - i)) - 1);
    _mm512_mask_storeu_pd(out + i, m, exp8(_mm512_mask_loadu_pd(_mm512_setzero_pd(), m, in + i)));
  }
#elif KVQ_AVX2
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256d v[2] = {_mm256_loadu_pd(in + i), _mm256_loadu_pd(in + i + 4)};
    exp4<2>(v);
    _mm256_storeu_pd(out + i, v[0]);
    _mm256_storeu_pd(out + i + 4, v[1]);
  }
  if (i < n) {
    alignas(32) double t[8] = {};
    std::copy(in + i, in + n, t);
    __m256d v[2] = {_mm256_load_pd(t), _mm256_load_pd(t + 4)};
    exp4<2>(v);
    _mm256_store_pd(t, v[0]);
    _mm256_store_pd(t + 4, v[1]);
    std::copy(t, t + (n - i), out + i);
  }
#else
  for (int64_t i = 0; i < n; ++i) out[i] = std::exp(in[i]);
#endif
}

// Largest of x[0..n) and x[0..n) summed, each over 8 interleaved lanes. The max in vector ops where there
// are (maxpd is x > m ? x : m, lane for lane the loop's rule): GCC left the loop scalar on AVX2, where it
// took ~8% of the block rule's step at 9q/3kv x 64, 8K (perf).
inline double max_of(const double* x, int64_t n) {
  alignas(32) double m[8];
  std::fill(m, m + 8, -INFINITY);
  int64_t t = 0;
#if KVQ_AVX512 || KVQ_AVX2
  __m256d m0 = _mm256_load_pd(m), m1 = m0;
  for (; t + 8 <= n; t += 8) {
    m0 = _mm256_max_pd(_mm256_loadu_pd(x + t), m0);
    m1 = _mm256_max_pd(_mm256_loadu_pd(x + t + 4), m1);
  }
  _mm256_store_pd(m, m0);
  _mm256_store_pd(m + 4, m1);
#endif
  for (; t + 8 <= n; t += 8)
    for (int j = 0; j < 8; ++j) m[j] = x[t + j] > m[j] ? x[t + j] : m[j];
  for (; t < n; ++t) m[0] = x[t] > m[0] ? x[t] : m[0];
  return *std::max_element(m, m + 8);
}

inline double sum_of(const double* x, int64_t n) {
  double a[8] = {};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8)
    for (int j = 0; j < 8; ++j) a[j] += x[t + j];
  for (; t < n; ++t) a[0] += x[t];
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// n (<= 16) token rows of values at WB bits: a row holds D bytes of A and D/2 of B and C.
template <int NC, int WB, bool TINY>
inline void value_rows(const PlaneArgs& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) {
  const uint8_t *a = s.va.at(b, h, t0), *bp = s.vb.at(b, h, t0), *cp = s.vc.at(b, h, t0);
  for (int t = 0; t < n; ++t) {
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const vf x = planes16<WB, TINY>(a + t * s.va.s2 + c * W, bp + t * s.vb.s2 + c * W / 2,
                                      cp + t * s.vc.s2 + c * W / 2, D - c * W);
      store(buf + t * NC * W + c * W, x, lanes(W));
    }
  }
}

template <int NC, bool TINY>
inline void value_rows_at(int width, const PlaneArgs& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) {
  switch (width) {
    case 8: return value_rows<NC, 8, TINY>(s, b, h, t0, n, D, buf);
    case 12: return value_rows<NC, 12, TINY>(s, b, h, t0, n, D, buf);
    default: return value_rows<NC, 16, TINY>(s, b, h, t0, n, D, buf);
  }
}

// A key block's channels grouped by width (8, 12, 16), so each group is read without a branch per
// channel (AVX-512's block readers, the 16-token path; AVX2's block_scores reads in channel order, it says why).
struct KeyChannels {
  const uint8_t* widths = nullptr;  // the widths row these lists were made from
  int64_t stride = 0;               // its channel stride (0: one width for every channel)
  bool listed = false;              // whether the lists were made (else only the counts)
  int32_t list[3][DMAX + 16];       // + 16: build's vector stores run past a list's end
  int count[3] = {0, 0, 0};
  int width(int c) const { return widths[c * stride]; }  // AVX2's block_scores reads the channels in order
  // Per-column widths build once a head; AlignedKV+'s per-block widths once a block, where a scalar loop
  // (a store-to-load chain through count[k]) slowed its key pass visibly: 16 channels a vector. AVX2's
  // block_scores needs only the counts (lists = false), 32 channels a compare: rebuilding the lists every
  // block was a visible share of AlignedKV+'s key pass in a perf profile.
  void build(const uint8_t* w, int64_t wc, int D, bool lists = true) {
    if (w == widths && (listed || !lists)) return;  // per-column widths: one row for every block of the head
    widths = w, stride = wc, listed = lists;
    count[0] = count[1] = count[2] = 0;
    int c = 0;
#if KVQ_AVX2
    if (!lists) {
      if (wc == 1)
        for (; c + 32 <= D; c += 32) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
          count[0] += __builtin_popcount(unsigned(_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, _mm256_set1_epi8(8)))));
          count[1] += __builtin_popcount(unsigned(_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, _mm256_set1_epi8(12)))));
        }
      for (; c < D; ++c) count[(w[c * wc] - 8) / 4] += 1;
      count[2] = D - count[0] - count[1];  // widths are 8, 12 or 16 (checked when the call was made)
      return;
    }
#endif
#if KVQ_AVX512
    if (wc == 1)
      for (; c + 16 <= D; c += 16) {
        const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c)));
        const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(c), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                                        9, 10, 11, 12, 13, 14, 15));
        for (int k = 0; k < 3; ++k) {
          const __mmask16 m = _mm512_cmpeq_epi32_mask(wide, _mm512_set1_epi32(8 + 4 * k));
          _mm512_storeu_si512(list[k] + count[k], _mm512_maskz_compress_epi32(m, index));
          count[k] += __builtin_popcount(m);
        }
      }
#endif
    // Elsewhere c goes into every list at its end and only its width's count moves: no branch, and the counts
    // stay in registers (no chain of stores and loads through count[k]).
    int n0 = count[0], n1 = count[1], n2 = count[2];
    for (; c < D; ++c) {
      const int k = (w[c * wc] - 8) / 4;  // 8, 12, 16 -> 0, 1, 2 (checked when the call was made)
      list[0][n0] = list[1][n1] = list[2][n2] = c;
      n0 += k == 0;
      n1 += k == 1;
      n2 += k == 2;
    }
    count[0] = n0, count[1] = n1, count[2] = n2;
  }
};

// Whether block_scores reads the width lists (AVX-512) or only their counts (AVX2: channels in order).
constexpr bool BLOCK_LISTS = KVQ_AVX512;

template <int WB, bool TINY>
inline void key_channels(const KeyChannels& ch, const uint8_t* a, const uint8_t* bp, const uint8_t* cp, int n,
                         float* buf) {
  const int k = (WB - 8) / 4;
  for (int i = 0; i < ch.count[k]; ++i) {
    const int c = ch.list[k][i];
    store(buf + c * W, planes16<WB, TINY>(a + c * KB, bp + c * KB / 2, cp + c * KB / 2, n), lanes(W));
  }
}

// 16 tokens of a key block from offset o, channel-major into buf[c*W ...], each channel at its width.
template <bool TINY>
inline void key_group(const KeyChannels& ch, const uint8_t* a, const uint8_t* bp, const uint8_t* cp, int n,
                      float* buf) {
  key_channels<8, TINY>(ch, a, bp, cp, n, buf);
  key_channels<12, TINY>(ch, a, bp, cp, n, buf);
  key_channels<16, TINY>(ch, a, bp, cp, n, buf);
}

// block_scores' independent sums per row (each channel goes to one, they are added at the end): as many as
// the registers hold. Why: fewer FMAs per chain hide their latency, and the rule's fp32 error bound
// (score_chain) shrinks with the chain. Up to 3 rows also sum each set's channels in chunks of SCORE_CHUNK,
// added into the set's total (16 / 16 / 24 registers for 1 / 2 / 3 rows): one row's chain is
// SCORE_CHUNK + D / 16 + 4 roundings (20 at D = 128, against 36 for 4 unchunked sets), 3 rows'
// SCORE_CHUNK + D / 8 + 3 (19 at D = 64, against 35 for 2 sets): narrower bounds, fewer items need fp64.
// AVX2's 16 registers hold one set per row (SCORE_CHUNK + D / 8 + 3 for 1-3 rows).
constexpr int score_sets(int nr) { return KVQ_AVX512 && nr == 1 ? 2 : 1; }
constexpr int SCORE_CHUNK = 8;

#if KVQ_BLOCKS
// A key block's channel as block_scores reads it: its planes' addresses, and a prefetch of the same channel
// of block j + PFB (into L2) and of block j + 1 (into L1) as this block's width reads it (a burst of a whole
// block's lines measured slower). With AlignedKV+'s widths per block this misses a plane where a later
// block's channel is wider; looking each one's width up cost more (its key pass got slower, not faster).
struct KeyBlockPlanes {
  const uint8_t *a, *bp, *cp;
  int64_t pa = 0, pb = 0, pc = 0, na, nb, nc;
  bool ahead, near1;
  KeyBlockPlanes(const PlaneArgs& s, int64_t b, int64_t h, int64_t j)
      : a(s.ka.at(b, h, j)), bp(s.kb.at(b, h, j)), cp(s.kc.at(b, h, j)), na(s.ka.s2), nb(s.kb.s2), nc(s.kc.s2),
        ahead(j + PFB < s.nb), near1(j + 1 < s.nb) {
    if (ahead) pa = PFB * s.ka.s2, pb = PFB * s.kb.s2, pc = PFB * s.kc.s2;
  }
  template <int WB>
  [[gnu::always_inline]] void prefetch(int c) const {
    const uint8_t *ac = a + c * KB, *bc = bp + c * KB / 2, *cc = cp + c * KB / 2;
    if (ahead) {
      __builtin_prefetch(ac + pa, 0, 2);
      if (WB > 8) __builtin_prefetch(bc + pb, 0, 2);
      if (WB > 12) __builtin_prefetch(cc + pc, 0, 2);
    }
    if (near1) {
      __builtin_prefetch(ac + na, 0, 3);
      if (WB > 8) __builtin_prefetch(bc + nb, 0, 3);
      if (WB > 12) __builtin_prefetch(cc + nc, 0, 3);
    }
  }
#if KVQ_AVX512
  // Channel c's 64 tokens at WB bits in planes64's order, after prefetching that channel further on.
  template <int WB, bool TINY>
  [[gnu::always_inline]] void read(int c, vf* x) const {
    prefetch<WB>(c);
    planes64<WB, TINY>(a + c * KB, bp + c * KB / 2, cp + c * KB / 2, x);
  }
#else
  // Channel c's TOK (16 or 32) tokens from o at WB bits, in order (TOK / 16 vectors).
  template <int WB, bool TINY, int TOK>
  [[gnu::always_inline]] void part(int c, int o, vf* x) const {
    const uint8_t *ac = a + c * KB + o, *bc = bp + (c * KB + o) / 2, *cc = cp + (c * KB + o) / 2;
    if constexpr (TOK == 32)
      planes32<WB, TINY>(ac, bc, cc, x);
    else
      x[0] = planes16<WB, TINY>(ac, bc, cc, W);
  }
#endif
};

// Value row t (of the rows from a, bp, cp) PF tokens ahead into L2: plane A, and B / C where `width` (that row's)
// reads them; plane A also PF1 tokens ahead into L1. Always inlined: as a lambda of its own GCC dropped the call
// (no prefetch left in value_rows64's loop).
[[gnu::always_inline]] inline void prefetch_value_row(const PlaneArgs& s, const uint8_t* a, const uint8_t* bp,
                                                      const uint8_t* cp, int t, int width, int D) {
  for (int c = 0; c < D; c += 64) {
    __builtin_prefetch(a + (t + PF) * s.va.s2 + c, 0, 2);
    __builtin_prefetch(a + (t + PF1) * s.va.s2 + c, 0, 3);
  }
  if (width >= 12)
    for (int c = 0; c < D / 2; c += 64) __builtin_prefetch(bp + (t + PF) * s.vb.s2 + c, 0, 2);
  if (width >= 16)
    for (int c = 0; c < D / 2; c += 64) __builtin_prefetch(cp + (t + PF) * s.vc.s2 + c, 0, 2);
}
#endif

#if KVQ_AVX512

// Scores of key block j's 64 tokens for NR (<= 4) rows, d[r*BT + t] = q_r . k_t in fp32: each channel's
// 64 tokens read once at its width (planes64) and multiplied into every row's sums, which stay in
// registers in planes64's token order until the end; no buffer.
template <int NR, bool TINY>
void block_scores(const PlaneArgs& s, const KeyChannels& ch, int64_t b, int64_t h, int64_t j, const float* const* q,
                  float* d) {
  constexpr int S = score_sets(NR);
  const KeyBlockPlanes planes(s, b, h, j);
  vf acc[S][NR][4];
  for (int e = 0; e < S; ++e)
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < 4; ++u) acc[e][r][u] = zero();
  auto channel = [&]<int WB>(int c, vf(&sum)[NR][4]) {
    vf x[4];
    planes.read<WB, TINY>(c, x);
    for (int r = 0; r < NR; ++r) {
      const vf qc = set1(q[r][c]);
      for (int u = 0; u < 4; ++u) sum[r][u] = fma(qc, x[u], sum[r][u]);
    }
  };
  constexpr bool chunked = NR <= 3;
  vf total[S][chunked ? NR : 1][4];  // each set's chunks added here
  for (auto& t : total)
    for (auto& y : t)
      for (auto& x : y) x = zero();
  auto chunk_done = [&]() {
    for (int e = 0; e < S; ++e)
      for (int r = 0; r < (chunked ? NR : 1); ++r)
        for (int u = 0; u < 4; ++u) {
          total[e][r][u] = add(total[e][r][u], acc[e][r][u]);
          acc[e][r][u] = zero();
        }
  };
  auto group = [&]<int WB>() {  // the group's i-th channel into set i % S
    const int k = (WB - 8) / 4, n = ch.count[k];
    for (int i = 0; i < n; i += S) {
#pragma GCC unroll 4
      for (int e = 0; e < S; ++e)
        if (i + e < n) channel.template operator()<WB>(ch.list[k][i + e], acc[e]);
      if constexpr (chunked)
        if ((i / S + 1) % SCORE_CHUNK == 0) chunk_done();
    }
    if constexpr (chunked) chunk_done();
  };
  group.template operator()<8>();
  group.template operator()<12>();
  group.template operator()<16>();
  if constexpr (chunked)
    for (int e = 0; e < S; ++e)
      for (int r = 0; r < NR; ++r)
        for (int u = 0; u < 4; ++u) acc[e][r][u] = total[e][r][u];
  for (int r = 0; r < NR; ++r) {
    vf sum[4];
    for (int u = 0; u < 4; ++u) {
      if constexpr (S == 2)
        sum[u] = add(acc[0][r][u], acc[1][r][u]);
      else
        sum[u] = acc[0][r][u];
    }
    order64(sum);
    for (int u = 0; u < 4; ++u) store(d + r * BT + u * W, sum[u], lanes(W));
  }
}

// The exact path's scores of key block j's 64 tokens for NR (<= 3) rows in fp64, d[r*KB + t] =
// scaling * q_r . k_t (q: the rows widened to fp64 once an item, DMAX apart; 3 rows' 24 sums, their 3
// broadcasts and a channel's elements about fill the registers): as block_scores reads the planes, each
// channel's fp32 elements widened and multiplied into 8 fp64 sums per row (one chain per lane over the head's
// channels, D + 1 roundings with the scaling; torch's fp64 matmul sums in an order of its own anyway). Why: the
// 16-token buffer path it replaces was far slower than the fp32 key pass, and every item the fp32 bounds cannot
// decide pays it on top of that pass.
template <int NR, bool TINY>
void block_scores_f64(const PlaneArgs& s, const KeyChannels& ch, int64_t b, int64_t h, int64_t j, const double* q,
                      double scaling, double* d) {
  const KeyBlockPlanes planes(s, b, h, j);
  __m512d acc[NR][8];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < 8; ++u) acc[r][u] = _mm512_setzero_pd();
  auto group = [&]<int WB>() {
    const int k = (WB - 8) / 4;
    for (int i = 0; i < ch.count[k]; ++i) {
      const int c = ch.list[k][i];
      vf x[4];
      planes.read<WB, TINY>(c, x);
      for (int u = 0; u < 4; ++u) {
        const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x[u]));
        const __m512d hi = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(x[u]), 1)));
        for (int r = 0; r < NR; ++r) {
          acc[r][2 * u] = _mm512_fmadd_pd(_mm512_set1_pd(q[r * DMAX + c]), lo, acc[r][2 * u]);
          acc[r][2 * u + 1] = _mm512_fmadd_pd(_mm512_set1_pd(q[r * DMAX + c]), hi, acc[r][2 * u + 1]);
        }
      }
    }
  };
  group.template operator()<8>();
  group.template operator()<12>();
  group.template operator()<16>();
  // planes64's order: vector u's halves hold tokens first[u] .. + 7 and first[u] + 16 .. + 23
  constexpr int first[4] = {0, 32, 8, 40};
  const __m512d sc = _mm512_set1_pd(scaling);
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < 4; ++u) {
      _mm512_storeu_pd(d + r * KB + first[u], _mm512_mul_pd(acc[r][2 * u], sc));
      _mm512_storeu_pd(d + r * KB + first[u] + 16, _mm512_mul_pd(acc[r][2 * u + 1], sc));
    }
}

// acc[r*DMAX + c] += sum_t p[r*BT + t] * v_t[c] over n value rows from t0, all at width WB, for NR (<= 4)
// rows, the channels in planes64's order (the caller puts them back with order64 once): each row is read
// 64 channels at a time and multiplied into every row's sums, which stay in registers over the n tokens.
// With 128 channels and up to 2 rows all sums fit in registers, so a row's two halves are read one after
// the other (each row in address order: measured faster than a pass per 64 channels at 32x128, 16K);
// otherwise a pass over the tokens per 64 channels. Prefetch: the rows PF tokens ahead, plane A, and B / C
// where their widths (wa[t * ws], from token t0 + PF; nullptr past the planes) read them, into L2; plane A
// PF1 tokens ahead into L1 (fused fp16's rows measured no faster with the same).
template <int NR, int WB, bool TINY>
void value_rows64(const PlaneArgs& s, int64_t b, int64_t h, int64_t t0, int n, int D, const uint8_t* wa, int64_t ws,
                  const float* p, float* acc) {
  const uint8_t *a = s.va.at(b, h, t0), *bp = s.vb.at(b, h, t0), *cp = s.vc.at(b, h, t0);
  auto pass = [&]<int CK>(int c0) {  // CK chunks of 64 channels from c0, token by token
    vf x[NR][4 * CK];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < 4 * CK; ++u) x[r][u] = load(acc + r * DMAX + c0 + u * W, lanes(W));
    for (int t = 0; t < n; ++t) {
      if (c0 == 0 && wa != nullptr) prefetch_value_row(s, a, bp, cp, t, wa[t * ws], D);
      vf v[4 * CK];
      for (int k = 0; k < CK; ++k) {
        const int c = c0 + 64 * k;
        planes64<WB, TINY>(a + t * s.va.s2 + c, bp + t * s.vb.s2 + c / 2, cp + t * s.vc.s2 + c / 2, v + 4 * k);
      }
      for (int r = 0; r < NR; ++r) {
        const vf pr = set1(p[r * BT + t]);
        for (int u = 0; u < 4 * CK; ++u) x[r][u] = fma(pr, v[u], x[r][u]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < 4 * CK; ++u) store(acc + r * DMAX + c0 + u * W, x[r][u], lanes(W));
  };
  if (NR <= 2 && D == 128) return pass.template operator()<2>(0);
  for (int c0 = 0; c0 < D; c0 += 64) pass.template operator()<1>(c0);
}

#elif KVQ_AVX2
// AVX2 has 16 vector registers where AVX-512 has 32, so its block readers work in slices: keys TOK tokens of
// the block at a time (32 for 1-2 rows, 16 for 3-4), values CP channels of a row.

// block_scores as on AVX-512 (one set of channels per row; 1-3 rows summed in chunks of SCORE_CHUNK into a
// total, 4 rows in one chain: score_chain's bounds), the block's tokens TOK at a time: each channel's TOK
// tokens read at its width (planes32 / planes16) and multiplied into every row's sums. For 2 rows the totals
// live in memory (a load, add and store per chunk) so that the sums and a 32-token read fill the registers;
// for 1 and 3 rows they fit beside 32- and 16-token reads (one row's in memory measured ~5% slower). 4 rows
// are not chunked: with totals in memory their attention at 8 bits took ~25% longer, only the key pass
// differing (A/B of two builds in one process, 32q/8kv x 128, 16K). Prefetch in the first slice, as
// AVX-512's read does. The channels are read in channel order with a branch on each one's width
// (the same sequence every block of a head): in the width lists' order the block's planes were
// swept three times with gaps (Zen 3, `scripts/ab_kernels_cpu.py --cases kr8`: the key pass in channel order
// 0.87-1.00x the lists' time).
// AVX-512's block_scores still reads by the lists (unmeasured there).
template <int NR, bool TINY>
void block_scores(const PlaneArgs& s, const KeyChannels& ch, int64_t b, int64_t h, int64_t j, const float* const* q,
                  float* d) {
  static_assert(score_sets(NR) == 1, "AVX2 sums each row's channels in one set");
  constexpr int TOK = NR <= 2 ? 32 : 16, V = TOK / W;
  constexpr bool chunked = NR <= 3, in_memory = NR == 2;
  const KeyBlockPlanes planes(s, b, h, j);
  if constexpr (in_memory)
    for (int r = 0; r < NR; ++r) std::fill(d + r * BT, d + r * BT + KB, 0.0f);
  for (int o = 0; o < KB; o += TOK) {
    vf acc[NR][V], total[chunked && !in_memory ? NR : 1][V];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < V; ++u) acc[r][u] = zero();
    for (auto& t : total)
      for (auto& x : t) x = zero();
    auto chunk_done = [&]() {
      for (int r = 0; r < NR; ++r)
        for (int u = 0; u < V; ++u) {
          if constexpr (in_memory) {
            float* sum = d + r * BT + o + u * W;
            store(sum, add(load(sum, lanes(W)), acc[r][u]), lanes(W));
          } else {
            total[r][u] = add(total[r][u], acc[r][u]);
          }
          acc[r][u] = zero();
        }
    };
    auto channel = [&]<int WB>(int c, int i) {
      if (o == 0) planes.prefetch<WB>(c);
      vf x[V];
      planes.part<WB, TINY, TOK>(c, o, x);
      for (int r = 0; r < NR; ++r) {
        const vf qc = set1(q[r][c]);
        for (int u = 0; u < V; ++u) acc[r][u] = fma(qc, x[u], acc[r][u]);
      }
      if constexpr (chunked)
        if ((i + 1) % SCORE_CHUNK == 0) chunk_done();
    };
    const int D = ch.count[0] + ch.count[1] + ch.count[2];
    for (int c = 0; c < D; ++c) {
      const int wb = ch.width(c);
      if (wb == 8)
        channel.template operator()<8>(c, c);
      else if (wb == 12)
        channel.template operator()<12>(c, c);
      else
        channel.template operator()<16>(c, c);
    }
    if constexpr (chunked) chunk_done();
    if constexpr (!in_memory)
      for (int r = 0; r < NR; ++r)
        for (int u = 0; u < V; ++u) store(d + r * BT + o + u * W, chunked ? total[r][u] : acc[r][u], lanes(W));
  }
}

// value_rows64 as on AVX-512 (the same arguments; the sums in element order, which is AVX2's order64), CP
// channels a pass over the n tokens: 64 for one row, 32 for 2-3 (3 rows' 12 registers of sums and a 32-channel
// read spill a little, yet measured ~10% faster than 16 channels a pass), 16 for 4.
template <int NR, int WB, bool TINY>
void value_rows64(const PlaneArgs& s, int64_t b, int64_t h, int64_t t0, int n, int D, const uint8_t* wa, int64_t ws,
                  const float* p, float* acc) {
  constexpr int CP = NR == 1 ? 64 : NR <= 3 ? 32 : 16, V = CP / W;
  const uint8_t *a = s.va.at(b, h, t0), *bp = s.vb.at(b, h, t0), *cp = s.vc.at(b, h, t0);
  for (int c0 = 0; c0 < D; c0 += CP) {
    vf x[NR][V];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < V; ++u) x[r][u] = load(acc + r * DMAX + c0 + u * W, lanes(W));
    for (int t = 0; t < n; ++t) {
      if (c0 == 0 && wa != nullptr) prefetch_value_row(s, a, bp, cp, t, wa[t * ws], D);
      const uint8_t *ar = a + t * s.va.s2 + c0, *br = bp + t * s.vb.s2 + c0 / 2, *cr = cp + t * s.vc.s2 + c0 / 2;
      vf v[V];
      if constexpr (CP == W)
        v[0] = planes16<WB, TINY>(ar, br, cr, W);
      else
        for (int k = 0; k < CP / 32; ++k) planes32<WB, TINY>(ar + 32 * k, br + 16 * k, cr + 16 * k, v + 2 * k);
      for (int r = 0; r < NR; ++r) {
        const vf pr = set1(p[r * BT + t]);
        for (int u = 0; u < V; ++u) x[r][u] = fma(pr, v[u], x[r][u]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < V; ++u) store(acc + r * DMAX + c0 + u * W, x[r][u], lanes(W));
  }
}
#endif

#if KVQ_BLOCKS
// value_rows64 over n tokens from t0 whose widths are w[t * ws], a run of one width at a time (wa: the
// widths PF tokens ahead, as value_rows64 takes them).
template <int NR>
void value_runs(const PlaneArgs& s, int64_t b, int64_t h, int64_t t0, int n, int D, const uint8_t* w, int64_t ws,
                const uint8_t* wa, const float* p, float* acc) {
  for (int i = 0; i < n;) {
    int e = i + 1;
    while (e < n && w[e * ws] == w[i * ws]) ++e;
    const uint8_t* ahead = wa ? wa + i * ws : nullptr;
    auto run = [&]<int WB>() {
      if (s.tiny_v)
        value_rows64<NR, WB, true>(s, b, h, t0 + i, e - i, D, ahead, ws, p + i, acc);
      else
        value_rows64<NR, WB, false>(s, b, h, t0 + i, e - i, D, ahead, ws, p + i, acc);
    };
    if (w[i * ws] == 8)
      run.template operator()<8>();
    else if (w[i * ws] == 12)
      run.template operator()<12>();
    else
      run.template operator()<16>();
    i = e;
  }
}
#endif

template <int NC>
struct PlanesFormat : NoTerms {
  static constexpr bool channel_major_keys = true;
  static constexpr bool fused_reads = true;
  PlaneArgs s;
  struct State {
    KeyChannels channels;
  };
  State state(const Problem&) const { return {}; }

  // The driver's blocks of BT tokens are the key blocks (BT == KB, chunks start at multiples of BT). With
  // block readers (AVX-512, AVX2), for up to 4 rows, a block's first call reads and scores (or adds) all 64
  // tokens and its other calls have nothing left to do; otherwise 16 tokens through the buffer.
  void scores(State& st, int64_t b, int64_t h, int64_t t0, int n, const Rows& R, int D, float* buf, float* d) const {
#if KVQ_BLOCKS
    if (t0 < s.nb * KB && R.n <= 4) {
      if (t0 % KB == 0) {
        st.channels.build(s.kw.at(b, h, t0 / KB), s.kw_c, D, BLOCK_LISTS);
        by_row_count(R.n, [&]<int NR>() {
          if (s.tiny_k)
            block_scores<NR, true>(s, st.channels, b, h, t0 / KB, R.q, d);
          else
            block_scores<NR, false>(s, st.channels, b, h, t0 / KB, R.q, d);
        });
      }
      return;
    }
#endif
    if (keys(st, b, h, t0, n, D, buf))
      dot_channels(buf, n, R, D, d);
    else
      dot_rows<NC>(buf, n, R, D, d);
  }

  void accumulate(State& st, int64_t b, int64_t h, int64_t t0, int n, int nr, int D, const float* p, float* buf,
                  float* acc) const {
#if KVQ_BLOCKS
    const int64_t nv = s.nb * KB;
    if (t0 < nv && nr <= 4 && D % 64 == 0) {
      if (t0 % KB == 0) by_row_count(nr, [&]<int NR>() { block_values<NR>(b, h, t0, D, p, acc); });
      return;
    }
#endif
    values(st, b, h, t0, n, D, buf);
    accumulate_rows<NC>(buf, n, nr, p, acc);
  }

#if KVQ_BLOCKS
  // The KB value rows from t0 (a key block's tokens) added into NR rows' sums: the sums put in planes64's
  // order (AVX-512; AVX2 reads in element order), each run of one width read by value_rows64, the order
  // restored.
  template <int NR>
  void block_values(int64_t b, int64_t h, int64_t t0, int D, const float* p, float* acc) const {
    const int64_t nv = s.nb * KB;
    const uint8_t* w = s.vw.at(b, h, t0);
    const uint8_t* wa = t0 + PF + KB <= nv ? s.vw.at(b, h, t0 + PF) : nullptr;
    for (int r = 0; r < NR; ++r)
      for (int c0 = 0; c0 < D; c0 += 64) unorder64(acc + r * DMAX + c0);
    value_runs<NR>(s, b, h, t0, KB, D, w, s.vw.s2, wa, p, acc);
    for (int r = 0; r < NR; ++r)
      for (int c0 = 0; c0 < D; c0 += 64) {
        vf x[4];
        for (int u = 0; u < 4; ++u) x[u] = load(acc + r * DMAX + c0 + u * W, lanes(W));
        order64(x);
        for (int u = 0; u < 4; ++u) store(acc + r * DMAX + c0 + u * W, x[u], lanes(W));
      }
  }
#endif

  // Channel-major for block tokens (true); the fp16 tail goes token-major (false).
  bool keys(State& st, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    const int64_t nk = s.nb * KB;
    if (t0 >= nk) {
      half_rows<NC>(s.tail_k.row(b, h, t0 - nk), s.tail_k.st, n, D, buf);
      return false;
    }
    const int64_t j = t0 / KB;
    const int o = int(t0 % KB);
    st.channels.build(s.kw.at(b, h, j), s.kw_c, D);
    if (j + PFB < s.nb) {  // a quarter of block j + PFB per group: its A plane, and B, C where read
      const int64_t q = int64_t(D) * KB / 4;
      prefetch_span(s.ka.at(b, h, j + PFB) + (o / W) * q, q);
      if (st.channels.count[1] + st.channels.count[2]) prefetch_span(s.kb.at(b, h, j + PFB) + (o / W) * q / 2, q / 2);
      if (st.channels.count[2]) prefetch_span(s.kc.at(b, h, j + PFB) + (o / W) * q / 2, q / 2);
    }
    const uint8_t* a = s.ka.at(b, h, j) + o;
    const uint8_t* bp = s.kb.at(b, h, j) + o / 2;
    const uint8_t* cp = s.kc.at(b, h, j) + o / 2;
    if (s.tiny_k)
      key_group<true>(st.channels, a, bp, cp, n, buf);
    else
      key_group<false>(st.channels, a, bp, cp, n, buf);
    return true;
  }

  void values(State&, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    const int64_t nv = s.nb * KB;
    if (t0 >= nv) {
      half_rows<NC>(s.tail_v.row(b, h, t0 - nv), s.tail_v.st, n, D, buf);
      return;
    }
    if (t0 + PF + n <= nv) {  // the rows PF tokens ahead: A, and B, C where the widths read them
      const uint8_t* wp = s.vw.at(b, h, t0 + PF);
      int wide = 8;
      for (int t = 0; t < n; ++t) wide = std::max<int>(wide, wp[t * s.vw.s2]);
      prefetch_rows(s.va.at(b, h, t0 + PF), s.va.s2, n, D);
      if (wide >= 12) prefetch_rows(s.vb.at(b, h, t0 + PF), s.vb.s2, n, D / 2);
      if (wide >= 16) prefetch_rows(s.vc.at(b, h, t0 + PF), s.vc.s2, n, D / 2);
    }
    const uint8_t* w = s.vw.at(b, h, t0);
    bool uniform = true;
    for (int t = 1; t < n && uniform; ++t) uniform = w[t * s.vw.s2] == w[0];
    if (s.tiny_v)
      value_group<true>(w, uniform, b, h, t0, n, D, buf);
    else
      value_group<false>(w, uniform, b, h, t0, n, D, buf);
  }

  template <bool TINY>
  void value_group(const uint8_t* w, bool uniform, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    if (uniform) return value_rows_at<NC, TINY>(w[0], s, b, h, t0, n, D, buf);
    for (int t = 0; t < n; ++t) value_rows_at<NC, TINY>(w[t * s.vw.s2], s, b, h, t0 + t, 1, D, buf + t * NC * W);
  }
};

// Rows in[i*in_ld ...] (i < 16) transposed into out[t*ld ...], the first n lanes of each (16x16 floats).
inline void transpose16(const float* in, int n, float* out, int64_t ld, int64_t in_ld = W) {
#if KVQ_AVX512
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * in_ld);
  for (int i = 0; i < 16; i += 2) {  // 32-bit interleave of row pairs
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit interleave of pair pairs
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int k = 0; k < 2; ++k)  // 128-bit lanes of rows 8k..8k+3 with 8k+4..8k+7
    for (int i = 0; i < 4; ++i) {
      t[8 * k + i] = _mm512_shuffle_f32x4(r[8 * k + i], r[8 * k + i + 4], 0x88);
      t[8 * k + i + 4] = _mm512_shuffle_f32x4(r[8 * k + i], r[8 * k + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {  // and of the two halves
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int c = 0; c < 16; ++c) store(out + c * ld, r[c], lanes(n));
#elif KVQ_AVX2
  __m256 blk[2][2][8];  // [rows 8I..][columns 8T..], transposed 8x8 in place
  for (int I = 0; I < 2; ++I)
    for (int T = 0; T < 2; ++T) {
      __m256* r = blk[I][T];
      __m256 t[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + (8 * I + i) * in_ld + 8 * T);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
      }
      for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
      }
    }
  for (int c = 0; c < 16; ++c) store(out + c * ld, vf{blk[0][c / 8][c % 8], blk[1][c / 8][c % 8]}, lanes(n));
#else
  for (int c = 0; c < W; ++c)
    for (int i = 0; i < n; ++i) out[c * ld + i] = in[i * in_ld + c];
#endif
}

// One block's keys, read at their widths, into rows out[t * D + c] (fp32): each channel's 64 tokens as
// block_scores reads them (AVX-512, AVX2), else channel-major vectors of 16 tokens through a small buffer;
// transposed 16 channels at a time.
template <bool TINY>
void read_key_block(const PlaneArgs& s, int64_t b, int64_t h, int64_t j, int D, float* out) {
  KeyChannels ch;
  ch.build(s.kw.at(b, h, j), s.kw_c, D);
#if KVQ_BLOCKS  // each channel's 64 tokens as block_scores reads them, then 16 tokens at a time
  alignas(64) float rows[DMAX * KB];  // [c][t]
  const KeyBlockPlanes planes(s, b, h, j);
  auto read = [&]<int WB>() {
    const int k = (WB - 8) / 4;
    for (int i = 0; i < ch.count[k]; ++i) {
      const int c = ch.list[k][i];
      vf x[4];
#if KVQ_AVX512
      planes64<WB, TINY>(planes.a + c * KB, planes.bp + c * KB / 2, planes.cp + c * KB / 2, x);
      order64(x);
#else  // tokens 0-31 by planes32 (block_scores' read for one row), 32-63 by planes16 (for 2-4 rows)
      planes.part<WB, TINY, 32>(c, 0, x);
      planes.part<WB, TINY, 16>(c, 32, x + 2);
      planes.part<WB, TINY, 16>(c, 48, x + 3);
#endif
      for (int u = 0; u < 4; ++u) store(rows + c * KB + u * W, x[u], lanes(W));
    }
  };
  read.template operator()<8>();
  read.template operator()<12>();
  read.template operator()<16>();
  for (int o = 0; o < KB; o += W)
    for (int c = 0; c < D; c += W) transpose16(rows + c * KB + o, std::min(W, D - c), out + o * D + c, D, KB);
#else
  alignas(64) float buf[DMAX * W];
  for (int o = 0; o < KB; o += W) {
    key_group<TINY>(ch, s.ka.at(b, h, j) + o, s.kb.at(b, h, j) + o / 2, s.kc.at(b, h, j) + o / 2, W, buf);
    for (int c = 0; c < D; c += W) transpose16(buf + c * W, std::min(W, D - c), out + o * D + c, D);
  }
#endif
}


// out[r*W + t] = scaling * sum_c q_r[c] * buf[c*W + t] in fp64 for NR rows and the 16 channel-major
// buffered tokens: each buffer vector is widened once and feeds 2*NR FMA chains; with few rows the
// channels are split over S partial sums too (S*2*NR = 8 chains in flight), added at the end.
template <int NR>
inline void dot_channels_f64(const float* buf, const float* const* q, int D, double scaling, double* out) {
#if KVQ_AVX512
  constexpr int S = NR == 1 ? 4 : NR == 2 ? 2 : 1;
  __m512d acc[S][NR][2];
  for (int u = 0; u < S; ++u)
    for (int r = 0; r < NR; ++r) acc[u][r][0] = acc[u][r][1] = _mm512_setzero_pd();
  auto step = [&](int u, int c) {
    const __m512 x = _mm512_load_ps(buf + c * W);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(x), 1)));
    for (int r = 0; r < NR; ++r) {
      const __m512d qv = _mm512_set1_pd(double(q[r][c]));
      acc[u][r][0] = _mm512_fmadd_pd(qv, lo, acc[u][r][0]);
      acc[u][r][1] = _mm512_fmadd_pd(qv, hi, acc[u][r][1]);
    }
  };
  int c = 0;
  for (; c + S <= D; c += S)
    for (int u = 0; u < S; ++u) step(u, c + u);
  for (; c < D; ++c) step(0, c);
  const __m512d sc = _mm512_set1_pd(scaling);
  for (int r = 0; r < NR; ++r)
    for (int half = 0; half < 2; ++half) {
      __m512d sum = acc[0][r][half];
      for (int u = 1; u < S; ++u) sum = _mm512_add_pd(sum, acc[u][r][half]);
      _mm512_storeu_pd(out + r * W + 8 * half, _mm512_mul_pd(sum, sc));
    }
#elif KVQ_AVX2
  constexpr int S = NR == 1 ? 2 : 1;  // 4 quarter vectors per row: 8 chains for one row, 4*NR otherwise
  __m256d acc[S][NR][4];
  for (int u = 0; u < S; ++u)
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k) acc[u][r][k] = _mm256_setzero_pd();
  auto step = [&](int u, int c) {
    __m256d x[4];
    for (int k = 0; k < 4; ++k) x[k] = _mm256_cvtps_pd(_mm_load_ps(buf + c * W + 4 * k));
    for (int r = 0; r < NR; ++r) {
      const __m256d qv = _mm256_set1_pd(double(q[r][c]));
      for (int k = 0; k < 4; ++k) acc[u][r][k] = _mm256_fmadd_pd(qv, x[k], acc[u][r][k]);
    }
  };
  int c = 0;
  for (; c + S <= D; c += S)
    for (int u = 0; u < S; ++u) step(u, c + u);
  for (; c < D; ++c) step(0, c);
  const __m256d sc = _mm256_set1_pd(scaling);
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < 4; ++k) {
      __m256d sum = acc[0][r][k];
      for (int u = 1; u < S; ++u) sum = _mm256_add_pd(sum, acc[u][r][k]);
      _mm256_storeu_pd(out + r * W + 4 * k, _mm256_mul_pd(sum, sc));
    }
#else
  for (int r = 0; r < NR; ++r) {
    double acc[W] = {};
    for (int c = 0; c < D; ++c)
      for (int t = 0; t < W; ++t) acc[t] += double(q[r][c]) * double(buf[c * W + t]);
    for (int t = 0; t < W; ++t) out[r * W + t] = acc[t] * scaling;
  }
#endif
}

// O_est of one query row into x[0..D): p(t) * |v8(t, c)| over the top-k tokens id[0..kk), summed by the
// pairwise tree of kvquant.alignment.pairwise_sum (x holds (kk + 1) * D).
template <class HighByte>
void o_estimate(const double* p, const int64_t* id, int64_t kk, int D, const float* v8, HighByte&& high_byte,
                std::vector<double>& x) {
  for (int64_t j = 0; j < kk; ++j)
    for (int c = 0; c < D; ++c) x[j * D + c] = p[id[j]] * double(v8[high_byte(id[j], c)]);
  for (int64_t len = kk; len > 1; len = (len + 1) / 2) {
    if (len % 2) std::fill(x.begin() + len * D, x.begin() + (len + 1) * D, 0.0);
    for (int64_t j = 0; j < (len + 1) / 2; ++j)
      for (int c = 0; c < D; ++c) x[j * D + c] = x[2 * j * D + c] + x[(2 * j + 1) * D + c];
  }
}

// The paper's rule with v_block > 1: each block of v_block tokens read at its widest token's width.
inline void widest_per_block(uint8_t* wv, int64_t nv, int64_t v_block) {
  for (int64_t t0 = 0; v_block > 1 && t0 < nv; t0 += v_block) {
    const int64_t te = std::min(nv, t0 + v_block);
    std::fill(wv + t0, wv + te, *std::max_element(wv + t0, wv + te));
  }
}

// One key of the planes (block token t) at its widths, scored in fp64 as the exact path scores it.
inline double plane_key_score(const PlaneArgs& s, int64_t b, int64_t h, int64_t t, const float* q, int D,
                              double scaling) {
  const int64_t j = t / KB;
  const int o = int(t % KB);
  const uint8_t *a = s.ka.at(b, h, j), *bp = s.kb.at(b, h, j), *cp = s.kc.at(b, h, j), *w = s.kw.at(b, h, j);
  double acc = 0.0;
  for (int c = 0; c < D; ++c) {
    const uint8_t x = a[c * KB + o], bn = nibble(bp + c * KB / 2, o), cn = nibble(cp + c * KB / 2, o);
    const int wb = w[c * s.kw_c];
    const uint16_t bits = wb == 8 ? plane_scalar<8>(x, 0, 0) : wb == 12 ? plane_scalar<12>(x, bn, 0)
                                                                        : plane_scalar<16>(x, bn, cn);
    acc += double(q[c]) * double(half_to_float(bits));
  }
  return acc * scaling;
}

#if KVQ_AVX512
// The lanes of 8 doubles with `left` elements left, and which of them have their byte in e set.
inline __mmask8 lanes8(int64_t left) { return __mmask8(left >= 8 ? 0xff : (1u << left) - 1); }
inline __mmask8 marked8(const uint8_t* e, __mmask8 m) {
  return _mm512_test_epi64_mask(_mm512_cvtepu8_epi64(_mm_maskz_loadu_epi8(m, e)), _mm512_set1_epi64(0xff));
}
#elif KVQ_AVX2
// All ones in lane i where e[i] is 0 (a key scored in fp32), for i < 4.
inline __m256d fp32_scored4(const uint8_t* e) {
  int32_t bytes;
  std::memcpy(&bytes, e, 4);
  return _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_cvtepu8_epi64(_mm_cvtsi32_si128(bytes)), _mm256_setzero_si256()));
}
#endif

// min over c < D of o[c] - e(x[c]) in int16, e the byte itself (the block rule's exponent bytes) or plane A's
// exponent field (x >> 2) & 0x1f (the paper's rule). Why vectors: the value rule runs it per block (per token
// for the paper's rule) over every channel.
template <bool FIELD>
inline int16_t least_gap(const int16_t* o, const uint8_t* x, int D) {
#if KVQ_AVX512
  __m512i m = _mm512_set1_epi16(std::numeric_limits<int16_t>::max());
  for (int c = 0; c < D; c += 32) {
    const __mmask32 k = D - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (D - c)) - 1;
    __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(k, x + c));
    if constexpr (FIELD) v = _mm512_and_si512(_mm512_srli_epi16(v, 2), _mm512_set1_epi16(0x1f));
    m = _mm512_mask_min_epi16(m, k, m, _mm512_sub_epi16(_mm512_maskz_loadu_epi16(k, o + c), v));
  }
  const __m256i h = _mm256_min_epi16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64(m, 1));
  const __m128i q = _mm_min_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  const __m128i flip = _mm_set1_epi16(std::numeric_limits<int16_t>::min());  // signed order as unsigned
  return int16_t(uint16_t(_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(q, flip)))) ^ 0x8000u);
#else
  int16_t g = std::numeric_limits<int16_t>::max();
  for (int c = 0; c < D; ++c) g = std::min<int16_t>(g, int16_t(o[c] - (FIELD ? (x[c] >> 2) & 0x1f : x[c])));
  return g;
#endif
}

#if KVQ_AVX512
// least_gap<FIELD> of 16 rows at once (D bytes each, stride apart; D a multiple of 64), as int32 lanes in row
// order, for gaps whose offsets o8[c] lie in [-96, 127] (so every o8 - field fits a signed byte; without FIELD
// the rows hold exponent fields already, 0..31). Why: the paper's rule takes a gap per token (the block rule
// per block), and one row's 64-byte vector reduced alone costs a chain of shuffles; 16 of them are reduced
// together (each level halves the vectors and the bytes per row).
template <bool FIELD>
inline __m512i least_gaps16(const int8_t* o8, const uint8_t* rows, int64_t stride, int D) {
  __m512i v[16];
  for (int i = 0; i < 16; ++i) {
    __m512i m = _mm512_set1_epi8(127);
    for (int c = 0; c < D; c += 64) {
      const __m512i x = _mm512_loadu_si512(rows + i * stride + c);
      const __m512i field = FIELD ? _mm512_and_si512(_mm512_srli_epi16(x, 2), _mm512_set1_epi8(0x1f)) : x;
      m = _mm512_min_epi8(m, _mm512_sub_epi8(_mm512_loadu_si512(o8 + c), field));
    }
    v[i] = m;
  }
  __m512i u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i) {  // halves: 256 bits of token 2i, then of 2i+1
    const __m512i a = v[2 * i], c = v[2 * i + 1];
    u[i] = _mm512_min_epi8(_mm512_shuffle_i64x2(a, c, 0x44), _mm512_shuffle_i64x2(a, c, 0xee));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: tokens 4i .. 4i+3
    const __m512i a = u[2 * i], c = u[2 * i + 1];
    w[i] = _mm512_min_epi8(_mm512_shuffle_i64x2(a, c, 0x88), _mm512_shuffle_i64x2(a, c, 0xdd));
  }
  for (int i = 0; i < 2; ++i)  // qwords: tokens 8i + (0, 4, 1, 5, 2, 6, 3, 7)
    x[i] = _mm512_min_epi8(_mm512_unpacklo_epi64(w[2 * i], w[2 * i + 1]),
                           _mm512_unpackhi_epi64(w[2 * i], w[2 * i + 1]));
  const __m512i p = _mm512_min_epi8(x[0], _mm512_srli_epi64(x[0], 32));
  const __m512i q = _mm512_min_epi8(x[1], _mm512_srli_epi64(x[1], 32));
  __m512i d = _mm512_mask_blend_epi32(0xaaaa, p, _mm512_slli_epi64(q, 32));  // dwords: x[0]'s, x[1]'s tokens in turn
  d = _mm512_min_epi8(d, _mm512_srli_epi32(d, 16));
  d = _mm512_min_epi8(d, _mm512_srli_epi32(d, 8));
  d = _mm512_srai_epi32(_mm512_slli_epi32(d, 24), 24);  // byte 0 of each dword, sign-extended
  // dword k holds token (0, 8, 4, 12, 1, 9, 5, 13, 2, 10, 6, 14, 3, 11, 7, 15)[k]: back to token order
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15), d);
}

// floor_log2 of 8 doubles >= 0, as int32 lanes (ZERO_EXPONENT for 0): getexp is exact for normal and
// subnormal inputs.
inline __m256i floor_log2_8(__m512d x) {
  const __m256i e = _mm512_cvtpd_epi32(_mm512_getexp_pd(x));
  return _mm256_mask_blend_epi32(_mm512_cmp_pd_mask(x, _mm512_setzero_pd(), _CMP_EQ_OQ), e,
                                 _mm256_set1_epi32(ZERO_EXPONENT));
}
#endif

// Largest of x[t] over the keys with e[t] set (me) and over the rest (ma), for x >= 0 (0 where none).
inline void largest_by_kind(const double* x, const uint8_t* e, int64_t n, double& me, double& ma) {
#if KVQ_AVX512
  __mmask64 marked = 0;  // the usual span holds fp32-scored keys only: then one max, no per-lane kinds
  for (int64_t t = 0; t < n; t += 64) {
    const __mmask64 k = n - t >= 64 ? ~__mmask64(0) : (__mmask64(1) << (n - t)) - 1;
    marked |= _mm512_test_epi8_mask(_mm512_maskz_loadu_epi8(k, e + t), _mm512_set1_epi8(-1));
  }
  if (!marked) {
    __m512d v = _mm512_setzero_pd();
    for (int64_t t = 0; t < n; t += 8) v = _mm512_max_pd(v, _mm512_maskz_loadu_pd(lanes8(n - t), x + t));
    me = 0.0;
    ma = _mm512_reduce_max_pd(v);
    return;
  }
  __m512d ve = _mm512_setzero_pd(), va = _mm512_setzero_pd();
  for (int64_t t = 0; t < n; t += 8) {
    const __mmask8 m = lanes8(n - t), k = marked8(e + t, m);
    const __m512d v = _mm512_maskz_loadu_pd(m, x + t);
    ve = _mm512_mask_max_pd(ve, k, ve, v);
    va = _mm512_mask_max_pd(va, __mmask8(~k & m), va, v);
  }
  me = _mm512_reduce_max_pd(ve);
  ma = _mm512_reduce_max_pd(va);
#else
  me = ma = 0.0;
  int64_t t = 0;
#if KVQ_AVX2  // the same maxima 4 lanes at a time (a max is exact in any order); the other kind's lanes see +0
  __m256d ve = _mm256_setzero_pd(), va = ve;
  for (; t + 4 <= n; t += 4) {
    const __m256d v = _mm256_loadu_pd(x + t), plain = fp32_scored4(e + t);
    ve = _mm256_max_pd(_mm256_andnot_pd(plain, v), ve);
    va = _mm256_max_pd(_mm256_and_pd(plain, v), va);
  }
  alignas(32) double le[4], la[4];
  _mm256_store_pd(le, ve);
  _mm256_store_pd(la, va);
  for (int j = 0; j < 4; ++j) {
    me = le[j] > me ? le[j] : me;
    ma = la[j] > ma ? la[j] : ma;
  }
#endif
  for (; t < n; ++t) {
    const double v = x[t];
    if (e[t])
      me = v > me ? v : me;
    else
      ma = v > ma ? v : ma;
  }
#endif
}

// s[t] -> exp(s[t] - mx) in place, added into 8 interleaved lanes of sums over the keys with e[t] set (le)
// and over the rest (la), lane t % 8; true if some result < 2^-1000 has s[t] - mx > -760 (a probability near
// underflow, which the fp32 bounds do not cover). AVX-512 and AVX2: one pass, the shifted scores never stored.
inline bool exp_by_kind(double* s, const uint8_t* e, int64_t n, double mx, double* le, double* la) {
#if KVQ_AVX512
  __m512d ve = _mm512_loadu_pd(le), va = _mm512_loadu_pd(la);
  __mmask8 lo = 0;
  for (int64_t t = 0; t < n; t += 8) {
    const __mmask8 m = lanes8(n - t), k = marked8(e + t, m);
    const __m512d shifted = _mm512_sub_pd(_mm512_maskz_loadu_pd(m, s + t), _mm512_set1_pd(mx));
    const __m512d v = _mm512_maskz_mov_pd(m, exp8(shifted));
    _mm512_mask_storeu_pd(s + t, m, v);
    ve = _mm512_mask_add_pd(ve, k, ve, v);
    va = _mm512_mask_add_pd(va, __mmask8(~k & m), va, v);
    lo |= _mm512_mask_cmp_pd_mask(m, v, _mm512_set1_pd(0x1p-1000), _CMP_LT_OQ) &
          _mm512_mask_cmp_pd_mask(m, shifted, _mm512_set1_pd(-760.0), _CMP_GT_OQ);
  }
  _mm512_storeu_pd(le, ve);
  _mm512_storeu_pd(la, va);
  return lo != 0;
#elif KVQ_AVX2  // the same pass 16 keys at a time: lane t % 8 of each kind's sums (the other kind adds +0)
  __m256d e0 = _mm256_loadu_pd(le), e1 = _mm256_loadu_pd(le + 4), a0 = _mm256_loadu_pd(la),
          a1 = _mm256_loadu_pd(la + 4), lo = _mm256_setzero_pd();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    __m256d shifted[4], v[4];
    for (int i = 0; i < 4; ++i) v[i] = shifted[i] = _mm256_sub_pd(_mm256_loadu_pd(s + t + 4 * i), _mm256_set1_pd(mx));
    exp4<4>(v);
    for (int i = 0; i < 4; ++i) {
      _mm256_storeu_pd(s + t + 4 * i, v[i]);
      const __m256d plain = fp32_scored4(e + t + 4 * i);
      __m256d& es = i % 2 ? e1 : e0;
      __m256d& as = i % 2 ? a1 : a0;
      es = _mm256_add_pd(es, _mm256_andnot_pd(plain, v[i]));
      as = _mm256_add_pd(as, _mm256_and_pd(plain, v[i]));
      lo = _mm256_or_pd(lo, _mm256_and_pd(_mm256_cmp_pd(v[i], _mm256_set1_pd(0x1p-1000), _CMP_LT_OQ),
                                          _mm256_cmp_pd(shifted[i], _mm256_set1_pd(-760.0), _CMP_GT_OQ)));
    }
  }
  _mm256_storeu_pd(le, e0);
  _mm256_storeu_pd(le + 4, e1);
  _mm256_storeu_pd(la, a0);
  _mm256_storeu_pd(la + 4, a1);
  bool low = _mm256_movemask_pd(lo) != 0;
  if (t < n) {  // the last n % 16 keys, lane t % 8 as above
    const int64_t t8 = t;
    alignas(32) double shifted[16] = {};
    for (int64_t i = t8; i < n; ++i) shifted[i - t8] = s[i] - mx;
    exp_nonpositive(shifted, s + t8, n - t8);
    for (; t < n; ++t) {
      low = low || (s[t] < 0x1p-1000 && shifted[t - t8] > -760.0);
      (e[t] ? le : la)[t % 8] += s[t];
    }
  }
  return low;
#else
  bool low = false;
  alignas(64) double shifted[512];
  for (int64_t t0 = 0; t0 < n; t0 += 512) {  // a chunk at a time: the shifted scores stay in L1
    const int64_t m = std::min<int64_t>(512, n - t0);
    for (int64_t t = 0; t < m; ++t) shifted[t] = s[t0 + t] - mx;
    exp_nonpositive(shifted, s + t0, m);
    for (int64_t t = 0; t < m; ++t) {
      low = low || (s[t0 + t] < 0x1p-1000 && shifted[t] > -760.0);
      (e[t0 + t] ? le : la)[t % 8] += s[t0 + t];
    }
  }
  return low;
#endif
}

inline double lane_sum(const double* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// Bit j (j < m <= 64): s[j] is not -inf and s[j] + (t0 + j < nv ? hb : ht) >= best[j], the test that makes
// token t0 + j a contender for its class's top score.
inline uint64_t near_bits(const double* s, const double* best, int64_t t0, int64_t m, int64_t nv, double hb, double ht) {
  uint64_t bits = 0;
#if KVQ_AVX512
  for (int64_t j = 0; j < m; j += 8) {
    const __mmask8 k = lanes8(m - j);
    const __m512i t = _mm512_add_epi64(_mm512_set1_epi64(t0 + j), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
    const __mmask8 block = _mm512_cmplt_epi64_mask(t, _mm512_set1_epi64(nv));
    const __m512d hw = _mm512_mask_blend_pd(block, _mm512_set1_pd(ht), _mm512_set1_pd(hb));
    const __m512d v = _mm512_maskz_loadu_pd(k, s + j);
    const __mmask8 live = _mm512_mask_cmp_pd_mask(k, v, _mm512_set1_pd(-INFINITY), _CMP_NEQ_OQ);
    const __mmask8 up = _mm512_mask_cmp_pd_mask(live, _mm512_add_pd(v, hw), _mm512_maskz_loadu_pd(k, best + j), _CMP_GE_OQ);
    bits |= uint64_t(up) << j;
  }
#else
  int64_t j = 0;
#if KVQ_AVX2  // 4 at a time (the scalar loop's tests; its bit shifts took ~3% of the block rule's step at 9q/3kv)
  for (; j + 4 <= m; j += 4) {
    const __m256i t = _mm256_add_epi64(_mm256_set1_epi64x(t0 + j), _mm256_setr_epi64x(0, 1, 2, 3));
    const __m256d block = _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x(nv), t));
    const __m256d hw = _mm256_blendv_pd(_mm256_set1_pd(ht), _mm256_set1_pd(hb), block);
    const __m256d v = _mm256_loadu_pd(s + j);
    const __m256d live = _mm256_cmp_pd(v, _mm256_set1_pd(-INFINITY), _CMP_NEQ_OQ);
    const __m256d up = _mm256_cmp_pd(_mm256_add_pd(v, hw), _mm256_loadu_pd(best + j), _CMP_GE_OQ);
    bits |= uint64_t(_mm256_movemask_pd(_mm256_and_pd(live, up))) << j;
  }
#endif
  for (; j < m; ++j)
    bits |= uint64_t(s[j] != -INFINITY && s[j] + (t0 + j < nv ? hb : ht) >= best[j]) << j;
#endif
  return bits;
}

// The most roundings any product meets on its way into row r's fp32 score of a block token (of R rows;
// the rule's bound is gamma_n sum_c |q_c k_c|): block_scores' sets of channels (with S > 1 sets, at most
// sum_k ceil(count_k / S) < D / S + 3 over the three width groups) and their pairwise sum, or
// dot_channel_group's chains and their sum in order.
inline int score_chain(int64_t R, int64_t r, int D) {
#if KVQ_BLOCKS
  if (R <= 3) {  // a chunk's chain, at most D / (S SCORE_CHUNK) + 3 chunk totals a set (3 width groups), the sets' add
    const int S = score_sets(int(R));
    return SCORE_CHUNK + D / (S * SCORE_CHUNK) + 3 + (S - 1);
  }
  if (R <= 4) {
    const int S = score_sets(int(R));
    return S == 1 ? D : D / S + 2 + 1;
  }
#endif
  const int64_t nr = std::min<int64_t>(4, R - r / 4 * 4);
  const int ch = nr == 1 ? 8 : nr == 2 ? 4 : 2;
  return D / ch + ch - 1;
}

// A span of memory prefetched into L2 a few lines per call, so that the fetches spread over a compute loop.
struct LinesAhead {
  const char* p = nullptr;
  int64_t left = 0;
  void lines(int k) {
    for (; k > 0 && left > 0; --k, p += 64, left -= 64) __builtin_prefetch(p, 0, 2);
  }
};

// The width a value unit reads at this binade gap between e(O_est) and its exponents, less its probability's
// (kvquant.alignment's tiers: 8 at t8 or more, 12 at t12 or more, else 16).
inline uint8_t gap_width(const AlignedRule& rule, float gap) { return gap >= rule.t8 ? 8 : gap >= rule.t12 ? 12 : 16; }

// O_est's exponents at both ends as signed bytes for least_gaps16; false where one lies outside its range.
inline bool gap_offsets8(const std::vector<int16_t>& o_lo, const std::vector<int16_t>& o_hi, int D, int8_t* lo8,
                         int8_t* hi8) {
  for (int c = 0; c < D; ++c) {
    if (o_lo[c] < -96 || o_lo[c] > 127 || o_hi[c] < -96 || o_hi[c] > 127) return false;
    lo8[c] = int8_t(o_lo[c]);
    hi8[c] = int8_t(o_hi[c]);
  }
  return true;
}

#if KVQ_AVX512

// The widths of 16 units (tokens, or the block rule's blocks) from their gaps and their largest probabilities
// at both ends, as the scalar loop of rule_from_fp32 decides them: a unit no key reaches (largest 0) reads
// as an unread one; false where a unit's width differs between the ends (the item goes to fp64).
struct Widths16 {
  __m512 t8, t12;
  int32_t w_none;
  explicit Widths16(const AlignedRule& rule) : t8(_mm512_set1_ps(rule.t8)), t12(_mm512_set1_ps(rule.t12)) {
    w_none = gap_width(rule, float(NO_CONTRIBUTION));
  }
  __m512i widths(__m512 gap) const {  // 8 / 12 / 16 as int32 lanes
    const __m512i w = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(gap, t12, _CMP_GE_OQ), _mm512_set1_epi32(16),
                                              _mm512_set1_epi32(12));
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(gap, t8, _CMP_GE_OQ), w, _mm512_set1_epi32(8));
  }
  bool operator()(__m512i g_lo, __m512i g_hi, const __m512d* top_hi, const __m512d* top_lo, __m128i* out) const {
    auto exponents = [](const __m512d* top) {
      return _mm512_inserti64x4(_mm512_castsi256_si512(floor_log2_8(top[0])), floor_log2_8(top[1]), 1);
    };
    const __m512i e_hi = exponents(top_hi), e_lo = exponents(top_lo);
    const __mmask16 seen = __mmask16(_mm512_cmp_pd_mask(top_hi[0], _mm512_setzero_pd(), _CMP_NEQ_OQ) |
                                     (_mm512_cmp_pd_mask(top_hi[1], _mm512_setzero_pd(), _CMP_NEQ_OQ) << 8));
    const __m512i w = widths(_mm512_sub_ps(_mm512_cvtepi32_ps(g_lo), _mm512_cvtepi32_ps(e_hi)));
    const __m512i narrow = widths(_mm512_sub_ps(_mm512_cvtepi32_ps(g_hi), _mm512_cvtepi32_ps(e_lo)));
    if (_mm512_mask_cmpneq_epi32_mask(seen, w, narrow)) return false;
    *out = _mm512_cvtepi32_epi8(_mm512_mask_blend_epi32(seen, _mm512_set1_epi32(w_none), w));
    return true;
  }
};

// The largest of each of 8 vectors' 8 doubles, as lane i for vector i: pairs of vectors halved and merged
// by 256-bit, 128-bit and 64-bit shuffles (as least_gaps16 reduces bytes), then put back in order.
inline __m512d lane_maxima8(const __m512d* v) {
  __m512d m[4], n[2];
  for (int i = 0; i < 4; ++i)  // 256-bit halves: vector 2i's 4 partial maxima, then 2i+1's
    m[i] = _mm512_max_pd(_mm512_shuffle_f64x2(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f64x2(v[2 * i], v[2 * i + 1], 0xee));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: vectors 4i .. 4i+3, 2 partial maxima each
    n[i] = _mm512_max_pd(_mm512_shuffle_f64x2(m[2 * i], m[2 * i + 1], 0x88),
                         _mm512_shuffle_f64x2(m[2 * i], m[2 * i + 1], 0xdd));
  // lanes: vectors (0, 4, 1, 5, 2, 6, 3, 7)
  const __m512d x = _mm512_max_pd(_mm512_unpacklo_pd(n[0], n[1]), _mm512_unpackhi_pd(n[0], n[1]));
  return _mm512_permutexvar_pd(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), x);
}

#elif KVQ_AVX2
// The AVX-512 width loops' 16 units on AVX2 (the same widths, tests and fallbacks): int32 gaps as two vectors
// of 8 units, largest probabilities as four vectors of 4.
struct Gaps16 {
  __m256i v[2];
};

// least_gaps16 as on AVX-512, 32 bytes of a row a step; the 16 rows' byte minima reduced together (128-bit
// halves, qwords, dwords, words, bytes), then put in unit order.
template <bool FIELD>
inline Gaps16 least_gaps16(const int8_t* o8, const uint8_t* rows, int64_t stride, int D) {
  __m256i v[16];
  for (int i = 0; i < 16; ++i) {
    __m256i m = _mm256_set1_epi8(127);
    for (int c = 0; c < D; c += 32) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + i * stride + c));
      const __m256i field = FIELD ? _mm256_and_si256(_mm256_srli_epi16(x, 2), _mm256_set1_epi8(0x1f)) : x;
      m = _mm256_min_epi8(m, _mm256_sub_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o8 + c)), field));
    }
    v[i] = m;
  }
  __m256i u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes: row 2i, row 2i+1
    u[i] = _mm256_min_epi8(_mm256_permute2x128_si256(v[2 * i], v[2 * i + 1], 0x20),
                           _mm256_permute2x128_si256(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 4; ++i)  // qwords: rows 4i, 4i+2 | 4i+1, 4i+3
    w[i] = _mm256_min_epi8(_mm256_unpacklo_epi64(u[2 * i], u[2 * i + 1]), _mm256_unpackhi_epi64(u[2 * i], u[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // dwords: rows 8i + (0, 4, 2, 6 | 1, 5, 3, 7)
    const __m256i p = _mm256_min_epi8(w[2 * i], _mm256_srli_epi64(w[2 * i], 32));
    const __m256i q = _mm256_min_epi8(w[2 * i + 1], _mm256_srli_epi64(w[2 * i + 1], 32));
    x[i] = _mm256_blend_epi32(p, _mm256_slli_epi64(q, 32), 0xaa);
  }
  const __m256i p = _mm256_min_epi8(x[0], _mm256_srli_epi32(x[0], 16));
  const __m256i q = _mm256_min_epi8(x[1], _mm256_srli_epi32(x[1], 16));
  __m256i d = _mm256_blend_epi16(p, _mm256_slli_epi32(q, 16), 0xaa);  // words: rows (0, 8, 4, 12, 2, 10, 6, 14 | 1, ...)
  d = _mm256_min_epi8(d, _mm256_srli_epi16(d, 8));
  d = _mm256_srai_epi16(_mm256_slli_epi16(d, 8), 8);  // each word's low byte, sign-extended
  const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(d));       // rows 0, 8, 4, 12, 2, 10, 6, 14
  const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(d, 1));  // rows 1, 9, 5, 13, 3, 11, 7, 15
  const __m256i first = _mm256_setr_epi32(0, 0, 4, 4, 2, 2, 6, 6), second = _mm256_setr_epi32(1, 1, 5, 5, 3, 3, 7, 7);
  return {{_mm256_blend_epi32(_mm256_permutevar8x32_epi32(lo, first), _mm256_permutevar8x32_epi32(hi, first), 0xaa),
           _mm256_blend_epi32(_mm256_permutevar8x32_epi32(lo, second), _mm256_permutevar8x32_epi32(hi, second), 0xaa)}};
}

// Lanes 0, 2, 4, 6 (the low dwords of 4 qwords).
inline __m128i low_dwords(__m256i x) {
  return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
}

// floor_log2 of 4 doubles >= 0 as int32 lanes, as the scalar floor_log2: the exponent field, a subnormal's
// after scaling it by 2^64 (exact), ZERO_EXPONENT for 0.
inline __m128i floor_log2_4(__m256d x) {
  const __m256d small = _mm256_cmp_pd(x, _mm256_set1_pd(0x1p-1022), _CMP_LT_OQ);
  const __m256d y = _mm256_blendv_pd(x, _mm256_mul_pd(x, _mm256_set1_pd(0x1p64)), small);
  const __m128i field = low_dwords(_mm256_srli_epi64(_mm256_castpd_si256(y), 52));
  const __m128i e = _mm_sub_epi32(_mm_sub_epi32(field, _mm_set1_epi32(1023)),
                                  _mm_and_si128(low_dwords(_mm256_castpd_si256(small)), _mm_set1_epi32(64)));
  const __m128i zero = low_dwords(_mm256_castpd_si256(_mm256_cmp_pd(x, _mm256_setzero_pd(), _CMP_EQ_OQ)));
  return _mm_blendv_epi8(e, _mm_set1_epi32(ZERO_EXPONENT), zero);
}

struct Widths16 {
  __m256 t8, t12;
  int32_t w_none;
  explicit Widths16(const AlignedRule& rule) : t8(_mm256_set1_ps(rule.t8)), t12(_mm256_set1_ps(rule.t12)) {
    w_none = gap_width(rule, float(NO_CONTRIBUTION));
  }
  __m256i widths(__m256 gap) const {  // 8 / 12 / 16 as int32 lanes
    const __m256i w = _mm256_blendv_epi8(_mm256_set1_epi32(16), _mm256_set1_epi32(12),
                                         _mm256_castps_si256(_mm256_cmp_ps(gap, t12, _CMP_GE_OQ)));
    return _mm256_blendv_epi8(w, _mm256_set1_epi32(8), _mm256_castps_si256(_mm256_cmp_ps(gap, t8, _CMP_GE_OQ)));
  }
  bool operator()(const Gaps16& g_lo, const Gaps16& g_hi, const __m256d* top_hi, const __m256d* top_lo,
                  __m128i* out) const {
    __m256i res[2];
    for (int k = 0; k < 2; ++k) {
      auto exponents = [&](const __m256d* top) {
        return _mm256_set_m128i(floor_log2_4(top[2 * k + 1]), floor_log2_4(top[2 * k]));
      };
      auto seen4 = [](__m256d t) {
        return low_dwords(_mm256_castpd_si256(_mm256_cmp_pd(t, _mm256_setzero_pd(), _CMP_NEQ_OQ)));
      };
      const __m256i seen = _mm256_set_m128i(seen4(top_hi[2 * k + 1]), seen4(top_hi[2 * k]));
      const __m256i w = widths(_mm256_sub_ps(_mm256_cvtepi32_ps(g_lo.v[k]), _mm256_cvtepi32_ps(exponents(top_hi))));
      const __m256i narrow = widths(_mm256_sub_ps(_mm256_cvtepi32_ps(g_hi.v[k]), _mm256_cvtepi32_ps(exponents(top_lo))));
      if (!_mm256_testz_si256(seen, _mm256_xor_si256(w, narrow))) return false;
      res[k] = _mm256_blendv_epi8(_mm256_set1_epi32(w_none), w, seen);
    }
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(res[0], res[1]), 0xd8);
    *out = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    return true;
  }
};


// The largest of each of 4 vectors' 4 doubles, as lane i for vector i (lane_maxima8's reduction on AVX2).
inline __m256d lane_maxima4(const __m256d* v) {
  const __m256d a = _mm256_max_pd(_mm256_unpacklo_pd(v[0], v[1]), _mm256_unpackhi_pd(v[0], v[1]));
  const __m256d b = _mm256_max_pd(_mm256_unpacklo_pd(v[2], v[3]), _mm256_unpackhi_pd(v[2], v[3]));
  return _mm256_max_pd(_mm256_permute2f128_pd(a, b, 0x20), _mm256_permute2f128_pd(a, b, 0x31));
}
#endif

#if KVQ_BLOCKS
// rule_from_fp32's width loop for the paper's rule (one width per token), 16 tokens at a time: the gaps by
// least_gaps16 and each token's largest probability at both ends in vectors, the same widths and the same
// test. A group with a token whose width differs between the ends has its tokens rescored in fp64
// (rescore(t0, 16): rule_from_fp32's, which may refuse) and is tested again; still open, or not rescored, it
// ends the loop: false with *undecided. False without writing where it does not apply (D not a multiple of
// 64, O_est's offsets outside least_gaps16's range). Each 64-token block is first offered to settle(t0, 64)
// (rule_from_fp32's: true where v_exp_max puts all of it at 8 bits, written; its rows then go unread), and
// where that fails each 16-token group to settle(t0, 16).
template <class Rescore, class Settle>
inline bool token_widths16(const PlaneArgs& s, const AlignedRule& rule, int64_t b, int64_t h,
                           const std::vector<int16_t>& o_lo, const std::vector<int16_t>& o_hi, bool one_o,
                           const double* S, const uint8_t* ex, int64_t L, int64_t R, int D,
                           const std::vector<double>& hi_e, const std::vector<double>& hi_a,
                           const std::vector<double>& lo_e, const std::vector<double>& lo_a, uint8_t* wv,
                           bool* undecided, const Rescore& rescore, const Settle& settle) {
  *undecided = false;
  alignas(64) int8_t lo8[DMAX], hi8[DMAX];
  if (D % 64 != 0 || !gap_offsets8(o_lo, o_hi, D, lo8, hi8)) return false;
  const int64_t nv = s.nb * KB;
  const Widths16 decide(rule);
  for (int64_t t0 = 0; t0 < nv; t0 += 16) {
    if (t0 % KB == 0 && settle(t0, KB)) {
      t0 += KB - 16;
      continue;
    }
    if (settle(t0, 16)) continue;  // a run that one heavy token kept open: its other groups may still settle
    const uint8_t* rows = s.va.at(b, h, t0);
    if (t0 + PFW + 16 <= nv)  // the rows PFW tokens ahead into L2: without it the loop waited on them
      for (int i = 0; i < 16; ++i)
        for (int c = 0; c < D; c += 64) __builtin_prefetch(rows + (PFW + i) * s.va.s2 + c, 0, 2);
    const auto g_lo = least_gaps16<true>(lo8, rows, s.va.s2, D);
    const auto g_hi = one_o ? g_lo : least_gaps16<true>(hi8, rows, s.va.s2, D);
#if KVQ_AVX512
    __m512d top_hi[2], top_lo[2];
    auto tops = [&]() {  // each token's probability times its kind's factor, the largest over rows
      top_hi[0] = top_hi[1] = top_lo[0] = top_lo[1] = _mm512_setzero_pd();
      for (int64_t r = 0; r < R; ++r)
        for (int k = 0; k < 2; ++k) {
          const int64_t t = t0 + 8 * k;
          const __m512d p = _mm512_loadu_pd(S + r * L + t);
          const __mmask8 exact = marked8(ex + r * L + t, 0xff);
          const __m512d fh = _mm512_mask_blend_pd(exact, _mm512_set1_pd(hi_a[r]), _mm512_set1_pd(hi_e[r]));
          const __m512d fl = _mm512_mask_blend_pd(exact, _mm512_set1_pd(lo_a[r]), _mm512_set1_pd(lo_e[r]));
          top_hi[k] = _mm512_max_pd(top_hi[k], _mm512_mul_pd(p, fh));
          top_lo[k] = _mm512_max_pd(top_lo[k], _mm512_mul_pd(p, fl));
        }
    };
#else
    __m256d top_hi[4], top_lo[4];
    auto tops = [&]() {  // the same, 4 tokens a vector
      for (int k = 0; k < 4; ++k) top_hi[k] = top_lo[k] = _mm256_setzero_pd();
      for (int64_t r = 0; r < R; ++r)
        for (int k = 0; k < 4; ++k) {
          const int64_t t = t0 + 4 * k;
          const __m256d p = _mm256_loadu_pd(S + r * L + t), plain = fp32_scored4(ex + r * L + t);
          const __m256d fh = _mm256_blendv_pd(_mm256_set1_pd(hi_e[r]), _mm256_set1_pd(hi_a[r]), plain);
          const __m256d fl = _mm256_blendv_pd(_mm256_set1_pd(lo_e[r]), _mm256_set1_pd(lo_a[r]), plain);
          top_hi[k] = _mm256_max_pd(top_hi[k], _mm256_mul_pd(p, fh));
          top_lo[k] = _mm256_max_pd(top_lo[k], _mm256_mul_pd(p, fl));
        }
    };
#endif
    tops();
    __m128i w;
    if (!decide(g_lo, g_hi, top_hi, top_lo, &w)) {
      const bool narrowed = rescore(t0, 16);
      if (narrowed) tops();
      if (!narrowed || !decide(g_lo, g_hi, top_hi, top_lo, &w)) {
        *undecided = true;
        return false;
      }
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wv + t0), w);
  }
  widest_per_block(wv, nv, rule.v_block);
  return true;
}

// The block rule's width loop in rule_from_fp32 for 16 blocks from token t0 (v_block a multiple of 8, D of 64,
// gap offsets by gap_offsets8): the gaps of their exponent bytes by least_gaps16 and each block's largest
// probability by lane_maxima8, the same widths and test as the scalar loop (-1: a block undecided). 0 without
// writing where a token of these blocks was scored in fp64 (the scalar loop weighs the two kinds apart).
// Why: v_block 8 has 4x the blocks of v_block 32, and a block's two reductions (gap, probability) taken alone
// are chains of shuffles.
inline int block_widths16(const AlignedRule& rule, const Widths16& decide, int64_t b, int64_t h, int64_t t0, int64_t nv,
                          const int8_t* lo8, const int8_t* hi8, bool one_o, const double* S, const uint8_t* ex,
                          int64_t L, int64_t R, int D, const std::vector<double>& hi_a,
                          const std::vector<double>& lo_a, uint8_t* wv) {
  const int span = int(rule.value_block), n = 16 * span;
  for (int64_t r = 0; r < R; ++r)
#if KVQ_AVX512
    for (int t = 0; t < n; t += 64)
      if (_mm512_test_epi8_mask(_mm512_loadu_si512(ex + r * L + t0 + t), _mm512_set1_epi8(-1))) return 0;
#else
    for (int t = 0; t < n; t += 32) {
      const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ex + r * L + t0 + t));
      if (!_mm256_testz_si256(e, e)) return 0;
    }
#endif
  const uint8_t* rows = rule.v_exp.at(b, h, t0 / span);
  if (t0 + n * (1 + PFE) <= nv)  // the rows PFE groups ahead into L2 (v_block 8, D 128: 256 KiB an item at 16K)
    for (int i = 0; i < 16; ++i)
      for (int c = 0; c < D; c += 64) __builtin_prefetch(rows + (16 * PFE + i) * rule.v_exp.s2 + c, 0, 2);
  const auto g_lo = least_gaps16<false>(lo8, rows, rule.v_exp.s2, D);
  const auto g_hi = one_o ? g_lo : least_gaps16<false>(hi8, rows, rule.v_exp.s2, D);
#if KVQ_AVX512
  __m512d top_hi[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()}, top_lo[2] = {top_hi[0], top_hi[1]};
  for (int64_t r = 0; r < R; ++r) {  // fp32-scored keys only: a block's largest probability times the row's factor
    const double* srow = S + r * L + t0;
    for (int k = 0; k < 2; ++k) {
      __m512d v[8];
      for (int i = 0; i < 8; ++i) {
        const double* x = srow + (8 * k + i) * span;
        v[i] = _mm512_loadu_pd(x);
        for (int t = 8; t < span; t += 8) v[i] = _mm512_max_pd(v[i], _mm512_loadu_pd(x + t));
      }
      const __m512d top = lane_maxima8(v);
      top_hi[k] = _mm512_max_pd(top_hi[k], _mm512_mul_pd(top, _mm512_set1_pd(hi_a[r])));
      top_lo[k] = _mm512_max_pd(top_lo[k], _mm512_mul_pd(top, _mm512_set1_pd(lo_a[r])));
    }
  }
#else
  __m256d top_hi[4], top_lo[4];
  for (int k = 0; k < 4; ++k) top_hi[k] = top_lo[k] = _mm256_setzero_pd();
  for (int64_t r = 0; r < R; ++r) {  // the same, 4 blocks a vector
    const double* srow = S + r * L + t0;
    for (int k = 0; k < 4; ++k) {
      __m256d v[4];
      for (int i = 0; i < 4; ++i) {
        const double* x = srow + (4 * k + i) * span;
        v[i] = _mm256_loadu_pd(x);
        for (int t = 4; t < span; t += 4) v[i] = _mm256_max_pd(v[i], _mm256_loadu_pd(x + t));
      }
      const __m256d top = lane_maxima4(v);
      top_hi[k] = _mm256_max_pd(top_hi[k], _mm256_mul_pd(top, _mm256_set1_pd(hi_a[r])));
      top_lo[k] = _mm256_max_pd(top_lo[k], _mm256_mul_pd(top, _mm256_set1_pd(lo_a[r])));
    }
  }
#endif
  __m128i w;
  if (!decide(g_lo, g_hi, top_hi, top_lo, &w)) return -1;
  alignas(16) uint8_t w16[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(w16), w);
  for (int i = 0; i < 16; ++i) std::memset(wv + t0 + i * span, w16[i], size_t(span));
  return 1;
}

#endif

// Counts of items decided from fp32 scores, of those that needed the fp64 path, and of the fp32 ones decided only
// after rule_from_fp32 rescored some of their keys in fp64 where the bounds left a width open
// (kernels_cpu.aligned_rule_counts): how often the guard band below was too narrow to decide.
std::atomic<int64_t> fast_items{0}, exact_items{0}, rescored_items{0};
// Value units (the block rule's blocks, the paper's rule's tokens) that rule_from_fp32 settled at 8 bits from
// v_exp_max, their own exponent bytes or plane-A fields unread.
std::atomic<int64_t> bound_units{0};

// The value rule (the paper's per token, kvquant.alignment.value_widths, or the block rule,
// block_value_widths) decided from fp32 scores where that provably gives the fp64 path's widths; false (and
// nothing usable written) where it cannot tell, so the caller runs the fp64 path. Why: the rule's fp64 scores
// cost about a third of fused fp16's whole step on AVX2.
// Each fp32 score s~ is within dl of the exact one: a product that meets n roundings on its way into the
// sum (score_chain) leaves an error of at most gamma_n * sum_c |q_c k_c| (gamma_n = n u / (1 - n u),
// u = 2^-24), and |k_c| <= 1.126 |K|max_c + 2^-14 for a key read at any width (the fill raises a magnitude
// by at most 1/8, subnormals by 2^-15). A strided top-k class with more than one contender (within 2 dl of
// the class's best) has them rescored in fp64 (dx: ours and torch's fp64 sums both within D 2^-53 sum|q k|
// of the exact one), so the top-k is exact; a lone contender is the argmax without it. Every probability
// then lies in p~ * [lo, hi] from its kind's bound (dl, or dx for fp64 scores) and the bounds of the softmax
// sum; O_est's exponents and each block's (or token's) largest e(p) are taken at both ends, and one whose
// width differs between them (or a probability near underflow) sends the item to fp64.
template <int NC>
bool rule_from_fp32(const PlanesFormat<NC>& f, const Problem& P, const AlignedRule& rule, int64_t b, int64_t h,
                     const std::vector<const float*>& q, const std::vector<int64_t>& moff, double* S, uint8_t* wv) {
  const int D = P.D;
  const int64_t L = P.L, R = int64_t(P.g) * P.Q, nv = f.s.nb * KB, kk = std::min<int64_t>(L, rule.topk);
  if (rule.k_absmax == nullptr || D % 8 != 0) return false;
  const uint16_t* kabs = rule.k_absmax + b * rule.kab_b + h * rule.kab_h;
  std::vector<double> dl(R), dx(R);
  for (int64_t r = 0; r < R; ++r) {
    double a = 0.0;
    for (int c = 0; c < D; ++c) a += std::fabs(double(q[r][c])) * (1.126 * double(half_to_float(kabs[c])) + 0x1p-14);
    const double sum = std::fabs(rule.scaling) * a * 1.0001, n = score_chain(R, r, D);
    dl[r] = sum * n * 0x1p-24 / (1.0 - n * 0x1p-24);
    dx[r] = 2.0 * sum * D * 0x1p-53 + 1e-300;
    if (!std::isfinite(dl[r])) return false;
  }
  thread_local std::vector<uint8_t> ex;  // 1 where S holds an fp64 score (tail, rescored, masked)
  auto fp64_score = [&](int64_t r, int64_t t) {  // block token t's scaled, masked score in fp64 (unmasked keys only)
    const double y = plane_key_score(f.s, b, h, t, q[r], D, rule.scaling);
    return P.has_mask ? P.mask.apply(moff[r] + t * P.mask.st, y) : y;
  };
  ex.assign(static_cast<size_t>(R * L), 0);
  alignas(64) float buf[SB * DMAX];
  alignas(64) float dots[4 * BT];
  auto st = f.state(P);
  auto keep = [&](int64_t r0, int nr, int64_t t0, int n, bool fp32) {  // scaled, masked scores into S
    for (int r = 0; r < nr; ++r) {
      double* srow = S + (r0 + r) * L + t0;
      if (!P.has_mask) {  // branch-free, so it vectorizes
        uint8_t* e = ex.data() + (r0 + r) * L + t0;
        for (int t = 0; t < n; ++t) {
          const double x = fp32 ? double(dots[r * BT + t]) * rule.scaling : srow[t];
          e[t] |= uint8_t(x == -INFINITY);
          srow[t] = x;
        }
        continue;
      }
      for (int t = 0; t < n; ++t) {
        double x = fp32 ? double(dots[r * BT + t]) * rule.scaling : srow[t];
        if (P.has_mask) x = P.mask.apply(moff[r0 + r] + (t0 + t) * P.mask.st, x);
        if (x == -INFINITY) ex[(r0 + r) * L + t0 + t] = 1;
        srow[t] = x;
      }
    }
  };
  for (int64_t t0 = 0; t0 < L;) {
#if KVQ_BLOCKS
    if (t0 < nv && R <= 4) {  // a whole key block (t0 steps through them by KB), no buffer
      st.channels.build(f.s.kw.at(b, h, t0 / KB), f.s.kw_c, D, BLOCK_LISTS);
      by_row_count(int(R), [&]<int NR>() {
        if (f.s.tiny_k)
          block_scores<NR, true>(f.s, st.channels, b, h, t0 / KB, q.data(), dots);
        else
          block_scores<NR, false>(f.s, st.channels, b, h, t0 / KB, q.data(), dots);
      });
      keep(0, int(R), t0, KB, true);
      t0 += KB;
      continue;
    }
#endif
    const int n = int(std::min<int64_t>(SB, L - t0));
    const bool by_channel = f.keys(st, b, h, t0, n, D, buf);
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int nr = int(std::min<int64_t>(4, R - r0));
      if (by_channel) {
        by_row_count(nr, [&]<int NR>() { dot_channel_group<NR>(buf, n, &q[r0], D, dots); });
      } else {  // the fp16 tail: fp64 as the exact path
        for (int r = 0; r < nr; ++r)
          for (int t = 0; t < n; ++t) {
            double acc = 0.0;
            for (int c = 0; c < D; ++c) acc += double(q[r0 + r][c]) * double(buf[t * NC * W + c]);
            S[(r0 + r) * L + t0 + t] = acc * rule.scaling;
            ex[(r0 + r) * L + t0 + t] = 1;
          }
      }
      keep(r0, nr, t0, n, by_channel);
    }
    t0 += n;
  }
  std::vector<double> hi_e(R), hi_a(R), lo_e(R), lo_a(R), mx_r(R, -INFINITY), inv_r(R), z_r(R), ze_r(R), za_r(R);
  // The block rule's exponent bytes (one row per value block), read by the width loop at the end, fetched into
  // L2 a few lines at a time while the softmax computes (memory is idle then; the width loop found them cold).
  LinesAhead exb_ahead;
  if (rule.value_block > 0 && rule.v_exp.s2 == D)
    exb_ahead = {reinterpret_cast<const char*>(rule.v_exp.at(b, h, 0)), nv / rule.value_block * D};
  std::vector<int64_t> idx(static_cast<size_t>(R * kk));
  std::vector<double> best(kk);
  std::vector<int32_t> count(kk);
  for (int64_t r = 0; r < R; ++r) {
    double* srow = S + r * L;
    uint8_t* e = ex.data() + r * L;
    // Until the rescoring below, S holds fp64 scores exactly at the tail (t >= nv) and at masked keys
    // (-inf, which no half width moves): a block token's half width is dl, a tail token's dx.
    const double hb = dl[r], ht = dx[r];
    std::fill(best.begin(), best.end(), -INFINITY);  // per class t mod kk: the largest lower bound
    for (int64_t t0 = 0; t0 < L; t0 += kk)
      for (int64_t j = 0, m = std::min(kk, L - t0); j < m; ++j)
        best[j] = std::max(best[j], srow[t0 + j] - (t0 + j < nv ? hb : ht));
    // The contenders: a class's argmax is among them, and only a class with two or more needs their fp64
    // scores to tell which (a lone contender is the argmax, its score within its kind's half width).
    std::fill(count.begin(), count.end(), 0);
    int64_t* id = idx.data() + r * kk;
    for (int64_t j = 0; j < kk; ++j) id[j] = j;  // a class no key reaches: its first token, as argmax
    bool shared = false;
    for (int64_t t0 = 0; t0 < L; t0 += kk)
      for (int64_t j0 = 0, m = std::min(kk, L - t0); j0 < m; j0 += 64)
        for (uint64_t bits = near_bits(srow + t0 + j0, best.data() + j0, t0 + j0, std::min<int64_t>(64, m - j0), nv, hb, ht);
             bits; bits &= bits - 1) {
          const int64_t j = j0 + __builtin_ctzll(bits);
          if (count[j]++ == 0) id[j] = t0 + j;
          shared |= count[j] == 2;
        }
    for (int64_t t0 = 0; shared && t0 < L; t0 += kk)
      for (int64_t j0 = 0, m = std::min(kk, L - t0); j0 < m; j0 += 64)
        for (uint64_t bits = near_bits(srow + t0 + j0, best.data() + j0, t0 + j0, std::min<int64_t>(64, m - j0), nv, hb, ht);
             bits; bits &= bits - 1) {
          const int64_t j = j0 + __builtin_ctzll(bits), t = t0 + j;
          if (count[j] < 2) continue;
          if (!e[t]) {  // its fp64 score (block tokens only; the tail is fp64 already)
            srow[t] = fp64_score(r, t);
            e[t] = 1;
          }
          if (t != id[j] && srow[t] > srow[id[j]]) id[j] = t;  // first on ties, as the exact path's strict >
        }
    // The largest score is a contender's (a key that is not one scores below its class's best lower
    // bound, which a contender's score reaches, rescored or not), so it is the largest of the argmaxes'.
    double mx = -INFINITY;
    for (int64_t j = 0; j < kk; ++j) {
      mx = std::max(mx, srow[id[j]]);
      if (id[j] < nv) prefetch_span(f.s.va.at(b, h, id[j]), D);  // O_est's plane-A rows, read after the softmax
    }
    if (mx == -INFINITY) {  // no key seen: every probability 0, as the exact path
      std::fill(srow, srow + L, 0.0);
      hi_e[r] = hi_a[r] = lo_e[r] = lo_a[r] = 1.0;
      continue;
    }
    // e(s - max), summed over fp64-scored (ze) and fp32-scored (za) keys in 8 lanes each; their rounding,
    // (L/8 + 3) u at most, goes into the margin beside exp's few ulp; a probability near underflow sends the
    // item to fp64.
    double lane_e[8] = {}, lane_a[8] = {};
    bool low = false;
    for (int64_t t0 = 0; t0 < L; t0 += 512) {
      exb_ahead.lines(32);
      low |= exp_by_kind(srow + t0, e + t0, std::min<int64_t>(512, L - t0), mx, lane_e, lane_a);
    }
    if (low) return false;
    const double ze = lane_sum(lane_e), za = lane_sum(lane_a);
    const double z = ze + za, margin = 1e-12 + double(L / 8 + 8) * 0x1p-53;
    const double z_lo = (ze * std::exp(-dx[r]) + za * std::exp(-dl[r])) * (1 - margin);
    const double z_hi = (ze * std::exp(dx[r]) + za * std::exp(dl[r])) * (1 + margin);
    const double inv = 1.0 / z;
    for (int64_t t = 0; t < L; ++t) srow[t] *= inv;
    mx_r[r] = mx;
    inv_r[r] = inv;
    z_r[r] = z;
    ze_r[r] = ze;
    za_r[r] = za;
    hi_e[r] = z / z_lo * std::exp(dx[r]) * (1 + 1e-12);
    hi_a[r] = z / z_lo * std::exp(dl[r]) * (1 + 1e-12);
    lo_e[r] = z / z_hi * std::exp(-dx[r]) * (1 - 1e-12);
    lo_a[r] = z / z_hi * std::exp(-dl[r]) * (1 - 1e-12);
  }
  auto high_byte = [&](int64_t t, int c) -> uint8_t {
    return t < nv ? f.s.va.at(b, h, t)[c] : uint8_t(f.s.tail_v.row(b, h, t - nv)[c] >> 8);
  };
  // O_est at both ends: its addends are probabilities of either kind, so O_est lies in O~ * [lo, hi] for the
  // wider of the two kinds' factors.
  std::vector<double> x(static_cast<size_t>((kk + 1) * D));
  std::vector<int32_t> eo_lo(D), eo_hi(D);
  std::vector<int16_t> o_lo(D), o_hi(D);
  bool one_o = true;  // O_est's exponents alike at both ends (the usual case): one gap
  auto o_bounds = [&]() {
    for (int64_t r = 0; r < R; ++r) {
      o_estimate(S + r * L, idx.data() + r * kk, kk, D, rule.v8, high_byte, x);
      for (int c = 0; c < D; ++c) {
        const int32_t a = floor_log2(x[c] * std::min(lo_e[r], lo_a[r]) * (1 - 1e-12));
        const int32_t z = floor_log2(x[c] * std::max(hi_e[r], hi_a[r]) * (1 + 1e-12));
        eo_lo[c] = r == 0 ? a : std::min(eo_lo[c], a);
        eo_hi[c] = r == 0 ? z : std::min(eo_hi[c], z);
      }
    }
    for (int c = 0; c < D; ++c) {
      o_lo[c] = int16_t(std::clamp(eo_lo[c], -(1 << 14), 1 << 14) + 15);
      o_hi[c] = int16_t(std::clamp(eo_hi[c], -(1 << 14), 1 << 14) + 15);
    }
    one_o = o_lo == o_hi;
  };
  o_bounds();
  auto width = [&](float gap) { return gap_width(rule, gap); };
  const int64_t span = rule.value_block > 0 ? rule.value_block : 1;  // tokens sharing one width
  // Where a unit's width differs between the ends of its probability's bounds, its block tokens get their fp64
  // scores (as the contenders did): exp(s - max) / z with the row's max and sum, whose bounds hold for any mix
  // of kinds, so the unit's probabilities narrow to their fp64 kind's factors and the unit is tested again.
  // The first time, the row's heavy keys (probability >= HEAVY) are rescored too and the sum's bounds taken
  // again with them as fp64 addends: where a few keys hold most of the attention (sinks), the sum's interval,
  // which every probability's bounds carry, narrows as much; where O_est's exponents differed between the ends
  // (no gap to test a unit against), O_est's bounds are taken again with the narrower factors and the widths
  // decided again from the first unit (`again`). A budget of RESCORE_BUDGET keeps an item whose bounds are
  // wide everywhere from scoring most of its keys twice: past it, the item goes to fp64 whole.
  int64_t rescored = 0;
  bool again = false;
  auto exact_key = [&](int64_t r, int64_t t, double& e) -> bool {  // false: near underflow
    const double shifted = fp64_score(r, t) - mx_r[r];
    e = std::exp(shifted);
    return !(e < 0x1p-1000 && shifted > -760.0);  // as the softmax's test
  };
  bool tightened = false;
  auto tighten = [&]() -> bool {  // the heavy keys in fp64 and the sums' bounds again
    tightened = true;
    for (int64_t r = 0; r < R; ++r) {
      if (mx_r[r] == -INFINITY) continue;
      double* srow = S + r * L;
      uint8_t* e = ex.data() + r * L;
      double was = 0.0, now = 0.0;  // the rescored keys' exps, fp32-era and fp64
      int64_t n = 0;
      for (int64_t t = 0; t < nv; ++t) {
        if (e[t] || srow[t] < HEAVY) continue;
        if (++n + rescored > RESCORE_BUDGET) return false;
        double x;
        if (!exact_key(r, t, x)) return false;
        was += srow[t] * z_r[r];
        now += x;
        srow[t] = x * inv_r[r];
        e[t] = 1;
      }
      rescored += n;
      if (n == 0) continue;
      // The rescored keys' exps move from one sum to the other; the products and the two adds round at a few u
      // of z, which the margin's extra 1e-13 covers many times over. Each new bound is a bound on the same exact
      // sum, so the narrower of old and new holds.
      const double ze = ze_r[r] + now, za = std::max(0.0, za_r[r] - was);
      const double margin = 1e-12 + 1e-13 + double(L / 8 + 8) * 0x1p-53, z = z_r[r];
      const double z_lo = (ze * std::exp(-dx[r]) + za * std::exp(-dl[r])) * (1 - margin);
      const double z_hi = (ze * std::exp(dx[r]) + za * std::exp(dl[r])) * (1 + margin);
      hi_e[r] = std::min(hi_e[r], z / z_lo * std::exp(dx[r]) * (1 + 1e-12));
      hi_a[r] = std::min(hi_a[r], z / z_lo * std::exp(dl[r]) * (1 + 1e-12));
      lo_e[r] = std::max(lo_e[r], z / z_hi * std::exp(-dx[r]) * (1 - 1e-12));
      lo_a[r] = std::max(lo_a[r], z / z_hi * std::exp(-dl[r]) * (1 - 1e-12));
    }
    return true;
  };
  auto rescore = [&](int64_t t0, int64_t n) -> bool {
    if (!tightened) {
      if (!tighten()) return false;
      again = !one_o;
    }
    if (!one_o) return false;
    const int64_t end = std::min(t0 + n, nv);
    if ((rescored += (end - t0) * R) > RESCORE_BUDGET) return false;
    for (int64_t r = 0; r < R; ++r) {
      if (mx_r[r] == -INFINITY) continue;  // no key seen: every probability 0
      for (int64_t t = t0; t < end; ++t) {
        if (ex[r * L + t]) continue;
        double x;
        if (!exact_key(r, t, x)) return false;
        S[r * L + t] = x * inv_r[r];
        ex[r * L + t] = 1;
      }
    }
    return true;
  };
  // A run of units whose largest probability (either kind's factor), against the gap of v_exp_max (the least
  // gap any of its units can have), still gives 8 bits: every unit of it reads 8 at both ends (a unit's own gap
  // is no smaller, its probability no larger, and an unread unit reads 8 too), settled without reading its
  // exponent bytes or plane-A fields. Why: those are 1 bit per value element at v_block 8 and the paper's rule
  // reads plane A whole for them (SV reads it again), while on spread attention most runs are far from 12 bits.
  const uint8_t* v_max = rule.v_exp_max ? rule.v_exp_max + b * rule.vem_b + h * rule.vem_h : nullptr;
  const bool by_bound = v_max != nullptr && width(float(NO_CONTRIBUTION)) == 8;
  int16_t g_bound = 0;
  int64_t settled = 0;
  auto settle = [&](int64_t t0, int64_t n) -> bool {  // tokens t0 .. t0 + n (whole units): 8 bits, or false
    if (!by_bound) return false;
    double top = 0.0;
    for (int64_t r = 0; r < R; ++r) top = std::max(top, max_of(S + r * L + t0, n) * std::max(hi_e[r], hi_a[r]));
    if (top != 0.0 && width(float(g_bound) - float(floor_log2(top))) != 8) return false;
    std::memset(wv + t0, 8, size_t(n));
    settled += n / span;
    return true;
  };
  auto widths = [&]() -> bool {  // every unit's width; false where one stays open
    settled = 0;
    if (by_bound) g_bound = least_gap<false>(o_lo.data(), v_max, D);
#if KVQ_BLOCKS
    if (rule.value_block == 0) {
      bool undecided = false;
      if (token_widths16(f.s, rule, b, h, o_lo, o_hi, one_o, S, ex.data(), L, R, D, hi_e, hi_a, lo_e, lo_a, wv,
                         &undecided, rescore, settle)) {
        bound_units += settled;
        return true;
      }
      if (undecided) return false;
      settled = 0;
    }
    alignas(64) int8_t lo8[DMAX], hi8[DMAX];
    const bool blocks16 = rule.value_block > 0 && rule.value_block % 8 == 0 && D % 64 == 0 &&
                          gap_offsets8(o_lo, o_hi, D, lo8, hi8);
    const Widths16 decide(rule);
#endif
    int64_t by_unit = 0;  // the scalar loop below takes the units before this token (a group left open)
    // A run that settle turned down is not tried again from each of its units (a try reads the run's
    // probabilities: up to 16 tries per run where the 16-unit loop below does not apply); its units get
    // their own widths, which are 8 wherever settle's bound would have given 8.
    int64_t unsettled = 0;
    for (int64_t t0 = 0; t0 < nv;) {
      const int64_t run = std::min<int64_t>(16 * span, nv - t0);
      if (t0 >= by_unit && t0 >= unsettled) {
        if (settle(t0, run)) {
          t0 += run;
          continue;
        }
        unsettled = t0 + run;
      }
#if KVQ_BLOCKS
      if (blocks16 && t0 >= by_unit && t0 + 16 * span <= nv) {
        const int done =
            block_widths16(rule, decide, b, h, t0, nv, lo8, hi8, one_o, S, ex.data(), L, R, D, hi_a, lo_a, wv);
        if (done < 0) {
          if (!one_o) {
            rescore(t0, 0);  // the first time it narrows the bounds (`again`: O_est's taken again)
            return false;
          }
          by_unit = t0 + 16 * span;  // unit by unit, so only the open blocks are rescored
        }
        if (done > 0) {
          t0 += 16 * span;
          continue;
        }
      }
#endif
      int16_t g_lo = std::numeric_limits<int16_t>::max(), g_hi = g_lo;
      if (rule.value_block > 0) {  // the block rule: the exponent bytes kept at append
        const uint8_t* exb = rule.v_exp.at(b, h, t0 / rule.value_block);
        if (t0 + 32 * span < nv) prefetch_span(exb + 32 * rule.v_exp.s2, D);  // a row at a time, 32 blocks ahead
        g_lo = least_gap<false>(o_lo.data(), exb, D);
        if (!one_o) g_hi = least_gap<false>(o_hi.data(), exb, D);
      } else {  // the paper's rule: the token's plane-A exponent fields
        const uint8_t* row = f.s.va.at(b, h, t0);
        g_lo = least_gap<true>(o_lo.data(), row, D);
        if (!one_o) g_hi = least_gap<true>(o_hi.data(), row, D);
      }
      if (one_o) g_hi = g_lo;
      // The largest probability's bounds: within each kind of key (fp64- or fp32-scored) the largest
      // probability times its factor, as rounding a product is monotone in the probability.
      double top_lo = 0.0, top_hi = 0.0;
      auto tops = [&]() {
        top_lo = top_hi = 0.0;
        for (int64_t r = 0; r < R; ++r) {
          const double* srow = S + r * L + t0;
          const uint8_t* e = ex.data() + r * L + t0;
          double me = 0.0, ma = 0.0;
          if (span == 1)  // the paper's rule: one token
            (e[0] ? me : ma) = srow[0];
          else
            largest_by_kind(srow, e, span, me, ma);
          top_hi = std::max(top_hi, std::max(me * hi_e[r], ma * hi_a[r]));
          top_lo = std::max(top_lo, std::max(me * lo_e[r], ma * lo_a[r]));
        }
      };
      tops();
      uint8_t w;
      auto decided = [&]() {
        if (top_hi == 0.0) {
          w = width(float(NO_CONTRIBUTION));
          return true;
        }
        const uint8_t narrow = width(float(g_hi) - float(floor_log2(top_lo)));
        w = width(float(g_lo) - float(floor_log2(top_hi)));
        return w == narrow;
      };
      if (!decided()) {
        if (!rescore(t0, span)) return false;
        tops();
        if (!decided()) return false;
      }
      std::fill(wv + t0, wv + t0 + span, w);
      t0 += span;
    }
    if (rule.value_block == 0) widest_per_block(wv, nv, rule.v_block);
    bound_units += settled;
    return true;
  };
  bool decided = widths();
  if (!decided && again) {
    o_bounds();
    decided = widths();
  }
  if (decided && tightened) ++rescored_items;
  return decided;
}

// AlignedKV's whole step for one (batch row, KV head): the rule's scores in fp64 over the keys read
// at their widths, the value rule (strided top-k, O_est by the pairwise tree, exponent gaps, v_block; or
// the block rule's exponent bytes),
// then the values read at those widths and summed with the same probabilities. Every step follows
// kvquant.alignment.value_widths on fp64 scores (AlignedLayer.decide_widths), so the widths are
// those of the torch reference unless a score lies within ~1e-16 of a power of two.
template <int NC>
void aligned_item(const PlanesFormat<NC>& f, const Problem& P, const AlignedRule& rule, int64_t b, int64_t h,
                  uint8_t* wv, float* out) {
  const int D = P.D;
  const int64_t L = P.L, R = int64_t(P.g) * P.Q, nv = f.s.nb * KB;
  // Kept per thread across calls: vectors of a step's size (scores of 16K tokens are 128 KiB per row)
  // would each be a fresh mmap, page-faulted on every call.
  thread_local std::vector<double> S, shifted, smax;
  S.resize(static_cast<size_t>(R * L));
  shifted.resize(static_cast<size_t>(L));
  smax.resize(static_cast<size_t>(std::max<int64_t>(nv, 1)));
  std::vector<const float*> q(R);
  std::vector<int64_t> moff(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t j = r / P.Q, i = r % P.Q, hq = h * P.g + j;
    q[r] = P.q + b * P.qb + hq * P.qh + i * P.qt;
    moff[r] = b * P.mb + hq * P.mh + i * P.mq;
  }
  alignas(64) float buf[SB * DMAX];
  auto st = f.state(P);
  const bool fast = !rule.exact_scores && rule_from_fp32(f, P, rule, b, h, q, moff, S.data(), wv);
  if (!rule.exact_scores) ++(fast ? fast_items : exact_items);
  alignas(64) double dots[3 * KB];  // 3 rows of a key block, or 4 of 16 tokens (dot_channels_f64)
  static_assert(3 * KB >= 4 * W);
#if KVQ_AVX512
  alignas(64) double qd[4 * DMAX];  // the query rows in fp64, for block_scores_f64
#endif
  auto keep = [&](int64_t r0, int nr, int64_t t0, int n, int stride) {  // masked scores into S
    for (int r = 0; r < nr; ++r) {
      double* srow = S.data() + (r0 + r) * L + t0;
      for (int t = 0; t < n; ++t) {
        const double x = dots[r * stride + t];
        srow[t] = P.has_mask ? P.mask.apply(moff[r0 + r] + (t0 + t) * P.mask.st, x) : x;
      }
    }
  };
  for (int64_t t0 = 0; !fast && t0 < L;) {  // logits: exact products, fp64 sums over channels
#if KVQ_AVX512
    if (t0 < nv && R <= 4) {  // a whole key block (t0 steps through them by KB): 1-3 rows, or 2 + 2
      if (t0 == 0)
        for (int64_t r = 0; r < R; ++r) std::copy(q[r], q[r] + D, qd + r * DMAX);
      st.channels.build(f.s.kw.at(b, h, t0 / KB), f.s.kw_c, D);
      for (int64_t r0 = 0; r0 < R;) {
        const int nr = R == 4 ? 2 : int(R);
        by_row_count(nr, [&]<int NR>() {
          if constexpr (NR <= 3) {
            if (f.s.tiny_k)
              block_scores_f64<NR, true>(f.s, st.channels, b, h, t0 / KB, qd + r0 * DMAX, rule.scaling, dots);
            else
              block_scores_f64<NR, false>(f.s, st.channels, b, h, t0 / KB, qd + r0 * DMAX, rule.scaling, dots);
          }
        });
        keep(r0, nr, t0, KB, KB);
        r0 += nr;
      }
      t0 += KB;
      continue;
    }
#endif
    const int n = int(std::min<int64_t>(SB, L - t0));
    const bool by_channel = f.keys(st, b, h, t0, n, D, buf);
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      const int nr = int(std::min<int64_t>(4, R - r0));
      if (by_channel) {
        by_row_count(nr, [&]<int NR>() { dot_channels_f64<NR>(buf, &q[r0], D, rule.scaling, dots); });
      } else {  // the fp16 tail, token-major
        for (int r = 0; r < nr; ++r)
          for (int t = 0; t < n; ++t) {
            double acc = 0.0;
            for (int c = 0; c < D; ++c) acc += double(q[r0 + r][c]) * double(buf[t * NC * W + c]);
            dots[r * W + t] = acc * rule.scaling;
          }
      }
      keep(r0, nr, t0, n, W);
    }
    t0 += n;
  }
  if (!fast) {  // the exact path: softmax, O_est, widths
    for (int64_t r = 0; r < R; ++r) {  // softmax as torch's (exp(x - max), times 1 / sum); no key seen: zeros
      double* srow = S.data() + r * L;
      const double mx = max_of(srow, L);
      if (mx == -INFINITY) {
        std::fill(srow, srow + L, 0.0);
        continue;
      }
      for (int64_t t = 0; t < L; ++t) shifted[t] = srow[t] - mx;
      exp_nonpositive(shifted.data(), srow, L);
      const double inv = 1.0 / sum_of(srow, L);
      for (int64_t t = 0; t < L; ++t) srow[t] *= inv;
    }
    auto high = [&](int64_t t) -> const uint8_t* { return t < nv ? f.s.va.at(b, h, t) : nullptr; };
    auto high_byte = [&](int64_t t, int c) -> uint8_t {
      const uint8_t* row = high(t);
      return row != nullptr ? row[c] : uint8_t(f.s.tail_v.row(b, h, t - nv)[c] >> 8);
    };
    // O_est per row over the strided top-k (argmax of each class t mod k, first on ties), summed by the
    // pairwise tree of kvquant.alignment.pairwise_sum; e_o = the most demanding row's exponent.
    const int64_t kk = std::min<int64_t>(L, rule.topk);
    std::vector<int64_t> idx(kk);
    std::vector<double> x(static_cast<size_t>((kk + 1) * D));
    std::vector<int16_t> e_o(D, std::numeric_limits<int16_t>::max());
    std::vector<int32_t> e_row(D);
    std::vector<double> best(kk);
    for (int64_t r = 0; r < R; ++r) {
      const double* srow = S.data() + r * L;
      for (int64_t j = 0; j < kk; ++j) {
        idx[j] = j;
        best[j] = srow[j];
      }
      for (int64_t t0 = kk; t0 < L; t0 += kk) {  // class j = t mod kk, scanned in token order
        const int64_t m = std::min(kk, L - t0);
        for (int64_t j = 0; j < m; ++j) {
          const bool above = srow[t0 + j] > best[j];
          best[j] = above ? srow[t0 + j] : best[j];
          idx[j] = above ? t0 + j : idx[j];
        }
      }
      o_estimate(srow, idx.data(), kk, D, rule.v8, high_byte, x);
      for (int c = 0; c < D; ++c) {
        const int32_t e = floor_log2(x[c]);
        e_row[c] = r == 0 ? e : std::min(e_row[c], e);
      }
    }
    for (int c = 0; c < D; ++c) e_o[c] = int16_t(std::clamp(e_row[c], -(1 << 14), 1 << 14) + 15);
    std::copy(S.begin(), S.begin() + nv, smax.begin());  // per block token: the largest score of any row
    for (int64_t r = 1; r < R; ++r)
      for (int64_t t = 0; t < nv; ++t) smax[t] = S[r * L + t] > smax[t] ? S[r * L + t] : smax[t];
    auto score_exponent = [&](int64_t t) {  // the largest e(s) of any row, as torch's max of floor_log2
      int32_t e = floor_log2(smax[t]);
      if (e < ZERO_EXPONENT)  // a subnormal top score: the reference's max over rows counts a zero row as 2^-1024
        for (int64_t r = 0; r < R; ++r) e = S[r * L + t] == 0.0 ? ZERO_EXPONENT : e;
      return e;
    };
    auto width = [&](float gap) { return gap_width(rule, gap); };
    if (rule.value_block > 0) {  // the block rule: one gap per block, from its exponent bytes, no plane-A pass
      for (int64_t t0 = 0; t0 < nv; t0 += rule.value_block) {
        const uint8_t* ex = rule.v_exp.at(b, h, t0 / rule.value_block);
        int16_t g = std::numeric_limits<int16_t>::max();
        for (int c = 0; c < D; ++c) g = std::min<int16_t>(g, int16_t(e_o[c] - ex[c]));
        int32_t e = ZERO_EXPONENT;
        double top = 0.0;
        for (int64_t t = t0; t < t0 + rule.value_block; ++t) {
          e = std::max(e, score_exponent(t));
          top = smax[t] > top ? smax[t] : top;
        }
        std::fill(wv + t0, wv + t0 + rule.value_block, width(top == 0.0 ? float(NO_CONTRIBUTION) : float(g) - float(e)));
      }
    } else {
      for (int64_t t = 0; t < nv; ++t) {  // the gap, then the width (8 / 12 / 16)
        if (t + PFW < nv) prefetch_span(high(t + PFW), D);
        const int16_t g = least_gap<true>(e_o.data(), high(t), D);
        wv[t] = width(smax[t] == 0.0 ? float(NO_CONTRIBUTION) : float(g) - float(score_exponent(t)));
      }
      widest_per_block(wv, nv, rule.v_block);
    }
  }
  alignas(64) float p[NRMAX * BT];
  alignas(64) float acc[NRMAX * DMAX];
#if KVQ_BLOCKS
  alignas(64) float acc64[4 * DMAX];  // block tokens' sums, channels in planes64's order
  const bool rows64 = R <= 4 && D % 64 == 0;
#else
  const bool rows64 = false;
#endif
  for (int64_t r0 = 0; r0 < R; r0 += NRMAX) {  // values at their widths, weighted by the same scores
    const int nr = int(std::min<int64_t>(NRMAX, R - r0));
    std::fill(acc, acc + nr * DMAX, 0.0f);
#if KVQ_BLOCKS
    if (rows64) std::fill(acc64, acc64 + nr * DMAX, 0.0f);
#endif
    int n = 0;
    for (int64_t t0 = 0; t0 < L; t0 += n) {  // a key block's tokens at a time where value_runs reads them
      n = int(std::min<int64_t>(rows64 && t0 < nv ? BT : SB, L - t0));
      int any = 0;
      for (int r = 0; r < nr; ++r) {
        const double* sr = S.data() + (r0 + r) * L + t0;
        float* pr = p + r * BT;
        for (int t = 0; t < n; ++t) pr[t] = float(sr[t]);
        for (int t = 0; t < n; ++t) any |= pr[t] != 0.0f;
      }
      if (!any) continue;
#if KVQ_BLOCKS
      if (rows64 && t0 < nv) {  // runs of one width, read 64 channels at a time (nv is a multiple of BT)
        const uint8_t* wa = t0 + PF + n <= nv ? wv + t0 + PF : nullptr;
        by_row_count(nr, [&]<int NR>() { value_runs<NR>(f.s, b, h, t0, n, D, wv + t0, 1, wa, p, acc64); });
        continue;
      }
#endif
      f.values(st, b, h, t0, n, D, buf);
      accumulate_rows<NC>(buf, n, nr, p, acc);
    }
#if KVQ_BLOCKS
    if (rows64)
      for (int r = 0; r < nr; ++r)
        for (int c0 = 0; c0 < D; c0 += 64) {
          vf x[4];
          for (int u = 0; u < 4; ++u) x[u] = load(acc64 + r * DMAX + c0 + u * W, lanes(W));
          order64(x);
          for (int u = 0; u < 4; ++u) {
            float* a = acc + r * DMAX + c0 + u * W;
            store(a, add(load(a, lanes(W)), x[u]), lanes(W));
          }
        }
#endif
    for (int r = 0; r < nr; ++r) {
      const int64_t j = (r0 + r) / P.Q, i = (r0 + r) % P.Q, hq = h * P.g + j;
      std::copy(acc + r * DMAX, acc + r * DMAX + D, out + ((b * P.Hq + hq) * P.Q + i) * D);
    }
  }
}

}  // namespace

at::Tensor planes_attention(const PlaneArgs& a, const Problem& P) {
  return dispatch_nc(P.D, [&]<int NC>() { return attend<NC>(PlanesFormat<NC>{{}, a}, P); });
}

std::tuple<at::Tensor, at::Tensor> planes_aligned(PlaneArgs a, const Problem& P, const AlignedRule& rule) {
  const int64_t nv = a.nb * KB;
  auto wv = at::empty({P.B, P.Hkv, nv}, at::kByte);
  a.vw = Bytes{wv.data_ptr<uint8_t>(), P.Hkv * nv, nv, 1};
  auto out = at::zeros({P.B, P.Hq, P.Q, int64_t(P.D)}, at::kFloat);
  const int64_t items = P.B * P.Hkv;
  dispatch_nc(P.D, [&]<int NC>() {
    const PlanesFormat<NC> f{{}, a};
#pragma omp parallel for schedule(dynamic, 1) num_threads(items * P.L < Plan::SMALL ? 1 : at::get_num_threads())
    for (int64_t item = 0; item < items; ++item)
      aligned_item<NC>(f, P, rule, item / P.Hkv, item % P.Hkv, wv.data_ptr<uint8_t>() + item * nv,
                       out.data_ptr<float>());
    return out;
  });
  return {out, wv};
}

std::tuple<int64_t, int64_t, int64_t, int64_t> aligned_rule_counts() {
  return {fast_items.load(), exact_items.load(), rescored_items.load(), bound_units.load()};
}

at::Tensor planes_read_keys(const PlaneArgs& a, int64_t B, int64_t H, int D) {
  const int64_t L = a.nb * KB + a.tail_n;
  auto out = at::empty({B, H, L, int64_t(D)}, at::kFloat);
  float* o = out.data_ptr<float>();
  const int64_t items = B * H * (a.nb + 1);  // every block, and the fp16 tail, of every head
#pragma omp parallel for schedule(static) num_threads(items * L * D < (1 << 16) ? 1 : at::get_num_threads())
  for (int64_t item = 0; item < items; ++item) {
    const int64_t bh = item / (a.nb + 1), j = item % (a.nb + 1), b = bh / H, h = bh % H;
    float* rows = o + (bh * L + j * KB) * D;
    if (j < a.nb) {
      if (a.tiny_k)
        read_key_block<true>(a, b, h, j, D, rows);
      else
        read_key_block<false>(a, b, h, j, D, rows);
    } else {
      for (int64_t t = 0; t < a.tail_n; ++t)
        for (int c = 0; c < D; ++c) rows[t * D + c] = half_to_float(a.tail_k.row(b, h, t)[c]);
    }
  }
  return out;
}

at::Tensor planes_exponent_gaps(const int16_t* e_o, int64_t eb, int64_t eh, const Bytes& v, int64_t B, int64_t H,
                                int64_t L, int D) {
  auto out = at::empty({B, H, L}, at::kShort);
  int16_t* o = out.data_ptr<int16_t>();
#pragma omp parallel for schedule(static) num_threads(B * H * L * D < (1 << 18) ? 1 : at::get_num_threads())
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const int16_t* e = e_o + b * eb + h * eh;
    for (int64_t t = 0; t < L; ++t) {
      const uint8_t* row = v.at(b, h, t);
      int16_t m = std::numeric_limits<int16_t>::max();
      for (int c = 0; c < D; ++c) m = std::min<int16_t>(m, int16_t(e[c] - ((row[c] >> 2) & 0x1f)));
      o[bh * L + t] = m;
    }
  }
  return out;
}

namespace {

// kvquant.bits.floor_log2 of an fp32 value as torch computes it: frexp's exponent - 1, ZERO_EXPONENT for 0, and
// -1 where torch's frexp gives exponent 0 to inf and NaN.
int32_t floor_log2_f32(float x) {
  if (x == 0.0f) return ZERO_EXPONENT;
  if (!std::isfinite(x)) return -1;
  int e;
  std::frexp(x, &e);
  return e - 1;
}

uint8_t width_of_gap(int32_t gap, float t12, float t8) {
  const float g = float(gap);  // torch compares the int32 gap with a Python float in fp32
  return g >= t8 ? 8 : g >= t12 ? 12 : 16;
}

}  // namespace

at::Tensor planes_key_widths(const KeyRuleArgs& a) {
  const int D = a.D;
  auto out = at::empty(a.per_block ? at::IntArrayRef{a.B, a.H, a.nb, D} : at::IntArrayRef{a.B, a.H, D}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  std::vector<int32_t> e_q(D), p(D);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.H; ++h) {
      int32_t top = std::numeric_limits<int32_t>::min();
      for (int c = 0; c < D; ++c) {  // max |q| over the head's query rows, NaN kept (torch's amax)
        float m = 0.0f;
        bool nan = false;
        for (int64_t j = 0; j < a.g; ++j)
          for (int64_t i = 0; i < a.Q; ++i) {
            const float x = std::fabs(a.q[b * a.qb + (h * a.g + j) * a.qh + i * a.qt + c]);
            nan |= std::isnan(x);
            m = x > m ? x : m;
          }
        e_q[c] = floor_log2_f32(nan ? NAN : m);
        const uint16_t k = a.k_absmax[b * a.kab_b + h * a.kab_h + c];
        p[c] = e_q[c] + floor_log2_f32(half_to_float(k));
        top = std::max(top, p[c]);
      }
      if (!a.per_block) {
        for (int c = 0; c < D; ++c) *o++ = width_of_gap(top - p[c], a.t12, a.t8);
        continue;
      }
      for (int64_t j = 0; j < a.nb; ++j) {  // AlignedKV+: each block's exponent field, 0 counted as 1 (2^-15)
        const uint8_t* field = a.k_exp.at(b, h, j);
        for (int c = 0; c < D; ++c)
          *o++ = width_of_gap(top - (e_q[c] + std::max<int32_t>(field[c], 1) - 15), a.t12, a.t8);
      }
    }
  return out;
}

at::Tensor planes_width_counts(const WidthCountArgs& a) {
  auto out = at::zeros({2, a.H, 3}, at::kLong);
  int64_t* k = out.data_ptr<int64_t>();
  int64_t* v = k + a.H * 3;
  // Tallied by value, anything but 8, 12 or 16 in slot 0 (an error once counted).
  for (int64_t h = 0; h < a.H; ++h) {
    int64_t wk[17] = {}, wv[17] = {};
    for (int64_t b = 0; b < a.B; ++b) {
      for (int64_t j = 0; j < a.nbk; ++j) {  // per column (nbk 1): the window's block tokens; per block: its share
        const int64_t start = j * KB;
        const int64_t tokens = a.per_block ? std::clamp<int64_t>(start + KB - std::max(start, a.first), 0, KB)
                                           : std::max<int64_t>(0, a.n_full - a.first);
        for (int64_t c = 0; c < a.D; ++c) {
          const int32_t w = a.wk(b, h, j, c);
          if (w == 8 || w == 12 || w == 16)
            wk[w] += tokens;
          else
            ++wk[0];  // even where the block holds no token of the window
        }
      }
      auto count = [&](const auto* row, int64_t st) {  // three compares a token: vectorized where st is 1
        int64_t n8 = 0, n12 = 0, n16 = 0;
        for (int64_t t = 0; t < a.nv; ++t) {
          const int32_t w = row[t * st];
          n8 += w == 8;
          n12 += w == 12;
          n16 += w == 16;
        }
        wv[8] += n8;
        wv[12] += n12;
        wv[16] += n16;
        wv[0] += a.nv - n8 - n12 - n16;
      };
      const int64_t at = b * a.wv.s[0] + h * a.wv.s[1];
      if (a.wv.i32)
        count(reinterpret_cast<const int32_t*>(a.wv.p) + at, a.wv.s[2]);
      else
        count(a.wv.p + at, a.wv.s[2]);
    }
    for (int i = 0; i < 17; ++i)
      TORCH_CHECK((i == 8 || i == 12 || i == 16) || (wk[i] == 0 && wv[i] == 0),
                  "width_counts: widths must be 8, 12 or 16");
    for (int w = 0; w < 3; ++w) {
      k[h * 3 + w] = wk[8 + 4 * w];
      v[h * 3 + w] = wv[8 + 4 * w];
    }
  }
  return out;
}

}  // namespace kvq
