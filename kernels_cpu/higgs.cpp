// HIGGS stores (the higgs method: kvquant.quant.higgs codes in an AquaKVLayer without predictors).
//
// A token's codes cover the whole row of Hkv*D channels, cut into groups of `group` channels (each
// zero-padded to P, rotated by kron(H_m, S_p)/sqrt(P) after random signs, one fp16 scale per group).
// The rotation mixes every head of a group, so a work item is (batch row, group, tile of the query
// rows that read the group's KV heads, chunk of keys), and each token's codes are read once per tile
// for all of its heads:
// - keys (stored before RoPE): per token, grid lookup, the inverse rotation of the group (fast
//   transform on the S_p axis, the dense H_m mix), signs, scale and RoPE in one pass into the small
//   per-head key buffer the driver's dot_rows reads; nothing else is written. RoPE's cos/sin come
//   from the position (a vector sincos per token, 4 bytes read) where the rotary module is that
//   formula, else from the tables the torch path uses (8*D bytes per token). Keys coded after RoPE
//   (higgs_post_rope) need no RoPE, so they can be scored in the rotated domain instead:
//   q . k = s * (R^T (signs * q)) . y / sqrt(P), each row's query rotated once per tile, then P
//   multiply-adds per row and token and no inverse rotation per token. That wins unless a group has
//   many query rows (rotated_is_cheaper); otherwise keys are rebuilt as before, signs and scale only
//   (HiggsArgs::rotated: -1 picks by that estimate, 0/1 force);
// - values: the rotation is linear, so sum_t p_t v_t = signs * H (sum_t p_t s_t y_t) / sqrt(P):
//   each row accumulates p*s*y in the rotated domain (P floats) and the inverse rotation runs once
//   per query row after the chunks are merged, never per token.
// The fp16 sinks and recent window are read per head as the fp16 kernel reads them.
#include "higgs.h"
#include "kernels.h"

namespace kvq {

namespace {

struct HeadSpan {  // rows [r0, r0 + n) of a tile read KV head kvh, the group's head hl
  int64_t kvh = 0;
  int hl = 0, r0 = 0, n = 0;
  Rows rows;  // those rows alone, for dot_rows
};

struct Tile {
  int64_t b = 0, gi = 0, r0 = 0;  // r0: first row among the group's rows (query head major, then position)
  int n = 0;
};

struct HiggsPlan {
  std::vector<Tile> tiles;
  int64_t nchunk = 1, chunk_len = 0, stride = 0, hpg = 1;
  int threads = 1;

  HiggsPlan(const HiggsArgs& a, const Problem& P) {
    hpg = a.heads_per_group;
    const int64_t groups = (P.Hkv + hpg - 1) / hpg;
    for (int64_t b = 0; b < P.B; ++b)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t rows = std::min(hpg, P.Hkv - gi * hpg) * P.g * P.Q;
        const int64_t nt = (rows + NRMAX - 1) / NRMAX, base = rows / nt, extra = rows % nt;
        for (int64_t t = 0; t < nt; ++t)
          tiles.push_back({b, gi, t * base + std::min(t, extra), int(base + (t < extra ? 1 : 0))});
      }
    const int64_t items = int64_t(tiles.size());
    threads = at::get_num_threads();
    if (items * P.L < Plan::SMALL) threads = 1;
    if (threads > 1) {
      const int64_t want = (8 * threads + items - 1) / items;
      nchunk = std::max<int64_t>(1, std::min<int64_t>(want, P.L / (4 * BT)));
    }
    chunk_len = ((P.L + nchunk - 1) / nchunk + BT - 1) / BT * BT;
    nchunk = (P.L + chunk_len - 1) / chunk_len;
    stride = NRMAX * (2 + P.D + a.P);
  }

  // The tile's rows (R) and the spans of rows that share a KV head.
  Rows rows(const Problem& P, const Tile& t, std::vector<HeadSpan>& spans) const {
    Rows R;
    R.n = t.n;
    spans.clear();
    const int64_t qh0 = t.gi * hpg * P.g;
    for (int r = 0; r < t.n; ++r) {
      const int64_t rr = t.r0 + r, qh = qh0 + rr / P.Q, i = rr % P.Q, kvh = qh / P.g;
      R.q[r] = P.q + t.b * P.qb + qh * P.qh + i * P.qt;
      R.mask_off[r] = t.b * P.mb + qh * P.mh + i * P.mq;
      R.limit[r] = P.causal ? P.L - P.Q + i + 1 : P.L;
      if (spans.empty() || spans.back().kvh != kvh) {
        HeadSpan s;
        s.kvh = kvh;
        s.hl = int(kvh - t.gi * hpg);
        s.r0 = r;
        spans.push_back(s);
      }
      HeadSpan& s = spans.back();
      s.rows.q[s.n] = R.q[r];
      s.rows.n = ++s.n;
    }
    return R;
  }
};


// Post-RoPE key of one head from its rotated-back channels g (before signs and scale): dst[0, D),
// lanes up to NC*W zeroed for dot_rows.
inline void rope_key(const float* g, const float* sg, float scale, const float* cs, const float* sn, int D, int width,
                     float* dst) {
  const int h = D / 2;
  const vf sv = set1(scale);
  for (int l = 0; l < h; l += W) {
    const mk m = lanes(h - l);
    const vf a = mul(mul(load(g + l, m), load(sg + l, m)), sv), b = mul(mul(load(g + h + l, m), load(sg + h + l, m)), sv);
    store(dst + l, sub(mul(a, load(cs + l, m)), mul(b, load(sn + l, m))), m);
    store(dst + h + l, add(mul(b, load(cs + h + l, m)), mul(a, load(sn + h + l, m))), m);
  }
  std::fill(dst + D, dst + width, 0.0f);
}

// Key of one head from its rotated-back channels g, coded after RoPE: signs and scale only.
inline void plain_key(const float* g, const float* sg, float scale, int D, int width, float* dst) {
  const vf sv = set1(scale);
  for (int l = 0; l < D; l += W) {
    const mk m = lanes(D - l);
    store(dst + l, mul(mul(load(g + l, m), load(sg + l, m)), sv), m);
  }
  std::fill(dst + D, dst + width, 0.0f);
}

// Which way to score post-RoPE codes: true for the rotated domain (rows * P multiply-adds per token,
// streaming) over rebuilding keys (the inverse rotation, P log2 p butterflies + m P, then rows * D).
// The rebuild's operations cost about 3x a streaming multiply-add: on a Zen 1 core
// (scripts/bench_kernels_cpu.py --higgs) the rotated domain was 1.45-1.57x faster at 9q/3kv x 64 and
// 32 x 128 and 1.2x at 32q/8kv x 128, where rows * P is 2.3x the rebuild's count.
inline bool rotated_is_cheaper(int rows, int D, const Rotation& r) {
  int log2p = 0;
  while ((1 << log2p) < r.p) ++log2p;
  const int64_t mix = r.m > 1 ? int64_t(r.m) * r.P : 0;
  return int64_t(rows) * r.P <= 3 * (int64_t(r.P) * log2p + mix + int64_t(rows) * D);
}

// Rotated-domain scores of k coded tokens: d[r * BT + j] = sc[j] * (qt_r . y_j) for the tile's rows,
// qt [rows, P] the rotated queries, y [k, P] the tokens' grid points; four rows share each load of y.
inline void rotated_scores(const float* qt, int rows, const float* y, const float* sc, int k, int PP, float* d) {
  for (int j = 0; j < k; ++j) {
    const float* yj = y + size_t(j) * PP;
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
      const float* q0 = qt + size_t(r) * PP;
      vf a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero();
      for (int c = 0; c < PP; c += W) {
        const mk m = lanes(PP - c);
        const vf yv = load(yj + c, m);
        a0 = fma(load(q0 + c, m), yv, a0);
        a1 = fma(load(q0 + PP + c, m), yv, a1);
        a2 = fma(load(q0 + 2 * PP + c, m), yv, a2);
        a3 = fma(load(q0 + 3 * PP + c, m), yv, a3);
      }
      d[r * BT + j] = sc[j] * hsum(a0);
      d[(r + 1) * BT + j] = sc[j] * hsum(a1);
      d[(r + 2) * BT + j] = sc[j] * hsum(a2);
      d[(r + 3) * BT + j] = sc[j] * hsum(a3);
    }
    for (; r < rows; ++r) {
      const float* qr = qt + size_t(r) * PP;
      vf a = zero();
      for (int c = 0; c < PP; c += W) {
        const mk m = lanes(PP - c);
        a = fma(load(qr + c, m), load(yj + c, m), a);
      }
      d[r * BT + j] = sc[j] * hsum(a);
    }
  }
}

// Keys [tb, te) for one tile; writes m, l, the plain accumulator (D) and the rotated one (P) per row.
template <int NC, int BITS>
void run_tile(const HiggsArgs& a, const Problem& P, const Tile& tile, const Rows& R, const std::vector<HeadSpan>& spans,
              int64_t tb, int64_t te, float* out) {
  constexpr int NCW = NC * W;
  alignas(64) float s[NRMAX * BT];
  alignas(64) float d[NRMAX * BT];
  alignas(64) float acc[NRMAX * DMAX];
  alignas(64) float buf[SB * NCW];
  alignas(64) float cbuf[DMAX], sbuf[DMAX];
  float m[NRMAX], l[NRMAX], sc[SB];
  const int D = P.D, PP = a.P, half = PP / 2, ns = int(spans.size());
  const int64_t b = tile.b, gi = tile.gi, code0 = a.ns, code1 = a.ns + a.nc;
  const Rotation rot{a.outer, a.m, a.p, PP};
  const float inv_sqrt = 1.0f / std::sqrt(float(PP));
  std::vector<float> racc(size_t(R.n) * PP, 0.0f);  // rows' rotated-domain value sums
  std::vector<float> keys(size_t(ns) * SB * NCW);   // post-RoPE keys of the tile's heads, SB tokens
  std::vector<float> y(size_t(SB) * PP), tmp(PP);
  // Post-RoPE codes scored in the rotated domain: each row's query (signs applied, at its head's
  // channels of the group, zeros elsewhere) rotated forward once for the tile.
  const bool rotated = a.post_rope && a.nc > 0 && (a.rotated < 0 ? rotated_is_cheaper(R.n, D, rot) : a.rotated == 1);
  std::vector<float> qt(rotated ? size_t(R.n) * PP : 0, 0.0f);
  if (rotated) {
    for (const HeadSpan& hs : spans) {
      const int c0 = hs.hl * D;
      for (int r = hs.r0; r < hs.r0 + hs.n; ++r) {
        float* x = qt.data() + size_t(r) * PP;
        for (int c = 0; c < D; ++c) x[c0 + c] = R.q[r][c] * a.signs[c0 + c];
        rotate_forward(x, tmp.data(), rot);
      }
    }
  }
  for (int r = 0; r < R.n; ++r) {
    m[r] = NEG_INF;
    l[r] = 0.0f;
    std::fill(acc + r * DMAX, acc + r * DMAX + NCW, 0.0f);
  }
  // The three parts along the keys: fp16 sinks [0, code0), codes [code0, code1), fp16 recent [code1, L).
  auto piece = [&](int64_t t, int k) -> int {  // at most k keys from t on, all in t's part
    if (t < code0) return int(std::min<int64_t>(k, code0 - t));
    return t < code1 ? int(std::min<int64_t>(k, code1 - t)) : k;
  };
  auto fp16_part = [&](int64_t t, bool key) -> std::pair<const Half4*, int64_t> {
    if (t < code0) return {key ? &a.sink_k : &a.sink_v, t};
    return {key ? &a.recent_k : &a.recent_v, t - code1};
  };
  for (int64_t t0 = tb; t0 < te; t0 += BT) {
    const int n = int(std::min<int64_t>(BT, te - t0));
    if (!mask_block(P, R, t0, n, s)) continue;
    for (int i = 0; i < n;) {
      const int64_t t = t0 + i;
      const int k = piece(t, std::min(SB, n - i));
      if (t >= code0 && t < code1 && rotated) {
        for (int j = 0; j < k; ++j) {
          const int64_t ci = t - code0 + j;
          lookup<BITS>(a.kc + b * a.kcb + ci * a.kct, gi * half, half, a.grid, y.data() + j * PP);
          sc[j] = half_to_float(a.ks[b * a.ksb + ci * a.kst + gi]) * inv_sqrt;
        }
        rotated_scores(qt.data(), R.n, y.data(), sc, k, PP, d + i);
      } else if (t >= code0 && t < code1) {
        for (int j = 0; j < k; ++j) {
          const int64_t ci = t - code0 + j;
          lookup<BITS>(a.kc + b * a.kcb + ci * a.kct, gi * half, half, a.grid, y.data());
          rotate_back(y.data(), tmp.data(), rot);
          const float scale = half_to_float(a.ks[b * a.ksb + ci * a.kst + gi]) * inv_sqrt;
          if (a.post_rope) {
            for (int h = 0; h < ns; ++h) {
              const int c0 = spans[h].hl * D;
              plain_key(y.data() + c0, a.signs + c0, scale, D, NCW, keys.data() + (h * SB + j) * NCW);
            }
            continue;
          }
          const float* cs = cbuf;
          const float* sn = sbuf;
          if (a.pos != nullptr) {
            rope_row(a.pos[b * a.pb + ci * a.pt], a.inv_freq, a.rope_scale, D, cbuf, sbuf);
          } else {
            cs = a.cos + b * a.cb + ci * a.ct;
            sn = a.sin + b * a.sb + ci * a.st;
          }
          for (int h = 0; h < ns; ++h) {
            const int c0 = spans[h].hl * D;
            rope_key(y.data() + c0, a.signs + c0, scale, cs, sn, D, NCW, keys.data() + (h * SB + j) * NCW);
          }
        }
        for (int h = 0; h < ns; ++h)
          dot_rows<NC>(keys.data() + h * SB * NCW, k, spans[h].rows, D, d + spans[h].r0 * BT + i);
      } else {
        const auto [src, idx] = fp16_part(t, true);
        for (const HeadSpan& hs : spans) {
          half_rows<NC>(src->row(b, hs.kvh, idx), src->st, k, D, buf);
          dot_rows<NC>(buf, k, hs.rows, D, d + hs.r0 * BT + i);
        }
      }
      i += k;
    }
    for (int r = 0; r < R.n; ++r)
      for (int t = 0; t < n; ++t) s[r * BT + t] += P.scaling * d[r * BT + t];
    for (int r = 0; r < R.n; ++r) {
      const float before = m[r];
      softmax_block(s + r * BT, m[r], l[r], acc + r * DMAX, NCW);
      if (before != m[r] && before != NEG_INF) {  // the same rescaling softmax_block applied to acc
        const float alpha = std::exp(before - m[r]);
        float* x = racc.data() + size_t(r) * PP;
        for (int c = 0; c < PP; ++c) x[c] *= alpha;
      }
    }
    for (int i = 0; i < n;) {
      const int64_t t = t0 + i;
      const int k = piece(t, std::min(SB, n - i));
      if (t >= code0 && t < code1) {
        for (int j = 0; j < k; ++j) {
          const int64_t ci = t - code0 + j;
          lookup<BITS>(a.vc + b * a.vcb + ci * a.vct, gi * half, half, a.grid, y.data() + j * PP);
          sc[j] = half_to_float(a.vs[b * a.vsb + ci * a.vst + gi]);
        }
        for (int r = 0; r < R.n; ++r) {
          float w[SB];
          bool any = false;
          for (int j = 0; j < k; ++j) {
            w[j] = s[r * BT + i + j] * sc[j];
            any |= w[j] != 0.0f;
          }
          if (!any) continue;
          float* x = racc.data() + size_t(r) * PP;
          int c = 0;
          for (; c + 4 * W <= PP; c += 4 * W) {  // four chunks at a time: four fma chains per broadcast
            const mk all = lanes(W);
            vf v0 = load(x + c, all), v1 = load(x + c + W, all), v2 = load(x + c + 2 * W, all),
               v3 = load(x + c + 3 * W, all);
            for (int j = 0; j < k; ++j) {
              const vf wj = set1(w[j]);
              const float* yj = y.data() + j * PP + c;
              v0 = fma(wj, load(yj, all), v0);
              v1 = fma(wj, load(yj + W, all), v1);
              v2 = fma(wj, load(yj + 2 * W, all), v2);
              v3 = fma(wj, load(yj + 3 * W, all), v3);
            }
            store(x + c, v0, all);
            store(x + c + W, v1, all);
            store(x + c + 2 * W, v2, all);
            store(x + c + 3 * W, v3, all);
          }
          for (; c < PP; c += W) {
            const mk lm = lanes(PP - c);
            vf v = load(x + c, lm);
            for (int j = 0; j < k; ++j) v = fma(set1(w[j]), load(y.data() + j * PP + c, lm), v);
            store(x + c, v, lm);
          }
        }
      } else {
        const auto [src, idx] = fp16_part(t, false);
        for (const HeadSpan& hs : spans) {
          half_rows<NC>(src->row(b, hs.kvh, idx), src->st, k, D, buf);
          accumulate_rows<NC>(buf, k, hs.n, s + hs.r0 * BT + i, acc + hs.r0 * DMAX);
        }
      }
      i += k;
    }
  }
  for (int r = 0; r < R.n; ++r) {
    float* o = out + r * (2 + D + PP);
    o[0] = m[r];
    o[1] = l[r];
    std::copy(acc + r * DMAX, acc + r * DMAX + D, o + 2);
    std::copy(racc.data() + size_t(r) * PP, racc.data() + size_t(r + 1) * PP, o + 2 + D);
  }
}

// One tile's chunk partials (nchunk of them, stride apart) -> its rows of out [B, Hq, Q, D]:
// log-sum-exp merge of both accumulators, then the rotated one rotated back once per row (signs,
// 1/sqrt(P)) and its head's channels added.
void finish_tile(const HiggsArgs& a, const Problem& P, const HiggsPlan& plan, const Tile& t, const float* part,
                 float* o) {
  const int D = P.D, PP = a.P, row = 2 + D + PP;
  const Rotation rot{a.outer, a.m, a.p, PP};
  const float inv_sqrt = 1.0f / std::sqrt(float(PP));
  std::vector<float> u(PP), tmp(PP);
  const int64_t qh0 = t.gi * plan.hpg * P.g;
  for (int r = 0; r < t.n; ++r) {
    const int64_t rr = t.r0 + r, qh = qh0 + rr / P.Q, i = rr % P.Q;
    float* dst = o + ((t.b * P.Hq + qh) * P.Q + i) * D;
    std::fill(dst, dst + D, 0.0f);
    float mx = NEG_INF;
    for (int64_t c = 0; c < plan.nchunk; ++c) mx = std::max(mx, part[c * plan.stride + r * row]);
    if (mx == NEG_INF) continue;  // a row that sees no key: zeros
    std::fill(u.begin(), u.end(), 0.0f);
    float denom = 0.0f;
    for (int64_t c = 0; c < plan.nchunk; ++c) {
      const float* src = part + c * plan.stride + r * row;
      if (src[0] == NEG_INF) continue;
      const float wgt = std::exp(src[0] - mx);
      denom += wgt * src[1];
      for (int x = 0; x < D; ++x) dst[x] += wgt * src[2 + x];
      for (int x = 0; x < PP; ++x) u[x] += wgt * src[2 + D + x];
    }
    const float inv = 1.0f / denom;
    if (a.nc > 0) {
      rotate_back(u.data(), tmp.data(), rot);
      const int c0 = int(qh / P.g - t.gi * plan.hpg) * D;
      for (int x = 0; x < D; ++x) dst[x] = (dst[x] + u[c0 + x] * a.signs[c0 + x] * inv_sqrt) * inv;
    } else {
      for (int x = 0; x < D; ++x) dst[x] *= inv;
    }
  }
}

template <int NC, int BITS>
at::Tensor attend_higgs_impl(const HiggsArgs& a, const Problem& P) {
  const HiggsPlan plan(a, P);
  const int64_t items = int64_t(plan.tiles.size()), work = items * plan.nchunk;
  auto out = at::empty({P.B, P.Hq, P.Q, int64_t(P.D)}, at::kFloat);
  float* o = out.data_ptr<float>();
  auto tile = [&](int64_t item, int64_t c, float* dst) {
    std::vector<HeadSpan> spans;
    const Rows R = plan.rows(P, plan.tiles[item], spans);
    const int64_t tb = c * plan.chunk_len, te = std::min(P.L, tb + plan.chunk_len);
    run_tile<NC, BITS>(a, P, plan.tiles[item], R, spans, tb, te, dst);
  };
  if (plan.nchunk == 1) {  // many tiles (a long prompt): each finished as it is done, no partials kept
#pragma omp parallel for schedule(dynamic, 1) num_threads(plan.threads)
    for (int64_t item = 0; item < items; ++item) {
      std::vector<float> part(size_t(plan.stride));
      tile(item, 0, part.data());
      finish_tile(a, P, plan, plan.tiles[item], part.data(), o);
    }
    return out;
  }
  std::vector<float> part(size_t(work * plan.stride));  // few tiles: their key chunks spread over threads
#pragma omp parallel for schedule(dynamic, 1) num_threads(plan.threads)
  for (int64_t w = 0; w < work; ++w) tile(w / plan.nchunk, w % plan.nchunk, part.data() + w * plan.stride);
#pragma omp parallel for schedule(static) num_threads(plan.threads)
  for (int64_t item = 0; item < items; ++item)
    finish_tile(a, P, plan, plan.tiles[item], part.data() + item * plan.nchunk * plan.stride, o);
  return out;
}

}  // namespace

at::Tensor higgs_attention(const HiggsArgs& a, const Problem& P) {
  return dispatch_nc(P.D, [&]<int NC>() {
    switch (a.bits) {
      case 4: return attend_higgs_impl<NC, 4>(a, P);
      case 6: return attend_higgs_impl<NC, 6>(a, P);
      default: return attend_higgs_impl<NC, 8>(a, P);
    }
  });
}

}  // namespace kvq
