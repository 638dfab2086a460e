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
#include "higgs.h"
#include "kernels.h"

namespace kvq {

namespace {

template <int BITS>
void decode_impl(const HiggsRowsArgs& c, float* out) {
  const int64_t rows = c.B * c.n, C = c.channels;
  const int half = c.P / 2;
  const Rotation rot{c.outer, c.m, c.p, c.P};
  const float inv_sqrt = 1.0f / std::sqrt(float(c.P));
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
        lookup<BITS>(row, gi * half, half, c.grid, y.data());
        rotate_back(y.data(), tmp.data(), rot);
        // kvquant's order: (H y / sqrt(P)) * signs * scale, then + bias
        const vf scale = set1(half_to_float(sc[gi])), norm = set1(inv_sqrt);
        const int64_t c0 = gi * c.group, cn = std::min<int64_t>(c.group, C - c0);
        for (int64_t j = 0; j < cn; j += W) {
          const mk m = lanes(int(cn - j));
          vf x = mul(mul(mul(load(y.data() + j, m), norm), load(c.signs + j, m)), scale);
          if (c.bias != nullptr) x = add(x, load(c.bias + c0 + j, m));
          store(o + c0 + j, x, m);
        }
      }
    }
  }
}

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
