// The attention driver shared by every storage format, and the formats' dequantizing loaders.
//
// run_item does blocked online softmax over a range of keys for a tile of query rows that share a
// KV head. A format only fills small fp32 buffers: keys (or values) of SB consecutive tokens,
// dequantized in registers from the stored bytes. The buffer is reused by every row of the tile,
// so GQA heads and query positions pay for one dequantization, and nothing of the history is
// ever written out (a format storing keys by channel may fill the key buffer channel-major:
// ChannelMajor, dot_channels). NC (16-lane chunks per head dim) is a template parameter so that a
// row's query and accumulators live in registers; NR (rows) is a runtime count.
//
// Work is split over (batch, KV head, row tile, key chunk); chunks of one head are merged with
// log-sum-exp, so a decode step over few heads still uses every thread.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace kvq {

constexpr int BT = 64;     // keys per softmax block
constexpr int SB = 16;     // keys dequantized into the buffer at a time
constexpr int NRMAX = 16;  // query rows per tile
constexpr int DMAX = 256;  // largest head dim

inline int nc_for(int d) { return d <= 16 ? 1 : d <= 32 ? 2 : d <= 64 ? 4 : d <= 128 ? 8 : 16; }

struct Rows {  // a tile of query rows (GQA heads x query positions) that read one KV head
  int n = 0;
  const float* q[NRMAX];
  int64_t mask_off[NRMAX];
  int64_t limit[NRMAX];  // keys at or after this index are masked (causal), else L
};

struct Mask {
  const uint8_t* b = nullptr;  // boolean mask: nonzero = attend
  const float* f = nullptr;    // additive mask
  int64_t st = 0;              // stride along keys
  // An fp64 score under the mask at element `at`: -inf where a boolean mask hides it, else plus the additive one.
  double apply(int64_t at, double x) const { return b != nullptr ? (b[at] ? x : -INFINITY) : x + double(f[at]); }
};

struct Half4 {  // an fp16 [B, H, T, D] tensor with a contiguous last dim
  const uint16_t* p = nullptr;
  int64_t sb = 0, sh = 0, st = 0;
  const uint16_t* row(int64_t b, int64_t h, int64_t t) const { return p + b * sb + h * sh + t * st; }
};

struct QuantPart {  // one kvquant QuantizedTensor: codes, fp16 scale and zero (absent: n = 0)
  const uint8_t* codes = nullptr;
  int64_t cb = 0, ch = 0, ct = 0;
  const uint16_t *scale = nullptr, *zero = nullptr;
  int64_t sb = 0, sh = 0, s2 = 0;  // batch, head and dim-2 strides of scale and zero
  int64_t n = 0;                   // tokens held
};

struct Problem {
  int64_t B = 0, Hq = 0, Hkv = 0, Q = 0, L = 0;
  int D = 0, g = 0;
  const float* q = nullptr;
  int64_t qb = 0, qh = 0, qt = 0;
  Mask mask;
  int64_t mb = 0, mh = 0, mq = 0;
  bool has_mask = false, causal = false;
  float scaling = 1.0f;
};

// ---------------------------------------------------------------- buffer consumers

// d[r*BT + t] = q_r . buf[t] for the n (<= SB) buffered keys.
template <int NC>
inline void dot_rows(const float* buf, int n, const Rows& R, int D, float* d) {
  for (int r = 0; r < R.n; ++r) {
    vf q[NC];
    for (int c = 0; c < NC; ++c) q[c] = load(R.q[r] + c * W, lanes(D - c * W));
    vf part[SB];
    for (int t = 0; t < SB; ++t) {
      if (t >= n) {
        part[t] = zero();
        continue;
      }
      const float* k = buf + t * NC * W;
      vf a = mul(q[0], load(k, lanes(W)));
      vf b = zero();
      for (int c = 1; c < NC; ++c) {  // two chains: half the FMA latency per token
        if (c % 2)
          b = fma(q[c], load(k + c * W, lanes(W)), b);
        else
          a = fma(q[c], load(k + c * W, lanes(W)), a);
      }
      part[t] = add(a, b);
    }
    store(d + r * BT, hsum16(part), lanes(n));
  }
}

// The same scores from a channel-major buffer (buf[c*W + t], a format that stores keys by channel):
// a vector of 16 tokens per channel times the row's query element, rows in groups of RG so that
// 8 independent FMA chains hide the latency.
template <int RG>
inline void dot_channel_group(const float* buf, int n, const float* const* q, int D, float* d) {
  constexpr int CH = RG == 1 ? 8 : RG == 2 ? 4 : 2;  // chains per row (D is a multiple of 8)
  vf acc[RG][CH];
  for (int r = 0; r < RG; ++r)
    for (int j = 0; j < CH; ++j) acc[r][j] = zero();
  for (int c = 0; c < D; c += CH) {
#pragma GCC unroll 8
    for (int j = 0; j < CH; ++j) {
      const vf k = load(buf + (c + j) * W, lanes(W));
      for (int r = 0; r < RG; ++r) acc[r][j] = fma(set1(q[r][c + j]), k, acc[r][j]);
    }
  }
  for (int r = 0; r < RG; ++r) {
    vf x = acc[r][0];
    for (int j = 1; j < CH; ++j) x = add(x, acc[r][j]);
    store(d + r * BT, x, lanes(n));
  }
}

// Calls fn.template operator()<NR>() with NR = nr clamped to 1..4: the rows of one register group, so a
// kernel templated on its row count is instantiated once per count and picked without a switch each.
template <class Fn>
inline void by_row_count(int nr, Fn&& fn) {
  switch (nr) {
    case 1: return fn.template operator()<1>();
    case 2: return fn.template operator()<2>();
    case 3: return fn.template operator()<3>();
    default: return fn.template operator()<4>();
  }
}

// by_row_count with a second template flag (FULL: the head dim fills all NC vectors).
template <class Fn>
inline void by_row_group(int nr, bool full, Fn&& fn) {
  if (full)
    by_row_count(nr, [&]<int NR>() { fn.template operator()<NR, true>(); });
  else
    by_row_count(nr, [&]<int NR>() { fn.template operator()<NR, false>(); });
}

inline void dot_channels(const float* buf, int n, const Rows& R, int D, float* d) {
  for (int r = 0; r < R.n; r += 4)
    by_row_count(R.n - r, [&]<int NR>() { dot_channel_group<NR>(buf, n, R.q + r, D, d + r * BT); });
}

// acc[r*DMAX + :] += sum_t p[r*BT + t] * buf[t] for the n buffered values.
template <int NC>
inline void accumulate_rows(const float* buf, int n, int nr, const float* p, float* acc) {
  constexpr int SETS = NC >= 8 ? 1 : 2;  // enough independent FMA chains to hide latency
  for (int r = 0; r < nr; ++r) {
    vf a[SETS][NC];
    for (int c = 0; c < NC; ++c) {
      a[0][c] = load(acc + r * DMAX + c * W, lanes(W));
      if (SETS > 1) a[SETS - 1][c] = zero();
    }
    int t = 0;
    if constexpr (SETS == 2) {
      for (; t + 1 < n; t += 2) {
        const vf p0 = set1(p[r * BT + t]), p1 = set1(p[r * BT + t + 1]);
        const float* v = buf + t * NC * W;
        for (int c = 0; c < NC; ++c) {
          a[0][c] = fma(p0, load(v + c * W, lanes(W)), a[0][c]);
          a[1][c] = fma(p1, load(v + NC * W + c * W, lanes(W)), a[1][c]);
        }
      }
    }
    for (; t < n; ++t) {
      const vf pv = set1(p[r * BT + t]);
      const float* v = buf + t * NC * W;
      for (int c = 0; c < NC; ++c) a[0][c] = fma(pv, load(v + c * W, lanes(W)), a[0][c]);
    }
    for (int c = 0; c < NC; ++c) {
      vf x = a[0][c];
      if (SETS > 1) x = add(x, a[SETS - 1][c]);
      store(acc + r * DMAX + c * W, x, lanes(W));
    }
  }
}

// ---------------------------------------------------------------- loaders (stored bytes -> buffer)

// Software prefetch of the bytes the loaders will read PF tokens later: the hardware prefetchers
// lag behind with the several streams (codes, scales, zeros, K and V) a head interleaves.
constexpr int PF = 128;

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);  // into L2: L1 is too small for PF tokens of K and V
}

// n rows of row_bytes every stride_bytes: one prefetch per cache line (rows are usually contiguous).
inline void prefetch_rows(const void* p, int64_t stride_bytes, int n, int64_t row_bytes) {
  if (stride_bytes == row_bytes) return prefetch_span(p, stride_bytes * n);
  for (int t = 0; t < n; ++t) prefetch_span(static_cast<const char*>(p) + t * stride_bytes, row_bytes);
}

// fp16 rows: lanes past D are written as zeros, so consumers may read whole chunks.
template <int NC>
inline void half_rows(const uint16_t* src, int64_t st, int n, int D, float* buf) {
  for (int t = 0; t < n; ++t) {
    prefetch_span(src + (t + PF) * st, 2 * D);  // a row at a time: a burst of 64 lines per 16 rows made fp16 1.4x slower
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const uint16_t* p = src + t * st + c * W;
      store(buf + t * NC * W + c * W, D - c * W >= W ? load_half_full(p) : load_half(p, lanes(D - c * W)), lanes(W));
    }
  }
}

// Quantized keys (per channel, groups of G tokens): scale/zero [.., T/G, 1, D], codes [.., T, D*BITS/8].
// zero + code * scale: code * scale is exact in fp32, so this equals kvquant's dequantize bit for bit.
template <int NC, int BITS>
struct KeyDequant {
  vf s[NC], z[NC];
  int64_t group = -1;
  void rows(const QuantPart& k, int64_t b, int64_t h, int64_t t0, int n, int D, int G, float* buf) {
    const uint8_t* codes = k.codes + b * k.cb + h * k.ch + t0 * k.ct;
    prefetch_rows(codes + PF * k.ct, k.ct, n, D * BITS / 8);
    if ((t0 + PF) % G < n) {  // a group starts within the prefetched tokens: its scales and zeros
      const int64_t off = b * k.sb + h * k.sh + (t0 + PF) / G * k.s2;
      prefetch_span(k.scale + off, 2 * D);
      prefetch_span(k.zero + off, 2 * D);
    }
    vf sc[NC], ze[NC];  // locals, so they stay in registers across the stores to buf
    for (int c = 0; c < NC; ++c) {
      sc[c] = s[c];
      ze[c] = z[c];
    }
    for (int t = 0; t < n; ++t) {
      const int64_t g = (t0 + t) / G;
      if (g != group) {
        group = g;
        const int64_t off = b * k.sb + h * k.sh + g * k.s2;
        for (int c = 0; c < NC; ++c) {
          sc[c] = load_half(k.scale + off + c * W, lanes(D - c * W));
          ze[c] = load_half(k.zero + off + c * W, lanes(D - c * W));
        }
      }
      const uint8_t* row = codes + t * k.ct;
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c)
        store(buf + t * NC * W + c * W, fma(unpack_codes<BITS>(row + c * 2 * BITS, D - c * W), sc[c], ze[c]), lanes(W));
    }
    for (int c = 0; c < NC; ++c) {
      s[c] = sc[c];
      z[c] = ze[c];
    }
  }

  // Scores of n keys of one group (t0 and n within it: G a multiple of SB) with the group's scale
  // folded into each row's query, q.(s*c + z) = (q*s).c + q.z: no dequantized buffer, and the codes
  // of a chunk are unpacked once for up to four rows. d[r*BT + t] as dot_rows writes it.
  alignas(64) float qs[NRMAX * NC * W];
  float bias[NRMAX];
  int64_t folded = -1;
  void scores(const QuantPart& k, int64_t b, int64_t h, int64_t t0, int n, int D, int G, const Rows& R, float* d) {
    const uint8_t* codes = k.codes + b * k.cb + h * k.ch + t0 * k.ct;
    const int64_t g = t0 / G;
    if (g != folded) {
      folded = g;
      const int64_t off = b * k.sb + h * k.sh + g * k.s2;
      if ((g + 1) * G < k.n) {
        prefetch_span(k.scale + off + k.s2, 2 * D);
        prefetch_span(k.zero + off + k.s2, 2 * D);
      }
      for (int r = 0; r < R.n; ++r) {
        vf zsum = zero();
        for (int c = 0; c < NC; ++c) {
          const mk m = lanes(D - c * W);
          const vf q = load(R.q[r] + c * W, m);
          store(qs + (r * NC + c) * W, mul(q, load_half(k.scale + off + c * W, m)), lanes(W));
          zsum = fma(q, load_half(k.zero + off + c * W, m), zsum);
        }
        bias[r] = hsum(zsum);
      }
    }
    const bool full = D == NC * W;
    for (int r = 0; r < R.n; r += 4)
      by_row_group(R.n - r, full, [&]<int NR, bool FULL>() { fold_rows<NR, FULL>(codes, k.ct, n, D, r, d); });
  }

  // FULL: D is a whole number of chunks (no partial unpacking).
  template <int RG, bool FULL>
  void fold_rows(const uint8_t* codes, int64_t ct, int n, int D, int r0, float* d) const {
    vf part[RG][SB];
    for (int t = 0; t < SB; ++t) {
      vf a[2][RG];  // two chains (even and odd chunks): half the FMA latency per token
      for (int r = 0; r < RG; ++r) a[0][r] = a[1][r] = zero();
      if (t < n) {
        const uint8_t* row = codes + t * ct;
        if (r0 == 0) prefetch_span(row + PF * ct, D * BITS / 8);  // a row at a time, as half_rows
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          const vf x = FULL ? unpack_full<BITS>(row + c * 2 * BITS) : unpack_codes<BITS>(row + c * 2 * BITS, D - c * W);
          for (int r = 0; r < RG; ++r)
            a[c % 2][r] = fma(load(qs + ((r0 + r) * NC + c) * W, lanes(W)), x, a[c % 2][r]);
        }
      }
      for (int r = 0; r < RG; ++r) part[r][t] = add(a[0][r], a[1][r]);
    }
    for (int r = 0; r < RG; ++r) store(d + (r0 + r) * BT, add(hsum16(part[r]), set1(bias[r0 + r])), lanes(n));
  }
};

// Quantized values (per token, groups of G channels): scale/zero [.., T, D/G, 1] fp16. Each chunk's
// lanes take their group's scale by a permutation of the loaded group scales.
template <int NC, int BITS>
struct ValueDequant {
  vi idx[NC];
  int g0[NC], cnt[NC];
  bool whole = true;    // all groups of a token fit one vector: load them once per token
  bool uniform = true;  // every chunk lies in one group (G a multiple of 16): broadcast its scale/zero
  int ng = 1;           // groups per token
  void init(int D, int G) {
    ng = D / G;
    whole = ng <= W;
    for (int c = 0; c < NC; ++c) {
      const int first = std::min(c * W, D - 1), last = std::min(D, c * W + W) - 1;
      uniform = uniform && first / G == last / G;
      g0[c] = whole ? 0 : first / G;
      cnt[c] = whole ? ng : last / G - first / G + 1;
      int ix[W];
      for (int i = 0; i < W; ++i) ix[i] = std::min(std::min(c * W + i, D - 1) / G - g0[c], cnt[c] - 1);
      idx[c] = index_vector(ix);
    }
    if (uniform)
      for (int c = 0; c < NC; ++c) g0[c] = std::min(c * W, D - 1) / G;
  }
  void rows(const QuantPart& v, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    const uint8_t* codes = v.codes + b * v.cb + h * v.ch + t0 * v.ct;
    const int64_t off = b * v.sb + h * v.sh + t0 * v.s2;
    prefetch_rows(codes + PF * v.ct, v.ct, n, D * BITS / 8);
    prefetch_rows(v.scale + off + PF * v.s2, 2 * v.s2, n, 2 * ng);
    prefetch_rows(v.zero + off + PF * v.s2, 2 * v.s2, n, 2 * ng);
    vi ix[NC];  // locals, so they stay in registers across the stores to buf
    for (int c = 0; c < NC; ++c) ix[c] = idx[c];
    const mk gm = lanes(ng);
    for (int t = 0; t < n; ++t) {
      const uint16_t* sp = v.scale + off + t * v.s2;
      const uint16_t* zp = v.zero + off + t * v.s2;
      const uint8_t* row = codes + t * v.ct;
      if (uniform) {  // the same numbers as the permutation below, without it (2 shuffles a chunk on AVX2)
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          const vf x = fma(unpack_codes<BITS>(row + c * 2 * BITS, D - c * W), set1(half_to_float(sp[g0[c]])),
                           set1(half_to_float(zp[g0[c]])));
          store(buf + t * NC * W + c * W, x, lanes(W));
        }
      } else if (whole) {
        const vf sa = load_half(sp, gm), za = load_half(zp, gm);
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          // Lanes past D hold the clamped group's zero: finite, and never reach the output.
          const vf x = fma(unpack_codes<BITS>(row + c * 2 * BITS, D - c * W), permute(ix[c], sa), permute(ix[c], za));
          store(buf + t * NC * W + c * W, x, lanes(W));
        }
      } else {
        for (int c = 0; c < NC; ++c) {
          const vf sv = permute(ix[c], load_half(sp + g0[c], lanes(cnt[c])));
          const vf zv = permute(ix[c], load_half(zp + g0[c], lanes(cnt[c])));
          store(buf + t * NC * W + c * W, fma(unpack_codes<BITS>(row + c * 2 * BITS, D - c * W), sv, zv), lanes(W));
        }
      }
    }
  }

  // acc[r*DMAX + :] += sum_t p[r*BT + t] * (s_t * c_t + z_t) over n quantized tokens when every chunk
  // lies in one group (uniform): each token's scale goes into its weight, (p*s).c, and its zeros into
  // one sum per row and group, so nothing is dequantized into a buffer.
  void accumulate(const QuantPart& v, int64_t b, int64_t h, int64_t t0, int n, int D, int nr, const float* p,
                  float* acc) const {
    const uint8_t* codes = v.codes + b * v.cb + h * v.ch + t0 * v.ct;
    const int64_t off = b * v.sb + h * v.sh + t0 * v.s2;
    prefetch_rows(v.scale + off + PF * v.s2, 2 * v.s2, n, 2 * ng);
    prefetch_rows(v.zero + off + PF * v.s2, 2 * v.s2, n, 2 * ng);
    alignas(64) float wgt[NRMAX * W * SB];  // [row][group][token]: p * scale (ng <= D / 16 <= W groups)
    alignas(64) float zs[NRMAX * W];        // [row][group]: sum of p * zero
    alignas(64) float sc[SB * W], ze[SB * W];  // [token][group]
    if (v.s2 == ng) {  // the block's scales are contiguous: whole vectors (a partial load_half would
                       // go through a small stack copy, a store-forwarding stall per token)
      const int count = n * ng;
      int i = 0;
      for (; i + W <= count; i += W) {
        store(sc + i, load_half_full(v.scale + off + i), lanes(W));
        store(ze + i, load_half_full(v.zero + off + i), lanes(W));
      }
      for (; i < count; ++i) {
        sc[i] = half_to_float(v.scale[off + i]);
        ze[i] = half_to_float(v.zero[off + i]);
      }
    } else {
      for (int t = 0; t < n; ++t)
        for (int g = 0; g < ng; ++g) {
          sc[t * ng + g] = half_to_float(v.scale[off + t * v.s2 + g]);
          ze[t * ng + g] = half_to_float(v.zero[off + t * v.s2 + g]);
        }
    }
    std::fill(zs, zs + nr * ng, 0.0f);
    for (int r = 0; r < nr; ++r)
      for (int t = 0; t < n; ++t) {
        const float pr = p[r * BT + t];
        for (int g = 0; g < ng; ++g) {
          wgt[(r * ng + g) * SB + t] = pr * sc[t * ng + g];
          zs[r * ng + g] += pr * ze[t * ng + g];
        }
      }
    const bool full = D == NC * W;
    for (int c = 0; c < NC; ++c) {
      for (int r = 0; r < nr; r += 4)
        by_row_group(nr - r, full, [&]<int NR, bool FULL>() {
          fold_values<NR, FULL>(codes, v.ct, n, D, c, r, wgt, zs, acc);
        });
    }
  }

  template <int RG, bool FULL>
  void fold_values(const uint8_t* codes, int64_t ct, int n, int D, int c, int r0, const float* wgt, const float* zs,
                   float* acc) const {
    constexpr int SETS = RG <= 2 ? 2 : 1;  // independent FMA chains over tokens
    const int g = g0[c];
    vf a[SETS][RG];
    for (int r = 0; r < RG; ++r) {
      a[0][r] = load(acc + (r0 + r) * DMAX + c * W, lanes(W));
      if (SETS > 1) a[SETS - 1][r] = set1(zs[(r0 + r) * ng + g]);
    }
    const uint8_t* col = codes + c * 2 * BITS;
    const float* w = wgt + (r0 * ng + g) * SB;  // row r's weights at w + r * ng * SB
    if (c == 0 && r0 == 0)  // the rows PF tokens ahead, a row at a time, as half_rows
      for (int t = 0; t < n; ++t) prefetch_span(codes + (t + PF) * ct, D * BITS / 8);
    int t = 0;
    if constexpr (SETS == 2) {
      for (; t + 1 < n; t += 2) {
        const vf x0 = FULL ? unpack_full<BITS>(col + t * ct) : unpack_codes<BITS>(col + t * ct, D - c * W);
        const vf x1 = FULL ? unpack_full<BITS>(col + (t + 1) * ct) : unpack_codes<BITS>(col + (t + 1) * ct, D - c * W);
        for (int r = 0; r < RG; ++r) {
          a[0][r] = fma(set1(w[r * ng * SB + t]), x0, a[0][r]);
          a[1][r] = fma(set1(w[r * ng * SB + t + 1]), x1, a[1][r]);
        }
      }
    }
    for (; t < n; ++t) {
      const vf x = FULL ? unpack_full<BITS>(col + t * ct) : unpack_codes<BITS>(col + t * ct, D - c * W);
      for (int r = 0; r < RG; ++r) a[0][r] = fma(set1(w[r * ng * SB + t]), x, a[0][r]);
    }
    for (int r = 0; r < RG; ++r) {
      vf x = SETS > 1 ? add(a[0][r], a[SETS - 1][r]) : add(a[0][r], set1(zs[(r0 + r) * ng + g]));
      store(acc + (r0 + r) * DMAX + c * W, x, lanes(W));
    }
  }
};

// ---------------------------------------------------------------- formats

// A format whose keys() returns bool may fill the key buffer channel-major (true: buf[c*W + t]),
// e.g. from storage that keeps keys by channel, and says so with channel_major_keys = true.
template <class F, class = void>
struct ChannelMajor : std::false_type {};
template <class F>
struct ChannelMajor<F, std::void_t<decltype(F::channel_major_keys)>> : std::bool_constant<F::channel_major_keys> {};
// A format with fused_reads = true scores keys (scores) and accumulates values (accumulate) itself,
// using the buffer where it needs one.
template <class F, class = void>
struct FusedReads : std::false_type {};
template <class F>
struct FusedReads<F, std::void_t<decltype(F::fused_reads)>> : std::bool_constant<F::fused_reads> {};

// Formats may add terms that are not in the dequantized buffers (GEAR's low-rank correction):
// key_terms adds to the raw scores of n keys, value_terms to the accumulators. None by default.
struct NoTerms {
  template <class S>
  void key_terms(S&, int64_t, int64_t, int64_t, int, const Rows&, int, float*) const {}
  template <class S>
  void value_terms(S&, int64_t, int64_t, int64_t, int, int, int, const float*, float*) const {}
};

// The fp16 method's store: K and V fp16 [B, Hkv, L, D].
template <int NC>
struct Fp16Format : NoTerms {
  Half4 k, v;
  struct State {};
  State state(const Problem&) const { return {}; }
  void keys(State&, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    half_rows<NC>(k.row(b, h, t0), k.st, n, D, buf);
  }
  void values(State&, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    half_rows<NC>(v.row(b, h, t0), v.st, n, D, buf);
  }
};

// KIVI: quantized keys [0, kq.n) then the fp16 key window; quantized values [0, vq.n) then theirs.
template <int NC, int BITS>
struct KiviFormat : NoTerms {
  QuantPart kq, vq;
  Half4 kw, vw;
  int G;
  struct State {
    KeyDequant<NC, BITS> key;
    ValueDequant<NC, BITS> value;
  };
  State state(const Problem& P) const {
    State s;
    s.value.init(P.D, G);
    return s;
  }
  void keys(State& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    const int q = int(std::clamp<int64_t>(kq.n - t0, 0, n));
    if (q > 0) s.key.rows(kq, b, h, t0, q, D, G, buf);
    if (q < n) half_rows<NC>(kw.row(b, h, t0 + q - kq.n), kw.st, n - q, D, buf + q * NC * W);
  }
  void values(State& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    const int q = int(std::clamp<int64_t>(vq.n - t0, 0, n));
    if (q > 0) s.value.rows(vq, b, h, t0, q, D, buf);
    if (q < n) half_rows<NC>(vw.row(b, h, t0 + q - vq.n), vw.st, n - q, D, buf + q * NC * W);
  }
  // Blocks wholly quantized (the window and the quantized prefix meet at a multiple of SB) are read
  // without the buffer where the groups allow it; the rest as above.
  static constexpr bool fused_reads = true;
  void scores(State& s, int64_t b, int64_t h, int64_t t0, int n, const Rows& R, int D, float* buf, float* d) const {
    if (t0 + n <= kq.n && G % SB == 0) return s.key.scores(kq, b, h, t0, n, D, G, R, d);
    keys(s, b, h, t0, n, D, buf);
    dot_rows<NC>(buf, n, R, D, d);
  }
  void accumulate(State& s, int64_t b, int64_t h, int64_t t0, int n, int nr, int D, const float* p, float* buf,
                  float* acc) const {
    if (t0 + n <= vq.n && s.value.uniform) return s.value.accumulate(vq, b, h, t0, n, D, nr, p, acc);
    values(s, b, h, t0, n, D, buf);
    accumulate_rows<NC>(buf, n, nr, p, acc);
  }
};

// ---------------------------------------------------------------- driver

// Online softmax over one block: s (BT entries, -inf past the block's keys) becomes p.
inline void softmax_block(float* s, float& m, float& l, float* acc, int D) {
  float bm = NEG_INF;
  for (int i = 0; i < BT; i += W) bm = std::max(bm, hmax(load(s + i, lanes(W)), lanes(W)));
  if (bm == NEG_INF) {
    std::fill(s, s + BT, 0.0f);
    return;
  }
  const float mn = std::max(m, bm);
  const float alpha = m == NEG_INF ? 0.0f : std::exp(m - mn);
  vf sum = zero();
  for (int i = 0; i < BT; i += W) {
    const vf p = vexp(sub(load(s + i, lanes(W)), set1(mn)));
    store(s + i, p, lanes(W));
    sum = add(sum, p);
  }
  l = l * alpha + hsum(sum);
  if (alpha != 1.0f) {
    for (int c = 0; c < D; c += W) store(acc + c, mul(load(acc + c, lanes(D - c)), set1(alpha)), lanes(D - c));
  }
  m = mn;
}

// Mask and causal limit for one block; false if no row sees any of its keys.
inline bool mask_block(const Problem& P, const Rows& R, int64_t t0, int n, float* s) {
  bool any = false;
  for (int r = 0; r < R.n; ++r) {
    float* sr = s + r * BT;
    const int vis = int(std::clamp<int64_t>(R.limit[r] - t0, 0, n));
    std::fill(sr, sr + vis, 0.0f);
    std::fill(sr + vis, sr + BT, NEG_INF);
    if (P.has_mask) {
      const int64_t base = R.mask_off[r] + t0 * P.mask.st;
      for (int t = 0; t < vis; ++t) {
        const int64_t at = base + t * P.mask.st;
        if (P.mask.b != nullptr)
          sr[t] = P.mask.b[at] ? 0.0f : NEG_INF;
        else
          sr[t] = P.mask.f[at];
      }
    }
    for (int t = 0; t < vis && !any; ++t) any = sr[t] != NEG_INF;
  }
  return any;
}

// Keys [tb, te) for the tile's rows; writes m, l and the unnormalised output of each row to out[r*(D+2)].
template <int NC, class F>
void run_item(const F& f, const Problem& P, int64_t b, int64_t h, const Rows& R, int64_t tb, int64_t te, float* out) {
  alignas(64) float s[NRMAX * BT];
  alignas(64) float d[NRMAX * BT];
  alignas(64) float acc[NRMAX * DMAX];
  alignas(64) float buf[SB * NC * W];
  float m[NRMAX], l[NRMAX];
  const int D = P.D;
  for (int r = 0; r < R.n; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.0f;
    std::fill(acc + r * DMAX, acc + r * DMAX + NC * W, 0.0f);
  }
  auto st = f.state(P);
  for (int64_t t0 = tb; t0 < te; t0 += BT) {
    const int n = int(std::min<int64_t>(BT, te - t0));
    if (!mask_block(P, R, t0, n, s)) continue;
    for (int i = 0; i < n; i += SB) {
      const int k = std::min(SB, n - i);
      if constexpr (FusedReads<F>::value) {
        f.scores(st, b, h, t0 + i, k, R, D, buf, d + i);
      } else if constexpr (ChannelMajor<F>::value) {
        if (f.keys(st, b, h, t0 + i, k, D, buf))
          dot_channels(buf, k, R, D, d + i);
        else
          dot_rows<NC>(buf, k, R, D, d + i);
      } else {
        f.keys(st, b, h, t0 + i, k, D, buf);
        dot_rows<NC>(buf, k, R, D, d + i);
      }
      f.key_terms(st, b, h, t0 + i, k, R, D, d + i);
    }
    for (int r = 0; r < R.n; ++r)
      for (int t = 0; t < n; ++t) s[r * BT + t] += P.scaling * d[r * BT + t];
    for (int r = 0; r < R.n; ++r) softmax_block(s + r * BT, m[r], l[r], acc + r * DMAX, NC * W);
    for (int i = 0; i < n; i += SB) {
      const int k = std::min(SB, n - i);
      if constexpr (FusedReads<F>::value) {
        f.accumulate(st, b, h, t0 + i, k, R.n, D, s + i, buf, acc);
      } else {
        f.values(st, b, h, t0 + i, k, D, buf);
        accumulate_rows<NC>(buf, k, R.n, s + i, acc);
      }
      f.value_terms(st, b, h, t0 + i, k, R.n, D, s + i, acc);
    }
  }
  for (int r = 0; r < R.n; ++r) {
    float* o = out + r * (D + 2);
    o[0] = m[r];
    o[1] = l[r];
    std::copy(acc + r * DMAX, acc + r * DMAX + D, o + 2);
  }
}

// How a call is cut into work items: (batch, KV head, row tile) x key chunk. Rows of a KV head are
// numbered j*Q + i (GQA head j of the group, query position i).
struct Plan {
  static constexpr int64_t SMALL = 8192;  // keys x (KV head, row tile) pairs below which one thread runs
  int64_t rows = 0, tiles = 0, items = 0, nchunk = 1, chunk_len = 0, stride = 0;
  int threads = 1;
  explicit Plan(const Problem& P) {
    rows = int64_t(P.g) * P.Q;
    tiles = (rows + NRMAX - 1) / NRMAX;
    items = P.B * P.Hkv * tiles;
    threads = at::get_num_threads();
    if (items * P.L < SMALL) threads = 1;  // waking threads would cost more than the work
    if (threads > 1) {  // about 8 pieces per thread to balance, but chunks of at least 4 blocks
      const int64_t want = (8 * threads + items - 1) / items;
      nchunk = std::max<int64_t>(1, std::min<int64_t>(want, P.L / (4 * BT)));
    }
    chunk_len = ((P.L + nchunk - 1) / nchunk + BT - 1) / BT * BT;
    nchunk = (P.L + chunk_len - 1) / chunk_len;
    stride = NRMAX * (P.D + 2);
  }
  int tile_rows(int64_t tile, int64_t& r0) const {  // rows split evenly over tiles
    const int64_t base = rows / tiles, extra = rows % tiles;
    r0 = tile * base + std::min(tile, extra);
    return int(base + (tile < extra ? 1 : 0));
  }
  // The rows of one item; b, h, r0 (its first row) and the key range [tb, te) of chunk c.
  Rows item_rows(const Problem& P, int64_t item, int64_t& b, int64_t& h, int64_t& r0) const {
    const int64_t bh = item / tiles, tile = item % tiles;
    b = bh / P.Hkv;
    h = bh % P.Hkv;
    Rows R;
    R.n = tile_rows(tile, r0);
    for (int r = 0; r < R.n; ++r) {
      const int64_t j = (r0 + r) / P.Q, i = (r0 + r) % P.Q, hq = h * P.g + j;
      R.q[r] = P.q + b * P.qb + hq * P.qh + i * P.qt;
      R.mask_off[r] = b * P.mb + hq * P.mh + i * P.mq;
      R.limit[r] = P.causal ? P.L - P.Q + i + 1 : P.L;
    }
    return R;
  }
  int64_t chunk_begin(int64_t c) const { return c * chunk_len; }
};

// Chunk partials (m, l, acc per row) -> normalised rows of out [B, Hq, Q, D].
inline void merge(const Problem& P, const Plan& plan, const std::vector<float>& part, float* o) {
  const int D = P.D;
#pragma omp parallel for schedule(static) num_threads(plan.threads)
  for (int64_t item = 0; item < plan.items; ++item) {
    const int64_t bh = item / plan.tiles, tile = item % plan.tiles;
    const int64_t b = bh / P.Hkv, h = bh % P.Hkv;
    int64_t r0;
    const int nr = plan.tile_rows(tile, r0);
    for (int r = 0; r < nr; ++r) {
      const int64_t j = (r0 + r) / P.Q, i = (r0 + r) % P.Q, hq = h * P.g + j;
      float* dst = o + ((b * P.Hq + hq) * P.Q + i) * D;
      float mx = NEG_INF;
      for (int64_t c = 0; c < plan.nchunk; ++c)
        mx = std::max(mx, part[(item * plan.nchunk + c) * plan.stride + r * (D + 2)]);
      std::fill(dst, dst + D, 0.0f);
      float denom = 0.0f;
      if (mx != NEG_INF) {  // else a row that sees no key: zeros
        for (int64_t c = 0; c < plan.nchunk; ++c) {
          const float* src = part.data() + (item * plan.nchunk + c) * plan.stride + r * (D + 2);
          if (src[0] == NEG_INF) continue;
          const float wgt = std::exp(src[0] - mx);
          denom += wgt * src[1];
          for (int x = 0; x < D; ++x) dst[x] += wgt * src[2 + x];
        }
        const float inv = 1.0f / denom;
        for (int x = 0; x < D; ++x) dst[x] *= inv;
      }
    }
  }
}

template <int NC, class F>
at::Tensor attend(const F& f, const Problem& P) {
  const Plan plan(P);
  std::vector<float> part(size_t(plan.items * plan.nchunk * plan.stride));
  const int64_t work = plan.items * plan.nchunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(plan.threads)
  for (int64_t w = 0; w < work; ++w) {
    const int64_t item = w / plan.nchunk, c = w % plan.nchunk;
    int64_t b, h, r0;
    const Rows R = plan.item_rows(P, item, b, h, r0);
    const int64_t tb = plan.chunk_begin(c), te = std::min(P.L, tb + plan.chunk_len);
    run_item<NC>(f, P, b, h, R, tb, te, part.data() + w * plan.stride);
  }
  auto out = at::empty({P.B, P.Hq, P.Q, int64_t(P.D)}, at::kFloat);
  merge(P, plan, part, out.data_ptr<float>());
  return out;
}

// Calls fn.template operator()<NC>() with NC = nc_for(D).
template <class Fn>
at::Tensor dispatch_nc(int D, Fn&& fn) {
  switch (nc_for(D)) {
    case 1: return fn.template operator()<1>();
    case 2: return fn.template operator()<2>();
    case 4: return fn.template operator()<4>();
    case 8: return fn.template operator()<8>();
    default: return fn.template operator()<16>();
  }
}

// GEAR's low-rank run (kvquant LowRankRun): segments [start + s*len, start + (s+1)*len) for s < nseg,
// factors A [B, H, nseg, len, r] and B [B, H, nseg, D, r] fp16, any strides (QR leaves A column-major).
struct Run {
  int64_t start = 0, len = 0, nseg = 0;
  int rank = 0;
  const uint16_t* a = nullptr;
  int64_t ab = 0, ah = 0, as = 0, at = 0, aj = 1;
  const uint16_t* b = nullptr;
  int64_t bb = 0, bh = 0, bs = 0, bc = 0, bj = 1;
};

// One of GEAR's K or V streams: base codes, exact outliers (position t*D + c, fp16 value), runs, window.
struct GearStream {
  QuantPart q;
  Half4 window;
  const int32_t* index = nullptr;
  const uint16_t* value = nullptr;
  int64_t ib = 0, ih = 0, vb = 0, vh = 0, n_out = 0;
  std::vector<Run> runs;
};

// A uint8 tensor [B, H, n, ...] addressed by (batch, head, index along dim 2).
struct Bytes {
  const uint8_t* p = nullptr;
  int64_t sb = 0, sh = 0, s2 = 0;
  const uint8_t* at(int64_t b, int64_t h, int64_t i) const { return p + b * sb + h * sh + i * s2; }
};

// AlignedKV's PlaneStore (kvquant.alignment) and the widths the rules chose for one step.
// Keys: nb blocks of 64 tokens, channel-major: ka [B, H, nb, D, 64], kb/kc [B, H, nb, D, 32]
// (nibbles along tokens); widths kw [B, H, nb or 1, D] (kw_c: channel stride). Values: token-major
// va [B, H, nb*64, D], vb/vc [B, H, nb*64, D/2] (nibbles along channels); widths vw [B, H, nb*64]
// (vw.s2 = 0: one width for all). The newest tokens are fp16 in tail_k / tail_v, read whole.
// tiny_k / tiny_v: some element's plane A reads as +-0 (PlaneStore.tiny_*), so the +-0 rule applies.
struct PlaneArgs {
  Bytes ka, kb, kc, kw, va, vb, vc, vw;
  int64_t kw_c = 1, nb = 0, tail_n = 0;  // tail_n: tokens in the fp16 tails
  bool tiny_k = true, tiny_v = true;
  Half4 tail_k, tail_v;
};

// A HIGGS store (the higgs method's AquaKVLayer): per token, codes over the whole row of Hkv*D
// channels, kc/vc [B, n, bytes] uint8 (kvquant.quant.bitpack, `bits` per code, two grid coordinates
// per code), fp16 scales ks/vs [B, n, groups]; the keys' RoPE tables cos/sin [B, n, D] fp32, or the
// positions [B, n] they are cos/sin(position * inv_freq) * rope_scale of (computed per token); the fp16
// sinks (positions before the codes) and recent window (after them) [B, Hkv, *, D], keys after RoPE.
// Groups of `group` channels (heads_per_group whole heads) are padded to P = m * p and rotated by
// kron(outer [m, m], S_p) / sqrt(P) after the random signs [P]; grid [2^bits, 2] fp32.
struct HiggsArgs {
  const uint8_t *kc = nullptr, *vc = nullptr;
  int64_t kcb = 0, kct = 0, vcb = 0, vct = 0;
  const uint16_t *ks = nullptr, *vs = nullptr;
  int64_t ksb = 0, kst = 0, vsb = 0, vst = 0;
  const float *cos = nullptr, *sin = nullptr;
  int64_t cb = 0, ct = 0, sb = 0, st = 0;
  const int32_t* pos = nullptr;  // or the tables' inputs: positions [B, n], inv_freq [D/2], scaling
  int64_t pb = 0, pt = 0;
  const float* inv_freq = nullptr;
  float rope_scale = 1.0f;
  bool post_rope = false;  // keys coded after RoPE: nothing to re-apply, no positions or tables
  int rotated = -1;        // post-RoPE keys scored in the rotated domain: -1 by work estimate, 0 never, 1 always
  int64_t nc = 0, ns = 0, nr = 0;  // coded, sink and recent tokens
  Half4 sink_k, sink_v, recent_k, recent_v;
  const float *grid = nullptr, *signs = nullptr, *outer = nullptr;
  int bits = 4, m = 1, p = 1, P = 1, group = 1;
  int64_t heads_per_group = 1;
};

// HIGGS-coded rows (an AQUA-KV layer's qk or qv): codes [B, n, bytes] uint8 and fp16 scales [B, n,
// groups] over rows of `channels` values, the quantizer (grid [2^bits, 2], signs [P], outer [m, m],
// groups of `group` channels padded to P = m * p) and an optional bias [channels] added to each row.
struct HiggsRowsArgs {
  const uint8_t* codes = nullptr;
  int64_t cb = 0, ct = 0;
  const uint16_t* scales = nullptr;
  int64_t sb = 0, st = 0;
  int64_t B = 0, n = 0, channels = 0, groups = 0;
  const float *grid = nullptr, *signs = nullptr, *outer = nullptr, *bias = nullptr;
  int bits = 4, m = 1, p = 1, P = 1, group = 1;
};

// An AQUA-KV layer as attention reads it: its reconstructed pre-RoPE keys and values k/v [B, nc,
// Hkv*D] fp32 (rows of the cache's workspace), RoPE as in HiggsArgs (tables or positions), and the
// fp16 sinks (before the rows) and recent window (after them) [B, Hkv, *, D], keys after RoPE.
struct AquaArgs {
  const float *k = nullptr, *v = nullptr;
  int64_t kb = 0, kt = 0, vb = 0, vt = 0;
  const float *cos = nullptr, *sin = nullptr;
  int64_t cb = 0, ct = 0, sb = 0, st = 0;
  const int32_t* pos = nullptr;
  int64_t pb = 0, pt = 0;
  const float* inv_freq = nullptr;
  float rope_scale = 1.0f;
  int64_t nc = 0, ns = 0, nr = 0;
  Half4 sink_k, sink_v, recent_k, recent_v;
};

void higgs_decode_rows(const HiggsRowsArgs& c, float* out);  // out [B, n, channels], contiguous
// Higgs.quantize of x [c.B, c.n, channels] (contiguous) into contiguous codes [B, n, nbytes] and scales [B, n, groups].
void higgs_encode_rows(const HiggsRowsArgs& c, const float* x, uint8_t* codes, int64_t nbytes, uint16_t* scales);
at::Tensor aquakv_attention(const AquaArgs& a, const Problem& P);

at::Tensor higgs_attention(const HiggsArgs& a, const Problem& P);
at::Tensor fp16_attention(const Half4& k, const Half4& v, int keep_bits, const Problem& P);
at::Tensor planes_attention(const PlaneArgs& a, const Problem& P);
at::Tensor planes_read_keys(const PlaneArgs& a, int64_t B, int64_t H, int D);
// AlignedKV's value rule (kvquant.alignment.value_widths on fp64 scores) and the attention it reads.
struct AlignedRule {
  const float* v8 = nullptr;  // |v8| of each plane-A byte (kvquant.alignment.high_byte_values), 256
  float t12 = 0, t8 = 0;      // value thresholds, as the fp32 values torch compares the gaps with
  double scaling = 1.0;       // the logits' scale, in fp64 as torch multiplies fp64 logits by it
  int64_t topk = 32, v_block = 1;
  // The block-bound rule (kvquant.alignment.block_value_widths) where value_block > 0: per block of
  // value_block tokens and channel, the largest exponent field of plane A, v_exp [B, H, nb*64/value_block, D].
  int64_t value_block = 0;
  Bytes v_exp;
  // Each channel's largest plane-A exponent field over every stored token ([B, H, D], PlaneStore.v_exp_max; may
  // be null): a bound on any block's v_exp byte and any token's field, so a run of units whose largest
  // probability is small enough reads 8 bits without those being read.
  const uint8_t* v_exp_max = nullptr;
  int64_t vem_b = 0, vem_h = 0;
  // The rule decides from fp32 scores within proven bounds (planes.cpp, rule_from_fp32), which
  // need each channel's max |K| (fp16 [B, H, D], kvquant's PlaneStore.k_absmax); without it, or with
  // exact_scores, every score is fp64.
  const uint16_t* k_absmax = nullptr;
  int64_t kab_b = 0, kab_h = 0;
  bool exact_scores = false;
};
// The key rule of one step (kvquant.alignment.key_widths, or block_key_widths where k_exp is given): q fp32 with
// its strides ([B, H*g, Q, D]), the running max |K| (fp16 [B, H, D]), AlignedKV+'s block exponent fields
// (k_exp [B, H, nb, D]) and the tiers. Integer exponent arithmetic, the same widths (uint8).
struct KeyRuleArgs {
  const float* q = nullptr;
  int64_t qb = 0, qh = 0, qt = 0, g = 1, Q = 1;
  const uint16_t* k_absmax = nullptr;
  int64_t kab_b = 0, kab_h = 0;
  Bytes k_exp;  // per_block: nb blocks of fields
  bool per_block = false;
  int64_t B = 0, H = 0, nb = 0;
  int D = 0;
  float t12 = 0, t8 = 0;
};
at::Tensor planes_key_widths(const KeyRuleArgs& a);
// Widths as uint8 or int32 (the torch rules' dtype), any strides: width(i0, i1, i2, i3).
struct AnyWidths {
  const uint8_t* p = nullptr;
  bool i32 = false;
  int64_t s[4] = {};
  int32_t operator()(int64_t a, int64_t b, int64_t c, int64_t d = 0) const {
    const int64_t at = a * s[0] + b * s[1] + c * s[2] + d * s[3];
    return i32 ? reinterpret_cast<const int32_t*>(p)[at] : p[at];
  }
};
// kvquant.methods.alignedkv.head_width_counts: per KV head how many (key token, channel) and value tokens of the
// window first..n_full were read at 8 / 12 / 16 bits, int64 [2, H, 3]. wk(b, h, j, c) over nbk blocks (per_block
// false: nbk 1, one width per column), wv(b, h, t) over nv tokens.
struct WidthCountArgs {
  AnyWidths wk, wv;
  int64_t B = 0, H = 0, D = 0, nbk = 1, nv = 0, first = 0, n_full = 0;
  bool per_block = false;
};
at::Tensor planes_width_counts(const WidthCountArgs& a);
std::tuple<int64_t, int64_t, int64_t, int64_t> aligned_rule_counts();
std::tuple<at::Tensor, at::Tensor> planes_aligned(PlaneArgs a, const Problem& P, const AlignedRule& rule);
at::Tensor planes_exponent_gaps(const int16_t* e_o, int64_t eb, int64_t eh, const Bytes& v, int64_t B, int64_t H,
                                int64_t L, int D);
at::Tensor gear_attention(const GearStream& k, const GearStream& v, int G, int bits, const Problem& P);
at::Tensor kivi_attention(const QuantPart& kq, const QuantPart& vq, const Half4& kw, const Half4& vw, int G, int bits,
                          const Problem& P);

}  // namespace kvq
