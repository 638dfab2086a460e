// Python bindings: argument checks, then the format's kernel (fp16.cpp, kivi.cpp, gear.cpp, planes.cpp, higgs.cpp,
// aquakv.cpp; driver in kernels.h).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor casters without all of torch/extension.h

#include <numeric>
#include <tuple>

#include "kernels.h"

namespace kvq {

// ---------------------------------------------------------------- argument checks

const uint16_t* half_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); }

Half4 half4(const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t D) {
  TORCH_CHECK(t.scalar_type() == at::kHalf, name, " must be float16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 4 && t.size(0) == B && t.size(1) == H && t.size(3) == D, name,
              " must be [B, Hkv, T, D] = [", B, ", ", H, ", T, ", D, "], got ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1 || t.size(3) == 1, name, " needs a contiguous last dim");
  return Half4{half_ptr(t), t.stride(0), t.stride(1), t.stride(2)};
}

Problem problem(const at::Tensor& q, int64_t Hkv, int64_t L, const c10::optional<at::Tensor>& mask, bool causal,
                double scaling) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be float32, got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 4, "q must be [B, Hq, q_len, D], got ", q.sizes());
  TORCH_CHECK(q.stride(3) == 1, "q needs a contiguous last dim");
  Problem P{};
  P.B = q.size(0);
  P.Hq = q.size(1);
  P.Q = q.size(2);
  P.D = int(q.size(3));
  P.Hkv = Hkv;
  P.L = L;
  TORCH_CHECK(P.D >= 1 && P.D <= DMAX, "head_dim must be in 1..", DMAX, ", got ", P.D);
  TORCH_CHECK(Hkv >= 1 && P.Hq % Hkv == 0, "query heads (", P.Hq, ") must be a multiple of KV heads (", Hkv, ")");
  TORCH_CHECK(P.Q >= 1 && L >= 1, "need q_len >= 1 and at least one key");
  P.g = int(P.Hq / Hkv);
  P.q = q.data_ptr<float>();
  P.qb = q.stride(0);
  P.qh = q.stride(1);
  P.qt = q.stride(2);
  P.causal = causal;
  P.scaling = float(scaling);
  P.has_mask = mask.has_value();
  if (P.has_mask) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4 && m.size(0) == P.B && m.size(1) == P.Hq && m.size(2) == P.Q && m.size(3) == L,
                "mask must be expanded to [B, Hq, q_len, L] = [", P.B, ", ", P.Hq, ", ", P.Q, ", ", L, "], got ",
                m.sizes());
    if (m.scalar_type() == at::kBool) {
      P.mask.b = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
    } else {
      TORCH_CHECK(m.scalar_type() == at::kFloat, "mask must be bool or float32, got ", m.scalar_type());
      P.mask.f = m.data_ptr<float>();
    }
    P.mb = m.stride(0);
    P.mh = m.stride(1);
    P.mq = m.stride(2);
    P.mask.st = m.stride(3);
  }
  return P;
}

QuantPart quant_part(const c10::optional<at::Tensor>& codes, const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& zero, const char* name, int64_t B, int64_t H, int64_t D,
                     int bits, int64_t G, bool per_channel) {
  QuantPart qp;
  if (!codes.has_value()) return qp;
  TORCH_CHECK(scale.has_value() && zero.has_value(), name, ": codes given without scale and zero");
  const at::Tensor &c = *codes, &s = *scale, &z = *zero;
  const int64_t nbytes = (D * bits + 7) / 8;
  TORCH_CHECK(c.scalar_type() == at::kByte && c.dim() == 4 && c.size(0) == B && c.size(1) == H && c.size(3) == nbytes,
              name, " codes must be uint8 [B, Hkv, T, ", nbytes, "], got ", c.scalar_type(), " ", c.sizes());
  TORCH_CHECK(c.stride(3) == 1, name, " codes need a contiguous last dim");
  const int64_t n = c.size(2);
  TORCH_CHECK(s.scalar_type() == at::kHalf && z.scalar_type() == at::kHalf, name, " scale/zero must be float16");
  TORCH_CHECK(s.sizes() == z.sizes() && s.strides() == z.strides(), name, " scale and zero must share one layout");
  if (per_channel) {  // keys: [B, H, n/G, 1, D]
    TORCH_CHECK(n % G == 0, name, ": quantized keys must hold whole groups, got ", n, " tokens for group ", G);
    TORCH_CHECK(s.dim() == 5 && s.size(0) == B && s.size(1) == H && s.size(2) == n / G && s.size(3) == 1 &&
                    s.size(4) == D && s.stride(4) == 1,
                name, " scale must be [B, Hkv, T/G, 1, D] with a contiguous last dim, got ", s.sizes());
  } else {  // values: [B, H, n, D/G, 1]
    TORCH_CHECK(D % G == 0, name, ": group size ", G, " must divide head_dim ", D);
    TORCH_CHECK(s.dim() == 5 && s.size(0) == B && s.size(1) == H && s.size(2) == n && s.size(3) == D / G &&
                    s.size(4) == 1 && (s.stride(3) == 1 || s.size(3) == 1),
                name, " scale must be [B, Hkv, T, D/G, 1] with contiguous groups, got ", s.sizes());
  }
  qp.codes = c.data_ptr<uint8_t>();
  qp.cb = c.stride(0);
  qp.ch = c.stride(1);
  qp.ct = c.stride(2);
  qp.scale = half_ptr(s);
  qp.zero = half_ptr(z);
  qp.sb = s.stride(0);
  qp.sh = s.stride(1);
  qp.s2 = s.stride(2);
  qp.n = n;
  return qp;
}

std::vector<Run> runs(const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                      const std::vector<at::Tensor>& as, const std::vector<at::Tensor>& bs, const char* name, int64_t B,
                      int64_t H, int64_t D, int64_t n) {
  TORCH_CHECK(starts.size() == lens.size() && lens.size() == as.size() && as.size() == bs.size(), name,
              ": runs need one start, length, A and B each");
  std::vector<Run> out;
  for (size_t i = 0; i < starts.size(); ++i) {
    const at::Tensor &a = as[i], &b = bs[i];
    TORCH_CHECK(a.scalar_type() == at::kHalf && b.scalar_type() == at::kHalf, name, " low-rank factors must be float16");
    TORCH_CHECK(a.dim() == 5 && a.size(0) == B && a.size(1) == H && a.size(3) == lens[i], name,
                " A must be [B, Hkv, n_segments, seg_len, r], got ", a.sizes());
    TORCH_CHECK(b.dim() == 5 && b.size(0) == B && b.size(1) == H && b.size(2) == a.size(2) && b.size(3) == D &&
                    b.size(4) == a.size(4),
                name, " B must be [B, Hkv, n_segments, D, r] matching A, got ", b.sizes());
    TORCH_CHECK(a.size(4) <= DMAX, name, " rank above ", DMAX);
    Run r;
    r.start = starts[i];
    r.len = lens[i];
    r.nseg = a.size(2);
    r.rank = int(a.size(4));
    TORCH_CHECK(r.start >= 0 && r.len >= 1 && r.start + r.len * r.nseg <= n, name, " run ", i,
                " lies outside the quantized tokens");
    r.a = half_ptr(a);
    r.ab = a.stride(0);
    r.ah = a.stride(1);
    r.as = a.stride(2);
    r.at = a.stride(3);
    r.aj = a.stride(4);
    r.b = half_ptr(b);
    r.bb = b.stride(0);
    r.bh = b.stride(1);
    r.bs = b.stride(2);
    r.bc = b.stride(3);
    r.bj = b.stride(4);
    out.push_back(r);
  }
  return out;
}

void outliers(GearStream& st, const c10::optional<at::Tensor>& index, const c10::optional<at::Tensor>& value,
              const char* name, int64_t B, int64_t H) {
  if (!index.has_value()) return;
  TORCH_CHECK(value.has_value(), name, ": outlier index given without values");
  const at::Tensor &i = *index, &v = *value;
  TORCH_CHECK(i.scalar_type() == at::kInt && v.scalar_type() == at::kHalf, name,
              " outliers must be int32 positions and float16 values");
  TORCH_CHECK(i.dim() == 3 && i.size(0) == B && i.size(1) == H && v.sizes() == i.sizes() && i.stride(2) == 1 &&
                  v.stride(2) == 1,
              name, " outliers must be [B, Hkv, n] with a contiguous last dim, got ", i.sizes());
  st.index = i.data_ptr<int32_t>();
  st.value = half_ptr(v);
  st.ib = i.stride(0);
  st.ih = i.stride(1);
  st.vb = v.stride(0);
  st.vh = v.stride(1);
  st.n_out = i.size(2);
}

}  // namespace kvq

at::Tensor attend_fp16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& mask, bool causal, double scaling, int64_t keep_bits) {
  using namespace kvq;
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "k and v must be [B, Hkv, L, D]");
  TORCH_CHECK(keep_bits >= 6 && keep_bits <= 16, "keep_bits must be in 6..16, got ", keep_bits);
  const int64_t Hkv = k.size(1), L = k.size(2);
  Problem P = problem(q, Hkv, L, mask, causal, scaling);
  TORCH_CHECK(v.size(2) == L, "k and v must hold the same number of tokens, got ", L, " and ", v.size(2));
  return fp16_attention(half4(k, "k", P.B, Hkv, P.D), half4(v, "v", P.B, Hkv, P.D), int(keep_bits), P);
}

namespace kvq {

// A uint8 plane [B, H, n, inner...] whose trailing dims are contiguous (inner: their sizes).
Bytes plane(const at::Tensor& t, const char* name, int64_t B, int64_t H, std::vector<int64_t> inner) {
  TORCH_CHECK(t.scalar_type() == at::kByte, name, " must be uint8, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == int64_t(3 + inner.size()) && t.size(0) == B && t.size(1) == H, name, " must be [", B, ", ",
              H, ", n, ...], got ", t.sizes());
  int64_t expect = 1;
  for (int64_t i = int64_t(inner.size()) - 1; i >= 0; --i) {
    TORCH_CHECK(t.size(3 + i) == inner[i], name, " has shape ", t.sizes(), "; its trailing dims must be ", inner);
    TORCH_CHECK(t.stride(3 + i) == expect || t.size(3 + i) == 1, name, " needs contiguous trailing dims");
    expect *= inner[i];
  }
  return Bytes{t.data_ptr<uint8_t>(), t.stride(0), t.stride(1), t.stride(2)};
}

// Widths (uint8, each 8, 12 or 16) [B, H, n] or [B, H, n, D]; broadcast dims may have stride 0.
Bytes widths(const at::Tensor& t, const char* name, int64_t B, int64_t H, int64_t n, int64_t D) {
  const bool keys = D > 0;
  TORCH_CHECK(t.scalar_type() == at::kByte, name, " must be uint8, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == (keys ? 4 : 3) && t.size(0) == B && t.size(1) == H && (t.size(2) == n || t.size(2) == 1) &&
                  (!keys || t.size(3) == D),
              name, " must be [", B, ", ", H, ", ", n, keys ? ", D]" : "]", " (or 1 along dim 2), got ", t.sizes());
  const Bytes w{t.data_ptr<uint8_t>(), t.stride(0), t.stride(1), t.size(2) == 1 ? 0 : t.stride(2)};
  // Checked a row at a time: a key row's D channels (per head, or per block and head), or a head's widths along
  // its tokens; a contiguous row vectorized. Why: AlignedKV+'s key widths are a byte per block and channel (1 MiB
  // a step at 32 heads x 16K), which a byte-at-a-time loop made a visible share of the call.
  const int64_t n_rows = keys ? t.size(2) : 1, per_row = keys ? D : t.size(2), step = keys ? t.stride(3) : w.s2;
  auto unread = [](uint8_t x) { return uint8_t(uint8_t(x != 8) & uint8_t(x != 12) & uint8_t(x != 16)); };
  uint8_t odd = 0;  // a width the loaders have no read for
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < n_rows; ++i) {
        const uint8_t* row = w.at(b, h, i);
        if (step == 1)
          for (int64_t c = 0; c < per_row; ++c) odd |= unread(row[c]);
        else
          for (int64_t c = 0; c < per_row; ++c) odd |= unread(row[c * step]);
      }
  TORCH_CHECK(odd == 0, name, ": plane reads take widths 8, 12 or 16");
  return w;
}

}  // namespace kvq

using Opt = c10::optional<at::Tensor>;

namespace kvq {

// A PlaneStore's tensors and the key widths; the value widths are the caller's.
PlaneArgs plane_store(int64_t B, int64_t Hkv, int64_t D, const Opt& k_a, const Opt& k_b, const Opt& k_c,
                      const Opt& k_widths, const at::Tensor& tail_k, const Opt& v_a, const Opt& v_b, const Opt& v_c,
                      const at::Tensor& tail_v, bool tiny_k, bool tiny_v) {
  TORCH_CHECK(tail_k.dim() == 4 && tail_v.dim() == 4, "tails must be [B, Hkv, T, D]");
  TORCH_CHECK(D % 8 == 0, "the plane layout needs head_dim a multiple of 8, got ", D);
  PlaneArgs a;
  a.tiny_k = tiny_k;
  a.tiny_v = tiny_v;
  a.tail_n = tail_k.size(2);
  const bool blocks = k_a.has_value();
  TORCH_CHECK(blocks == k_b.has_value() && blocks == k_c.has_value() && blocks == v_a.has_value() &&
                  blocks == v_b.has_value() && blocks == v_c.has_value(),
              "planes: give all six planes or none");
  if (blocks) {
    TORCH_CHECK(k_widths.has_value(), "planes: widths are needed with the planes");
    a.ka = plane(*k_a, "k_a", B, Hkv, {D, 64});
    a.nb = k_a->size(2);
    a.kb = plane(*k_b, "k_b", B, Hkv, {D, 32});
    a.kc = plane(*k_c, "k_c", B, Hkv, {D, 32});
    TORCH_CHECK(k_b->size(2) == a.nb && k_c->size(2) == a.nb, "k_a, k_b and k_c must hold the same blocks");
    a.va = plane(*v_a, "v_a", B, Hkv, {D});
    a.vb = plane(*v_b, "v_b", B, Hkv, {D / 2});
    a.vc = plane(*v_c, "v_c", B, Hkv, {D / 2});
    const int64_t nv = a.nb * 64;
    TORCH_CHECK(v_a->size(2) == nv && v_b->size(2) == nv && v_c->size(2) == nv, "value planes must hold ", nv,
                " tokens (the key blocks'), got ", v_a->size(2));
    a.kw = widths(*k_widths, "k_widths", B, Hkv, a.nb, D);
    a.kw_c = k_widths->stride(3);
  }
  TORCH_CHECK(tail_v.size(2) == a.tail_n, "keys cover ", a.nb * 64 + a.tail_n, " tokens but values ",
              a.nb * 64 + tail_v.size(2));
  a.tail_k = half4(tail_k, "tail_k", B, Hkv, D);
  a.tail_v = half4(tail_v, "tail_v", B, Hkv, D);
  return a;
}

}  // namespace kvq

at::Tensor attend_planes(const at::Tensor& q, const Opt& k_a, const Opt& k_b, const Opt& k_c, const Opt& k_widths,
                         const at::Tensor& tail_k, const Opt& v_a, const Opt& v_b, const Opt& v_c,
                         const Opt& v_widths, const at::Tensor& tail_v, bool tiny_k, bool tiny_v, const Opt& mask,
                         bool causal, double scaling) {
  using namespace kvq;
  const int64_t B = q.size(0), Hkv = tail_k.size(1), D = q.size(3);
  PlaneArgs a = plane_store(B, Hkv, D, k_a, k_b, k_c, k_widths, tail_k, v_a, v_b, v_c, tail_v, tiny_k, tiny_v);
  if (a.nb) {
    TORCH_CHECK(v_widths.has_value(), "planes: widths are needed with the planes");
    a.vw = widths(*v_widths, "v_widths", B, Hkv, a.nb * 64, 0);
  }
  return planes_attention(a, problem(q, Hkv, a.nb * 64 + a.tail_n, mask, causal, scaling));
}

std::tuple<at::Tensor, at::Tensor> attend_aligned(const at::Tensor& q, const Opt& k_a, const Opt& k_b,
                                                  const Opt& k_c, const Opt& k_widths, const at::Tensor& tail_k,
                                                  const Opt& v_a, const Opt& v_b, const Opt& v_c,
                                                  const at::Tensor& tail_v, bool tiny_k, bool tiny_v, const Opt& mask,
                                                  double scaling, const at::Tensor& v8, double t12, double t8,
                                                  int64_t topk, int64_t v_block, const Opt& v_exp,
                                                  int64_t value_block, const Opt& v_exp_max, const Opt& k_absmax,
                                                  bool exact_scores) {
  using namespace kvq;
  const int64_t B = q.size(0), Hkv = tail_k.size(1), D = q.size(3);
  PlaneArgs a = plane_store(B, Hkv, D, k_a, k_b, k_c, k_widths, tail_k, v_a, v_b, v_c, tail_v, tiny_k, tiny_v);
  TORCH_CHECK(mask.has_value() || q.size(2) == 1, "aligned: a multi-token step needs its mask");
  TORCH_CHECK(v8.scalar_type() == at::kFloat && v8.numel() == 256 && v8.is_contiguous(), "v8 must be 256 float32");
  TORCH_CHECK(topk >= 1 && v_block >= 1, "topk and v_block must be >= 1");
  AlignedRule rule;
  rule.v8 = v8.data_ptr<float>();
  rule.t12 = float(t12);
  rule.t8 = float(t8);
  rule.scaling = scaling;
  rule.topk = topk;
  rule.v_block = v_block;
  if (value_block > 0 && a.nb) {  // the block rule reads the exponent bytes kept at append time
    TORCH_CHECK(64 % value_block == 0, "aligned: value_block must divide 64, got ", value_block);
    TORCH_CHECK(v_exp.has_value(), "aligned: the block rule needs v_exp");
    const at::Tensor& e = *v_exp;
    TORCH_CHECK(e.scalar_type() == at::kByte && e.dim() == 4 && e.size(0) == B && e.size(1) == Hkv &&
                    e.size(2) == a.nb * 64 / value_block && e.size(3) == D && e.stride(3) == 1,
                "aligned: v_exp must be uint8 [", B, ", ", Hkv, ", ", a.nb * 64 / value_block, ", ", D,
                "] with a contiguous last dim, got ", e.scalar_type(), " ", e.sizes());
    rule.value_block = value_block;
    rule.v_exp = Bytes{e.data_ptr<uint8_t>(), e.stride(0), e.stride(1), e.stride(2)};
  }
  if (v_exp_max.has_value() && a.nb) {
    const at::Tensor& m = *v_exp_max;
    TORCH_CHECK(m.scalar_type() == at::kByte && m.dim() == 3 && m.size(0) == B && m.size(1) == Hkv &&
                    m.size(2) == D && m.stride(2) == 1,
                "aligned: v_exp_max must be uint8 [", B, ", ", Hkv, ", ", D, "] with a contiguous last dim, got ",
                m.scalar_type(), " ", m.sizes());
    rule.v_exp_max = m.data_ptr<uint8_t>();
    rule.vem_b = m.stride(0);
    rule.vem_h = m.stride(1);
  }
  rule.exact_scores = exact_scores;
  if (k_absmax.has_value()) {
    const at::Tensor& m = *k_absmax;
    TORCH_CHECK(m.scalar_type() == at::kHalf && m.dim() == 3 && m.size(0) == B && m.size(1) == Hkv &&
                    m.size(2) == D && m.stride(2) == 1,
                "aligned: k_absmax must be float16 [", B, ", ", Hkv, ", ", D, "] with a contiguous last dim, got ",
                m.scalar_type(), " ", m.sizes());
    rule.k_absmax = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
    rule.kab_b = m.stride(0);
    rule.kab_h = m.stride(1);
  }
  return planes_aligned(a, problem(q, Hkv, a.nb * 64 + a.tail_n, mask, false, scaling), rule);
}

at::Tensor attend_kivi(const at::Tensor& q, const c10::optional<at::Tensor>& k_codes,
                       const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& k_zero,
                       const at::Tensor& k_window, const c10::optional<at::Tensor>& v_codes,
                       const c10::optional<at::Tensor>& v_scale, const c10::optional<at::Tensor>& v_zero,
                       const at::Tensor& v_window, int64_t bits, int64_t group_size,
                       const c10::optional<at::Tensor>& mask, bool causal, double scaling) {
  using namespace kvq;
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "bits must be 2, 4 or 8, got ", bits);
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1");
  TORCH_CHECK(k_window.dim() == 4 && v_window.dim() == 4, "windows must be [B, Hkv, W, D]");
  const int64_t B = q.size(0), Hkv = k_window.size(1), D = q.size(3);
  const QuantPart kq = quant_part(k_codes, k_scale, k_zero, "k", B, Hkv, D, int(bits), group_size, true);
  const QuantPart vq = quant_part(v_codes, v_scale, v_zero, "v", B, Hkv, D, int(bits), group_size, false);
  const int64_t L = kq.n + k_window.size(2);
  TORCH_CHECK(vq.n + v_window.size(2) == L, "keys cover ", L, " tokens but values ", vq.n + v_window.size(2));
  Problem P = problem(q, Hkv, L, mask, causal, scaling);
  const Half4 kw = half4(k_window, "k_window", B, Hkv, D), vw = half4(v_window, "v_window", B, Hkv, D);
  return kivi_attention(kq, vq, kw, vw, int(group_size), int(bits), P);
}

at::Tensor read_plane_keys(const Opt& k_a, const Opt& k_b, const Opt& k_c, const Opt& k_widths,
                           const at::Tensor& tail_k, bool tiny_k) {
  using namespace kvq;
  TORCH_CHECK(tail_k.dim() == 4, "tail_k must be [B, Hkv, T, D]");
  const int64_t B = tail_k.size(0), Hkv = tail_k.size(1), D = tail_k.size(3);
  TORCH_CHECK(D % 8 == 0 && D <= DMAX, "the plane layout needs head_dim a multiple of 8 up to ", DMAX, ", got ", D);
  PlaneArgs a;
  a.tiny_k = tiny_k;
  a.tail_n = tail_k.size(2);
  a.tail_k = half4(tail_k, "tail_k", B, Hkv, D);
  if (k_a.has_value()) {
    TORCH_CHECK(k_b.has_value() && k_c.has_value() && k_widths.has_value(), "planes: k_a needs k_b, k_c and widths");
    a.ka = plane(*k_a, "k_a", B, Hkv, {D, 64});
    a.nb = k_a->size(2);
    a.kb = plane(*k_b, "k_b", B, Hkv, {D, 32});
    a.kc = plane(*k_c, "k_c", B, Hkv, {D, 32});
    TORCH_CHECK(k_b->size(2) == a.nb && k_c->size(2) == a.nb, "k_a, k_b and k_c must hold the same blocks");
    a.kw = widths(*k_widths, "k_widths", B, Hkv, a.nb, D);
    a.kw_c = k_widths->stride(3);
  }
  return planes_read_keys(a, B, Hkv, int(D));
}

at::Tensor exponent_gaps(const at::Tensor& e_o, const at::Tensor& v_high) {
  using namespace kvq;
  TORCH_CHECK(v_high.dim() == 4, "v_high must be [B, Hkv, L, D], got ", v_high.sizes());
  const int64_t B = v_high.size(0), H = v_high.size(1), L = v_high.size(2), D = v_high.size(3);
  TORCH_CHECK(D >= 1 && D <= DMAX, "head_dim must be in 1..", DMAX, ", got ", D);
  const Bytes v = plane(v_high, "v_high", B, H, {D});
  TORCH_CHECK(e_o.scalar_type() == at::kShort && e_o.dim() == 3 && e_o.size(0) == B && e_o.size(1) == H &&
                  e_o.size(2) == D && e_o.stride(2) == 1,
              "e_o must be int16 [", B, ", ", H, ", ", D, "] with a contiguous last dim, got ", e_o.scalar_type(), " ",
              e_o.sizes());
  return planes_exponent_gaps(e_o.data_ptr<int16_t>(), e_o.stride(0), e_o.stride(1), v, B, H, L, int(D));
}

at::Tensor key_widths(const at::Tensor& q, const at::Tensor& k_absmax, const Opt& k_exp, double t12, double t8) {
  using namespace kvq;
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.stride(3) == 1,
              "key_widths: q must be float32 [B, Hq, Q, D] with a contiguous last dim, got ", q.scalar_type(), " ",
              q.sizes());
  TORCH_CHECK(k_absmax.scalar_type() == at::kHalf && k_absmax.dim() == 3 && k_absmax.size(0) == q.size(0) &&
                  k_absmax.size(2) == q.size(3) && k_absmax.stride(2) == 1,
              "key_widths: k_absmax must be float16 [", q.size(0), ", Hkv, ", q.size(3),
              "] with a contiguous last dim, got ", k_absmax.scalar_type(), " ", k_absmax.sizes());
  KeyRuleArgs a;
  a.B = q.size(0);
  a.H = k_absmax.size(1);
  a.D = int(q.size(3));
  TORCH_CHECK(a.H > 0 && q.size(1) % a.H == 0, "key_widths: ", q.size(1), " query heads cannot share ", a.H,
              " KV heads evenly");
  a.q = q.data_ptr<float>();
  a.qb = q.stride(0);
  a.qh = q.stride(1);
  a.qt = q.stride(2);
  a.g = q.size(1) / a.H;
  a.Q = q.size(2);
  a.k_absmax = reinterpret_cast<const uint16_t*>(k_absmax.data_ptr<at::Half>());
  a.kab_b = k_absmax.stride(0);
  a.kab_h = k_absmax.stride(1);
  if (k_exp.has_value()) {
    a.k_exp = plane(*k_exp, "k_exp", a.B, a.H, {a.D});
    a.per_block = true;
    a.nb = k_exp->size(2);
  }
  a.t12 = float(t12);
  a.t8 = float(t8);
  return planes_key_widths(a);
}

namespace {
kvq::AnyWidths any_widths(const at::Tensor& w, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kByte || w.scalar_type() == at::kInt, "width_counts: ", name,
              " must be uint8 or int32, got ", w.scalar_type());
  kvq::AnyWidths a;
  a.p = static_cast<const uint8_t*>(w.data_ptr());
  a.i32 = w.scalar_type() == at::kInt;
  for (int64_t i = 0; i < w.dim(); ++i) a.s[i] = w.stride(i);
  return a;
}
}  // namespace

at::Tensor width_counts(const at::Tensor& wk, const at::Tensor& wv, int64_t first, int64_t n_full) {
  using namespace kvq;
  TORCH_CHECK((wk.dim() == 3 || wk.dim() == 4) && wv.dim() == 3 && wv.size(0) == wk.size(0) &&
                  wv.size(1) == wk.size(1),
              "width_counts: wk must be [B, H, D] or [B, H, nb, D] and wv [B, H, n], got ", wk.sizes(), " and ",
              wv.sizes());
  WidthCountArgs a;
  a.wk = any_widths(wk, "wk");
  a.wv = any_widths(wv, "wv");
  a.B = wk.size(0);
  a.H = wk.size(1);
  a.per_block = wk.dim() == 4;
  a.nbk = a.per_block ? wk.size(2) : 1;
  a.D = wk.size(wk.dim() - 1);
  if (!a.per_block) {  // read as [B, H, 1, D]
    a.wk.s[3] = a.wk.s[2];
    a.wk.s[2] = 0;
  }
  a.nv = wv.size(2);
  a.first = first;
  a.n_full = n_full;
  return planes_width_counts(a);
}

at::Tensor attend_gear(const at::Tensor& q, const Opt& k_codes, const Opt& k_scale, const Opt& k_zero,
                       const at::Tensor& k_window, const Opt& k_index, const Opt& k_value,
                       const std::vector<int64_t>& k_starts, const std::vector<int64_t>& k_lens,
                       const std::vector<at::Tensor>& k_a, const std::vector<at::Tensor>& k_b, const Opt& v_codes,
                       const Opt& v_scale, const Opt& v_zero, const at::Tensor& v_window, const Opt& v_index,
                       const Opt& v_value, const std::vector<int64_t>& v_starts, const std::vector<int64_t>& v_lens,
                       const std::vector<at::Tensor>& v_a, const std::vector<at::Tensor>& v_b, int64_t bits,
                       int64_t group_size, const Opt& mask, bool causal, double scaling) {
  using namespace kvq;
  TORCH_CHECK(bits == 2 || bits == 4, "gear: bits must be 2 or 4, got ", bits);
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1");
  TORCH_CHECK(k_window.dim() == 4 && v_window.dim() == 4, "windows must be [B, Hkv, W, D]");
  const int64_t B = q.size(0), Hkv = k_window.size(1), D = q.size(3);
  GearStream k, v;
  k.q = quant_part(k_codes, k_scale, k_zero, "k", B, Hkv, D, int(bits), group_size, true);
  v.q = quant_part(v_codes, v_scale, v_zero, "v", B, Hkv, D, int(bits), group_size, false);
  const int64_t L = k.q.n + k_window.size(2);
  TORCH_CHECK(v.q.n + v_window.size(2) == L, "keys cover ", L, " tokens but values ", v.q.n + v_window.size(2));
  Problem P = problem(q, Hkv, L, mask, causal, scaling);
  k.window = half4(k_window, "k_window", B, Hkv, D);
  v.window = half4(v_window, "v_window", B, Hkv, D);
  k.runs = runs(k_starts, k_lens, k_a, k_b, "k", B, Hkv, D, k.q.n);
  v.runs = runs(v_starts, v_lens, v_a, v_b, "v", B, Hkv, D, v.q.n);
  outliers(k, k_index, k_value, "k", B, Hkv);
  outliers(v, v_index, v_value, "v", B, Hkv);
  return gear_attention(k, v, int(group_size), int(bits), P);
}

namespace kvq {

// A float32 tensor of the given shape with contiguous storage.
const float* floats(const at::Tensor& t, const char* name, std::vector<int64_t> shape) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.sizes() == at::IntArrayRef(shape) && t.is_contiguous(), name,
              " must be a contiguous float32 tensor of shape ", shape, ", got ", t.scalar_type(), " ", t.sizes());
  return t.data_ptr<float>();
}

int64_t packed_bytes(int64_t n, int bits) {  // kvquant.quant.bitpack.packed_size
  const int per = 8 / std::gcd(bits, 8);
  return (n + per - 1) / per * (bits * per / 8);
}

}  // namespace kvq

namespace kvq {

// What HIGGS and AQUA-KV attention share: how RoPE is re-applied to the coded keys (cos/sin tables, or
// int32 positions with inv_freq), and the fp16 sinks and window around them.
template <class Args>
void set_rope(Args& a, const char* what, int64_t B, int64_t D, const Opt& cos, const Opt& sin, const Opt& positions,
              const Opt& inv_freq, double rope_scale) {
  if (cos.has_value()) {
    for (const auto& [t, name] : {std::pair{&*cos, "cos"}, std::pair{&*sin, "sin"}})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == B && t->size(1) == a.nc &&
                      t->size(2) == D && t->stride(2) == 1,
                  what, ": ", name, " must be float32 [", B, ", ", a.nc, ", ", D,
                  "] with a contiguous last dim, got ", t->scalar_type(), " ", t->sizes());
    a.cos = cos->data_ptr<float>();
    a.cb = cos->stride(0);
    a.ct = cos->stride(1);
    a.sin = sin->data_ptr<float>();
    a.sb = sin->stride(0);
    a.st = sin->stride(1);
    return;
  }
  const at::Tensor& p = *positions;
  TORCH_CHECK(p.scalar_type() == at::kInt && p.dim() == 2 && p.size(0) == B && p.size(1) == a.nc, what,
              ": positions must be int32 [", B, ", ", a.nc, "], got ", p.scalar_type(), " ", p.sizes());
  a.pos = p.data_ptr<int32_t>();
  a.pb = p.stride(0);
  a.pt = p.stride(1);
  a.inv_freq = floats(*inv_freq, "inv_freq", {D / 2});
  a.rope_scale = float(rope_scale);
}

template <class Args>
void set_windows(Args& a, const char* what, int64_t B, int64_t Hkv, int64_t D, const Opt& k_sinks,
                 const Opt& v_sinks, const at::Tensor& k_recent, const at::Tensor& v_recent) {
  TORCH_CHECK(k_sinks.has_value() == v_sinks.has_value(), what, ": give key and value sinks, or neither");
  if (k_sinks.has_value()) {
    a.ns = k_sinks->size(2);
    TORCH_CHECK(v_sinks->dim() == 4 && v_sinks->size(2) == a.ns, what, ": key and value sinks must hold the same tokens");
    a.sink_k = half4(*k_sinks, "k_sinks", B, Hkv, D);
    a.sink_v = half4(*v_sinks, "v_sinks", B, Hkv, D);
  }
  a.nr = k_recent.size(2);
  TORCH_CHECK(v_recent.size(2) == a.nr, what, ": key and value windows must hold the same tokens");
  a.recent_k = half4(k_recent, "k_recent", B, Hkv, D);
  a.recent_v = half4(v_recent, "v_recent", B, Hkv, D);
}

}  // namespace kvq

at::Tensor attend_higgs(const at::Tensor& q, const Opt& k_codes, const Opt& k_scales, const Opt& v_codes,
                        const Opt& v_scales, const Opt& cos, const Opt& sin, const Opt& positions,
                        const Opt& inv_freq, double rope_scale, bool post_rope, int64_t rotated,
                        const Opt& k_sinks, const Opt& v_sinks,
                        const at::Tensor& k_recent, const at::Tensor& v_recent, const at::Tensor& grid,
                        const at::Tensor& signs, const at::Tensor& outer, int64_t code_bits, int64_t group,
                        const Opt& mask, bool causal, double scaling) {
  using namespace kvq;
  TORCH_CHECK(code_bits == 4 || code_bits == 6 || code_bits == 8, "higgs: code_bits must be 4, 6 or 8, got ",
              code_bits);
  TORCH_CHECK(k_recent.dim() == 4 && v_recent.dim() == 4, "higgs: recent windows must be [B, Hkv, T, D]");
  const int64_t B = q.size(0), Hkv = k_recent.size(1), D = q.size(3);
  TORCH_CHECK(D % 2 == 0, "higgs: RoPE needs an even head_dim, got ", D);
  TORCH_CHECK(group >= 1 && group % D == 0, "higgs: the kernel needs groups of whole heads: group ", group,
              " is not a multiple of head_dim ", D);
  HiggsArgs a;
  a.bits = int(code_bits);
  a.group = int(group);
  a.heads_per_group = group / D;
  TORCH_CHECK(signs.dim() == 1, "higgs: signs must be [P]");
  a.P = int(signs.size(0));
  a.signs = floats(signs, "signs", {a.P});
  TORCH_CHECK(outer.dim() == 2, "higgs: outer must be [m, m]");
  a.m = int(outer.size(0));
  a.outer = floats(outer, "outer", {a.m, a.m});
  TORCH_CHECK(a.P >= group && a.P % a.m == 0 && a.P % 2 == 0, "higgs: padded group ", a.P, " must be even, >= group ",
              group, " and a multiple of the outer factor's order ", a.m);
  a.p = a.P / a.m;
  TORCH_CHECK((a.p & (a.p - 1)) == 0, "higgs: P / m = ", a.p, " must be a power of two");
  a.grid = floats(grid, "grid", {int64_t(1) << code_bits, 2});
  const int64_t groups = (Hkv * D + group - 1) / group;
  const bool coded = k_codes.has_value();
  const bool tables = cos.has_value() || sin.has_value();
  TORCH_CHECK(coded == k_scales.has_value() && coded == v_codes.has_value() && coded == v_scales.has_value() &&
                  (!coded || (post_rope ? !(tables || positions.has_value()) : tables != positions.has_value())) &&
                  tables == (cos.has_value() && sin.has_value()) &&
                  positions.has_value() == inv_freq.has_value() && (coded || !(tables || positions.has_value())),
              "higgs: give codes and scales for keys and values with cos/sin or positions/inv_freq (neither for keys "
              "coded after RoPE), or none of them");
  a.post_rope = post_rope;
  TORCH_CHECK(rotated >= -1 && rotated <= 1, "higgs: rotated must be -1 (auto), 0 or 1, got ", rotated);
  a.rotated = int(rotated);
  if (coded) {
    const int64_t nbytes = packed_bytes(groups * a.P / 2, a.bits);
    a.nc = k_codes->size(1);
    for (const auto& [c, s, name] : {std::tuple{&*k_codes, &*k_scales, "k"}, std::tuple{&*v_codes, &*v_scales, "v"}}) {
      TORCH_CHECK(c->scalar_type() == at::kByte && c->dim() == 3 && c->size(0) == B && c->size(1) == a.nc &&
                      c->size(2) == nbytes && c->stride(2) == 1,
                  "higgs: ", name, "_codes must be uint8 [", B, ", ", a.nc, ", ", nbytes,
                  "] with a contiguous last dim, got ", c->scalar_type(), " ", c->sizes());
      TORCH_CHECK(s->scalar_type() == at::kHalf && s->dim() == 3 && s->size(0) == B && s->size(1) == a.nc &&
                      s->size(2) == groups && s->stride(2) == 1,
                  "higgs: ", name, "_scales must be float16 [", B, ", ", a.nc, ", ", groups,
                  "] with a contiguous last dim, got ", s->scalar_type(), " ", s->sizes());
    }
    a.kc = k_codes->data_ptr<uint8_t>();
    a.kcb = k_codes->stride(0);
    a.kct = k_codes->stride(1);
    a.vc = v_codes->data_ptr<uint8_t>();
    a.vcb = v_codes->stride(0);
    a.vct = v_codes->stride(1);
    a.ks = half_ptr(*k_scales);
    a.ksb = k_scales->stride(0);
    a.kst = k_scales->stride(1);
    a.vs = half_ptr(*v_scales);
    a.vsb = v_scales->stride(0);
    a.vst = v_scales->stride(1);
    if (tables || !post_rope) set_rope(a, "higgs", B, D, cos, sin, positions, inv_freq, rope_scale);
  }
  set_windows(a, "higgs", B, Hkv, D, k_sinks, v_sinks, k_recent, v_recent);
  Problem P = problem(q, Hkv, a.ns + a.nc + a.nr, mask, causal, scaling);
  return higgs_attention(a, P);
}

namespace kvq {

// A HIGGS quantizer's tensors and one side's codes/scales [B, n, *] over rows of `channels` values.
HiggsRowsArgs higgs_quantizer(const at::Tensor& grid, const at::Tensor& signs, const at::Tensor& outer,
                              int64_t code_bits, int64_t group, int64_t channels) {
  TORCH_CHECK(code_bits == 4 || code_bits == 6 || code_bits == 8, "aquakv: code_bits must be 4, 6 or 8, got ",
              code_bits);
  HiggsRowsArgs c;
  c.bits = int(code_bits);
  c.group = int(group);
  c.channels = channels;
  TORCH_CHECK(group >= 1 && group <= channels, "aquakv: group ", group, " must be in 1..", channels);
  c.groups = (channels + group - 1) / group;
  TORCH_CHECK(signs.dim() == 1 && outer.dim() == 2, "aquakv: signs must be [P], outer [m, m]");
  c.P = int(signs.size(0));
  c.signs = floats(signs, "signs", {c.P});
  c.m = int(outer.size(0));
  c.outer = floats(outer, "outer", {c.m, c.m});
  TORCH_CHECK(c.P >= group && c.P % c.m == 0 && c.P % 2 == 0, "aquakv: padded group ", c.P,
              " must be even, >= group ", group, " and a multiple of the outer factor's order ", c.m);
  c.p = c.P / c.m;
  TORCH_CHECK((c.p & (c.p - 1)) == 0, "aquakv: P / m = ", c.p, " must be a power of two");
  c.grid = floats(grid, "grid", {int64_t(1) << code_bits, 2});
  return c;
}

HiggsRowsArgs higgs_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& grid,
                         const at::Tensor& signs, const at::Tensor& outer, int64_t code_bits, int64_t group,
                         int64_t channels, const char* name) {
  HiggsRowsArgs c = higgs_quantizer(grid, signs, outer, code_bits, group, channels);
  const int64_t nbytes = packed_bytes(c.groups * c.P / 2, c.bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == nbytes && codes.stride(2) == 1,
              "aquakv: ", name, "_codes must be uint8 [B, n, ", nbytes, "] with a contiguous last dim, got ",
              codes.scalar_type(), " ", codes.sizes());
  c.B = codes.size(0);
  c.n = codes.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == c.B &&
                  scales.size(1) == c.n && scales.size(2) == c.groups && scales.stride(2) == 1,
              "aquakv: ", name, "_scales must be float16 [", c.B, ", ", c.n, ", ", c.groups,
              "] with a contiguous last dim, got ", scales.scalar_type(), " ", scales.sizes());
  c.codes = codes.data_ptr<uint8_t>();
  c.cb = codes.stride(0);
  c.ct = codes.stride(1);
  c.scales = half_ptr(scales);
  c.sb = scales.stride(0);
  c.st = scales.stride(1);
  return c;
}

// A float32 [B, n, C] tensor whose rows have a contiguous last dim.
void rows_f32(const at::Tensor& t, const char* name, int64_t B, int64_t n, int64_t C) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == B && t.size(1) == n && t.size(2) == C &&
                  t.stride(2) == 1,
              "aquakv: ", name, " must be float32 [", B, ", ", n, ", ", C, "] with a contiguous last dim, got ",
              t.scalar_type(), " ", t.sizes());
}

}  // namespace kvq

void aquakv_reconstruct(const at::Tensor& k_codes, const at::Tensor& k_scales, const at::Tensor& v_codes,
                        const at::Tensor& v_scales, const at::Tensor& grid, const at::Tensor& signs,
                        const at::Tensor& outer, int64_t code_bits, int64_t group, const Opt& k_weight,
                        const Opt& k_bias, const Opt& v_weight, const Opt& v_bias, const Opt& prev_k,
                        const Opt& prev_v, const at::Tensor& out_k, const at::Tensor& out_v) {
  using namespace kvq;
  TORCH_CHECK(out_k.dim() == 3, "aquakv: out_k must be [B, n, C]");
  const int64_t B = out_k.size(0), n = out_k.size(1), C = out_k.size(2);
  for (const auto& [t, name] : {std::pair{&out_k, "out_k"}, std::pair{&out_v, "out_v"}})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == out_k.sizes(), "aquakv: ", name,
                " must be a contiguous float32 [B, n, C] tensor (as out_k), got ", t->scalar_type(), " ", t->sizes());
  HiggsRowsArgs kr = higgs_rows(k_codes, k_scales, grid, signs, outer, code_bits, group, C, "k");
  HiggsRowsArgs vr = higgs_rows(v_codes, v_scales, grid, signs, outer, code_bits, group, C, "v");
  TORCH_CHECK(kr.B == B && kr.n == n && vr.B == B && vr.n == n, "aquakv: codes hold [", kr.B, ", ", kr.n,
              "] rows, the outputs [", B, ", ", n, "]");
  TORCH_CHECK(k_weight.has_value() == k_bias.has_value() && v_weight.has_value() == v_bias.has_value(),
              "aquakv: give each predictor's weight and bias, or neither");
  TORCH_CHECK(k_weight.has_value() == prev_k.has_value() && v_weight.has_value() == prev_v.has_value(),
              "aquakv: prev_k (prev_v) goes with the key (value) predictor, and only with it");
  if (k_weight.has_value()) {
    floats(*k_weight, "k_weight", {C, C});
    kr.bias = floats(*k_bias, "k_bias", {C});
    rows_f32(*prev_k, "prev_k", B, n, C);
  }
  if (v_weight.has_value()) {
    floats(*v_weight, "v_weight", {2 * C, C});
    vr.bias = floats(*v_bias, "v_bias", {C});
    rows_f32(*prev_v, "prev_v", B, n, C);
  }
  if (n == 0) return;
  // residual + bias straight into the workspace, then the predictions added in place
  higgs_decode_rows(kr, out_k.data_ptr<float>());
  const at::Tensor k2 = out_k.view({B * n, C});
  if (k_weight.has_value()) k2.addmm_(prev_k->reshape({B * n, C}), *k_weight);
  higgs_decode_rows(vr, out_v.data_ptr<float>());
  if (v_weight.has_value()) {
    const at::Tensor v2 = out_v.view({B * n, C});
    v2.addmm_(k2, v_weight->narrow(0, 0, C));
    v2.addmm_(prev_v->reshape({B * n, C}), v_weight->narrow(0, C, C));
  }
}

std::vector<at::Tensor> aquakv_encode(const at::Tensor& k, const at::Tensor& v, const at::Tensor& grid,
                                      const at::Tensor& signs, const at::Tensor& outer, int64_t code_bits,
                                      int64_t group, const Opt& k_weight, const Opt& k_bias, const Opt& v_weight,
                                      const Opt& v_bias, const Opt& prev_k, const Opt& prev_v) {
  using namespace kvq;
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "aquakv: k and v must be [B, m, C] alike, got ", k.sizes(),
              " and ", v.sizes());
  const int64_t B = k.size(0), m = k.size(1), C = k.size(2);
  rows_f32(k, "k", B, m, C);
  rows_f32(v, "v", B, m, C);
  HiggsRowsArgs c = higgs_quantizer(grid, signs, outer, code_bits, group, C);
  c.B = B;
  c.n = m;
  const int64_t nbytes = packed_bytes(c.groups * c.P / 2, c.bits);
  TORCH_CHECK(k_weight.has_value() == k_bias.has_value() && v_weight.has_value() == v_bias.has_value() &&
                  k_weight.has_value() == prev_k.has_value() && v_weight.has_value() == prev_v.has_value(),
              "aquakv: give each predictor's weight, bias and previous rows, or none of them");
  if (k_weight.has_value()) {
    floats(*k_weight, "k_weight", {C, C});
    floats(*k_bias, "k_bias", {C});
    rows_f32(*prev_k, "prev_k", B, m, C);
  }
  if (v_weight.has_value()) {
    floats(*v_weight, "v_weight", {2 * C, C});
    floats(*v_bias, "v_bias", {C});
    rows_f32(*prev_v, "prev_v", B, m, C);
  }
  auto encode = [&](const at::Tensor& x) {
    const at::Tensor xc = x.contiguous();
    at::Tensor codes = at::empty({B, m, nbytes}, at::kByte);
    at::Tensor scales = at::empty({B, m, c.groups}, at::kHalf);
    higgs_encode_rows(c, xc.data_ptr<float>(), codes.data_ptr<uint8_t>(), nbytes,
                      reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>()));
    return std::pair{codes, scales};
  };
  // keys: Q(k - pred_k(prev_k)); values: Q(v - pred_v([pred_k + deQ(key codes), prev_v])) (predictors.encode_pair)
  at::Tensor pk;
  if (k_weight.has_value()) pk = at::addmm(*k_bias, prev_k->reshape({B * m, C}), *k_weight).view({B, m, C});
  const auto [kc, ks] = encode(pk.defined() ? k - pk : k);
  at::Tensor resid_v = v;
  if (v_weight.has_value()) {
    at::Tensor rk = at::empty({B, m, C}, at::kFloat);
    HiggsRowsArgs d = c;
    d.codes = kc.data_ptr<uint8_t>();
    d.cb = m * nbytes;
    d.ct = nbytes;
    d.scales = reinterpret_cast<const uint16_t*>(ks.data_ptr<at::Half>());
    d.sb = m * c.groups;
    d.st = c.groups;
    higgs_decode_rows(d, rk.data_ptr<float>());
    if (pk.defined()) rk.add_(pk);
    at::Tensor pv = at::addmm(*v_bias, rk.view({B * m, C}), v_weight->narrow(0, 0, C));
    pv.addmm_(prev_v->reshape({B * m, C}), v_weight->narrow(0, C, C));
    resid_v = v - pv.view({B, m, C});
  }
  const auto [vc, vs] = encode(resid_v);
  return {kc, ks, vc, vs};
}

at::Tensor attend_aquakv(const at::Tensor& q, const Opt& k_rows, const Opt& v_rows, const Opt& cos, const Opt& sin,
                         const Opt& positions, const Opt& inv_freq, double rope_scale, const Opt& k_sinks,
                         const Opt& v_sinks, const at::Tensor& k_recent, const at::Tensor& v_recent, const Opt& mask,
                         bool causal, double scaling) {
  using namespace kvq;
  TORCH_CHECK(k_recent.dim() == 4 && v_recent.dim() == 4, "aquakv: recent windows must be [B, Hkv, T, D]");
  const int64_t B = q.size(0), Hkv = k_recent.size(1), D = q.size(3);
  TORCH_CHECK(D % 2 == 0, "aquakv: RoPE needs an even head_dim, got ", D);
  AquaArgs a;
  const bool rows = k_rows.has_value();
  const bool tables = cos.has_value() || sin.has_value();
  TORCH_CHECK(rows == v_rows.has_value() && (!rows || tables != positions.has_value()) &&
                  tables == (cos.has_value() && sin.has_value()) && positions.has_value() == inv_freq.has_value() &&
                  (rows || !(tables || positions.has_value())),
              "aquakv: give key and value rows with cos/sin or positions/inv_freq, or none of them");
  if (rows) {
    a.nc = k_rows->size(1);
    rows_f32(*k_rows, "k_rows", B, a.nc, Hkv * D);
    rows_f32(*v_rows, "v_rows", B, a.nc, Hkv * D);
    a.k = k_rows->data_ptr<float>();
    a.kb = k_rows->stride(0);
    a.kt = k_rows->stride(1);
    a.v = v_rows->data_ptr<float>();
    a.vb = v_rows->stride(0);
    a.vt = v_rows->stride(1);
    set_rope(a, "aquakv", B, D, cos, sin, positions, inv_freq, rope_scale);
  }
  set_windows(a, "aquakv", B, Hkv, D, k_sinks, v_sinks, k_recent, v_recent);
  Problem P = problem(q, Hkv, a.ns + a.nc + a.nr, mask, causal, scaling);
  return aquakv_attention(a, P);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_higgs", &attend_higgs, "fused attention over a HIGGS store (codes, sinks, recent window)");
  m.def("aquakv_reconstruct", &aquakv_reconstruct,
        "an AQUA-KV layer's keys and values, pred + deHIGGS(codes), into given fp32 [B, n, C] buffers");
  m.def("aquakv_encode", &aquakv_encode, "HIGGS codes of an AQUA-KV layer's new rows (the predictors' residuals)");
  m.def("attend_aquakv", &attend_aquakv, "fused attention over an AQUA-KV layer's reconstructed rows, sinks and window");
  m.def("attend_fp16", &attend_fp16, "fused attention over fp16 K/V");
  m.def("attend_kivi", &attend_kivi, "fused attention over a KIVI store");
  m.def("attend_gear", &attend_gear, "fused attention over a GEAR store");
  m.def("attend_planes", &attend_planes, "fused attention over AlignedKV's planes at given widths");
  m.def("attend_aligned", &attend_aligned, "AlignedKV's value rule in fp64 and attention at its widths, one call");
  m.def("aligned_rule_counts", &kvq::aligned_rule_counts,
        "items decided from fp32 / fp64 scores, fp32 ones that rescored some keys in fp64 first, and value units "
        "settled from v_exp_max");
  m.def("exponent_gaps", &exponent_gaps, "min over channels of e_o - the exponent field of plane A, per token");
  m.def("key_widths", &key_widths, "AlignedKV's key rule for one step (per column, or per block with k_exp), uint8");
  m.def("width_counts", &width_counts, "per KV head counts of the widths read in a window, int64 [2, H, 3]");
  m.def("read_plane_keys", &read_plane_keys, "AlignedKV's keys read at given widths, as fp32 [B, Hkv, L, D]");
  m.attr("avx512") = bool(KVQ_AVX512);
}
