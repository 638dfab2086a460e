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
#include "bits.h"
#include "kernels.h"

namespace kvq {

namespace {

constexpr int KB = 64;  // tokens per key block (kvquant.alignment.BLOCK)
constexpr int PFB = 2;  // key blocks prefetched ahead (PF tokens)

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
// channel: the widths of a head vary from channel to channel in no pattern a predictor learns.
struct KeyChannels {
  const uint8_t* widths = nullptr;  // the widths row these lists were made from
  int16_t list[3][DMAX];
  int count[3] = {0, 0, 0};
  void build(const uint8_t* w, int64_t wc, int D) {
    if (w == widths) return;  // per-column widths: one row for every block of the head
    widths = w;
    count[0] = count[1] = count[2] = 0;
    for (int c = 0; c < D; ++c) {
      const int k = (w[c * wc] - 8) / 4;  // 8, 12, 16 -> 0, 1, 2 (checked when the call was made)
      list[k][count[k]++] = int16_t(c);
    }
  }
};

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

template <int NC>
struct PlanesFormat : NoTerms {
  static constexpr bool channel_major_keys = true;
  PlaneArgs s;
  struct State {
    KeyChannels channels;
  };
  State state(const Problem&) const { return {}; }

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

// Rows in[i*W ...] (i < 16) transposed into out[t*ld ...], the first n lanes of each (16x16 floats).
inline void transpose16(const float* in, int n, float* out, int64_t ld) {
#if KVQ_AVX512
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(in + i * W);
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
#else
  for (int c = 0; c < W; ++c)
    for (int i = 0; i < n; ++i) out[c * ld + i] = in[i * W + c];
#endif
}

// One block's keys, read at their widths, into rows out[t * D + c] (fp32): channel-major vectors of
// 16 tokens through a small buffer, transposed 16 channels at a time.
template <bool TINY>
void read_key_block(const PlaneArgs& s, int64_t b, int64_t h, int64_t j, int D, float* out) {
  alignas(64) float buf[DMAX * W];
  KeyChannels ch;
  ch.build(s.kw.at(b, h, j), s.kw_c, D);
  for (int o = 0; o < KB; o += W) {
    key_group<TINY>(ch, s.ka.at(b, h, j) + o, s.kb.at(b, h, j) + o / 2, s.kc.at(b, h, j) + o / 2, W, buf);
    for (int c = 0; c < D; c += W) transpose16(buf + c * W, std::min(W, D - c), out + o * D + c, D);
  }
}

}  // namespace

at::Tensor planes_attention(const PlaneArgs& a, const Problem& P) {
  return dispatch_nc(P.D, [&]<int NC>() { return attend<NC>(PlanesFormat<NC>{{}, a}, P); });
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

}  // namespace kvq
