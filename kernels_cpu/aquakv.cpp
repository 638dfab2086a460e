// AQUA-KV stores (the aquakv methods: HIGGS codes of what a cross-layer linear predictor misses).
//
// Layer l's codes are of x - pred(layer l-1's reconstruction), so reading layer l needs layer l-1's
// reconstruction of every coded token, at every step: the predictors run over the whole history and
// bound a step from below (one [n, C] x [C, C] product for keys, [n, 2C] x [2C, C] for values, per
// layer). The cache therefore reconstructs each layer once per forward into a reused fp32 workspace
// [B, n, C] (pre-RoPE keys and values, all Hkv heads of a token side by side, as the predictors read
// them), which is also the next layer's predictor input, and attends over it:
// - aquakv_reconstruct: per row and group, grid lookup, inverse rotation (higgs.h), signs, scale and
//   the predictor's bias written straight into the workspace (no temporary), then the predictions
//   added in place by BLAS (addmm_ on the workspace: keys from the previous layer's keys, values
//   from this layer's keys and the previous layer's values — the weight's two row blocks, no concat);
// - aquakv_attention: the kernels.h driver over fp16 sinks, the workspace rows (keys rotated by RoPE
//   in the buffer as they are loaded, cos/sin from the int32 position as higgs.cpp computes them, or
//   from the step's fp32 tables) and the fp16 recent window.
#include <c10/util/Half.h>

#include <limits>

#include "higgs.h"
#include "kernels.h"

namespace kvq {

namespace {

// The grid points of n codes from k0 on (higgs.h's lookup); 4-bit codes (2-bit HIGGS: a 16-point grid)
// by one two-table permute per 8 codes instead of a gather.
template <int BITS>
inline void lookup_fast(const uint8_t* row, int64_t k0, int n, const float* grid, float* y) {
#if KVQ_AVX512
  if constexpr (BITS == 4) {
    if (k0 % 8 == 0) {
      const __m512d lo = _mm512_loadu_pd(reinterpret_cast<const double*>(grid));
      const __m512d hi = _mm512_loadu_pd(reinterpret_cast<const double*>(grid) + 8);
      int j = 0;
      for (; j + 8 <= n; j += 8) {
        const __m512i idx = _mm512_cvtepu32_epi64(codes8<4>(row, k0 + j));
        _mm512_storeu_ps(y + 2 * j, _mm512_castpd_ps(_mm512_permutex2var_pd(lo, idx, hi)));
      }
      if (j < n) lookup<BITS>(row, k0 + j, n - j, grid, y + 2 * j);
      return;
    }
  }
#endif
  lookup<BITS>(row, k0, n, grid, y);
}

constexpr int MFAST = 24;  // dense factors up to this order are mixed in registers (kvquant's are 1, 12, 20)

// One group: y (P grid values, overwritten) -> o[0, cn) = (H y / sqrt(P)) * signs * scale (+ bias).
inline void rotate_store(float* y, float* tmp, const HiggsRowsArgs& c, float scale, const float* bias, float* o,
                         int64_t cn) {
  const vf sv = set1(scale), norm = set1(1.0f / std::sqrt(float(c.P)));
  if (c.m > 1 && c.p % W == 0 && c.m <= MFAST) {  // dense m x m mix, 16 lanes of every block at a time
    for (int i = 0; i < c.m; ++i) fwht(y + i * c.p, c.p);
    for (int l = 0; l < c.p; l += W) {
      vf x[MFAST];
      for (int j = 0; j < c.m; ++j) x[j] = load(y + j * c.p + l, lanes(W));
      for (int i = 0; i < c.m; ++i) {
        const int64_t ch = int64_t(i) * c.p + l;
        if (ch >= cn) break;
        const float* row = c.outer + i * c.m;
        vf acc = mul(set1(row[0]), x[0]);
        for (int j = 1; j < c.m; ++j) acc = fma(set1(row[j]), x[j], acc);
        const mk m = lanes(int(cn - ch));
        vf r = mul(mul(mul(acc, norm), load(c.signs + ch, m)), sv);
        if (bias != nullptr) r = add(r, load(bias + ch, m));
        store(o + ch, r, m);
      }
    }
    return;
  }
  rotate_back(y, tmp, Rotation{c.outer, c.m, c.p, c.P});  // one block, or blocks under 16 lanes
  for (int64_t j = 0; j < cn; j += W) {
    const mk m = lanes(int(cn - j));
    vf r = mul(mul(mul(load(y + j, m), norm), load(c.signs + j, m)), sv);
    if (bias != nullptr) r = add(r, load(bias + j, m));
    store(o + j, r, m);
  }
}

template <int BITS>
void decode_impl(const HiggsRowsArgs& c, float* out) {
  const int64_t rows = c.B * c.n, C = c.channels;
  const int half = c.P / 2;
  int threads = at::get_num_threads();
  if (rows * C < 65536) threads = 1;  // waking threads would cost more than the work
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> y(size_t(c.P) + W), tmp(size_t(c.P) + W);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / c.n, t = r % c.n;
      const uint8_t* row = c.codes + b * c.cb + t * c.ct;
      const uint16_t* sc = c.scales + b * c.sb + t * c.st;
      float* o = out + r * C;
      for (int64_t gi = 0; gi < c.groups; ++gi) {
        lookup_fast<BITS>(row, gi * half, half, c.grid, y.data());
        const int64_t c0 = gi * c.group, cn = std::min<int64_t>(c.group, C - c0);
        rotate_store(y.data(), tmp.data(), c, half_to_float(sc[gi]), c.bias == nullptr ? nullptr : c.bias + c0,
                     o + c0, cn);
      }
    }
  }
}

// ---------------------------------------------------------------- encode (kvquant.quant.higgs.Higgs.quantize)

// One group's g (P floats, zero-padded) -> its fp16 scale and the P/2 grid indices: scale = fp16(RMS),
// u = g / scale, y = (u * signs) @ kron(outer, S_p) / sqrt(P), each pair of y to its nearest grid point
// (the largest y.g - |g|^2/2, the first on a tie, as kvquant's argmax).
inline uint16_t quantize_group(float* g, float* tmp, const HiggsRowsArgs& c, const float* half_sq, int* codes) {
  const int P = c.P, n = 1 << c.bits;
  float ss = 0.0f;
  for (int i = 0; i < P; ++i) ss += g[i] * g[i];
  const float rms = std::min(std::sqrt(ss / float(P)), 65504.0f);
  const uint16_t h = c10::Half(rms).x;
  const float s = half_to_float(h);
  const float inv_norm = 1.0f / std::sqrt(float(P));
  for (int i = 0; i < P; ++i) g[i] = s > 0.0f ? g[i] / std::max(s, std::numeric_limits<float>::min()) * c.signs[i] : 0.0f;
  rotate_forward(g, tmp, Rotation{c.outer, c.m, c.p, c.P});
  for (int k = 0; k < P / 2; ++k) {
    const float y0 = g[2 * k] * inv_norm, y1 = g[2 * k + 1] * inv_norm;
    int best = 0;
    float top = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) {
      const float score = y0 * c.grid[2 * j] + y1 * c.grid[2 * j + 1] - half_sq[j];
      if (score > top) {
        top = score;
        best = j;
      }
    }
    codes[k] = best;
  }
  return h;
}

}  // namespace

void higgs_encode_rows(const HiggsRowsArgs& c, const float* x, uint8_t* codes, int64_t nbytes, uint16_t* scales) {
  const int64_t rows = c.B * c.n, C = c.channels, ncodes = c.groups * c.P / 2;
  std::vector<float> half_sq(size_t(1) << c.bits);
  for (size_t j = 0; j < half_sq.size(); ++j)
    half_sq[j] = 0.5f * (c.grid[2 * j] * c.grid[2 * j] + c.grid[2 * j + 1] * c.grid[2 * j + 1]);
  int threads = at::get_num_threads();
  if (rows * C < 65536) threads = 1;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> g(size_t(c.P)), tmp(size_t(c.P));
    std::vector<int> idx(size_t(ncodes) + 4, 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * C;
      for (int64_t gi = 0; gi < c.groups; ++gi) {
        const int64_t c0 = gi * c.group, cn = std::min<int64_t>(c.group, C - c0);
        std::fill(g.begin(), g.end(), 0.0f);
        std::copy(xr + c0, xr + c0 + cn, g.begin());
        scales[r * c.groups + gi] = quantize_group(g.data(), tmp.data(), c, half_sq.data(), idx.data() + gi * c.P / 2);
      }
      uint8_t* out = codes + r * nbytes;
      std::fill(out, out + nbytes, uint8_t(0));
      if (c.bits == 8) {
        for (int64_t k = 0; k < ncodes; ++k) out[k] = uint8_t(idx[k]);
      } else if (c.bits == 4) {
        for (int64_t k = 0; k < ncodes; ++k) out[k >> 1] |= uint8_t(idx[k] << ((k & 1) * 4));
      } else {  // 6 bits: words of 4 codes in 3 bytes, low bits first
        for (int64_t k = 0; k < ncodes; k += 4) {
          uint32_t w = 0;
          for (int i = 0; i < 4 && k + i < ncodes; ++i) w |= uint32_t(idx[k + i]) << (6 * i);
          uint8_t* o = out + k / 4 * 3;
          o[0] = uint8_t(w);
          o[1] = uint8_t(w >> 8);
          o[2] = uint8_t(w >> 16);
        }
      }
    }
  }
}

namespace {

// The AQUA-KV store as the driver reads it: fp16 sinks [0, ns), workspace rows [ns, ns + nc), fp16
// recent window after them.
template <int NC>
struct AquaFormat : NoTerms {
  AquaArgs a;
  struct State {
    alignas(64) float cs[DMAX];
    alignas(64) float sn[DMAX];
  };
  State state(const Problem&) const { return {}; }

  // Workspace keys ci .. ci + n of head h, RoPE applied (torch's x * cos + rotate_half(x) * sin).
  void rope_rows(State& s, int64_t b, int64_t h, int64_t ci, int n, int D, float* buf) const {
    constexpr int NCW = NC * W;
    const int hh = D / 2;
    for (int j = 0; j < n; ++j) {
      const float* x = a.k + b * a.kb + (ci + j) * a.kt + h * D;
      const float* cs = s.cs;
      const float* sn = s.sn;
      if (a.pos != nullptr) {
        rope_row(a.pos[b * a.pb + (ci + j) * a.pt], a.inv_freq, a.rope_scale, D, s.cs, s.sn);
      } else {
        cs = a.cos + b * a.cb + (ci + j) * a.ct;
        sn = a.sin + b * a.sb + (ci + j) * a.st;
      }
      float* dst = buf + j * NCW;
      for (int l = 0; l < hh; l += W) {
        const mk m = lanes(hh - l);
        const vf x1 = load(x + l, m), x2 = load(x + hh + l, m);
        store(dst + l, sub(mul(x1, load(cs + l, m)), mul(x2, load(sn + l, m))), m);
        store(dst + hh + l, add(mul(x2, load(cs + hh + l, m)), mul(x1, load(sn + hh + l, m))), m);
      }
      std::fill(dst + D, dst + NCW, 0.0f);
    }
  }

  // Workspace values ci .. ci + n of head h (lanes past D zeroed by the masked loads).
  void value_rows(int64_t b, int64_t h, int64_t ci, int n, int D, float* buf) const {
    for (int j = 0; j < n; ++j) {
      const float* x = a.v + b * a.vb + (ci + j) * a.vt + h * D;
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) store(buf + j * NC * W + c * W, load(x + c * W, lanes(D - c * W)), lanes(W));
    }
  }

  template <bool KEY>
  void rows(State& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    const int64_t code1 = a.ns + a.nc;
    for (int i = 0; i < n;) {
      const int64_t t = t0 + i;
      float* dst = buf + i * NC * W;
      int k;
      if (t < a.ns) {
        k = int(std::min<int64_t>(n - i, a.ns - t));
        const Half4& src = KEY ? a.sink_k : a.sink_v;
        half_rows<NC>(src.row(b, h, t), src.st, k, D, dst);
      } else if (t < code1) {
        k = int(std::min<int64_t>(n - i, code1 - t));
        if constexpr (KEY)
          rope_rows(s, b, h, t - a.ns, k, D, dst);
        else
          value_rows(b, h, t - a.ns, k, D, dst);
      } else {
        k = n - i;
        const Half4& src = KEY ? a.recent_k : a.recent_v;
        half_rows<NC>(src.row(b, h, t - code1), src.st, k, D, dst);
      }
      i += k;
    }
  }
  void keys(State& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    rows<true>(s, b, h, t0, n, D, buf);
  }
  void values(State& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    rows<false>(s, b, h, t0, n, D, buf);
  }
};

}  // namespace

void higgs_decode_rows(const HiggsRowsArgs& c, float* out) {
  switch (c.bits) {
    case 4: return decode_impl<4>(c, out);
    case 6: return decode_impl<6>(c, out);
    default: return decode_impl<8>(c, out);
  }
}

at::Tensor aquakv_attention(const AquaArgs& a, const Problem& P) {
  return dispatch_nc(P.D, [&]<int NC>() { return attend<NC>(AquaFormat<NC>{{}, a}, P); });
}

}  // namespace kvq
