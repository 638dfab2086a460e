// GEAR stores: KIVI-style codes + exact sparse outliers + a low-rank correction per segment.
//
// The KIVI driver and loaders, plus two things:
// - the low-rank term is never expanded: scores get A_t . (q B) and outputs (sum_t p_t A_t) B^T, per
//   segment (key_terms, value_terms);
// - outliers are stored in top-k order, not by token, so each call first buckets them by 16-token
//   block (a counting sort of their positions); each dequantized 16-token buffer then gets its
//   outliers written in as value - (A B^T)[t, c], so buffer + low-rank term is exactly the stored
//   value there, as the torch path's scatter leaves it.
#include "kernels.h"

namespace kvq {

namespace {

struct Outlier {
  int32_t pos;  // t * D + c within its (batch row, head)
  float value;
};

// One stream's outliers, grouped by 16-token block: head bh's block k holds
// items[bh * n_out + start[bh * (nb + 1) + k] ...  + start[bh * (nb + 1) + k + 1]).
struct Buckets {
  int64_t nb = 0;
  std::vector<int64_t> start;
  std::vector<Outlier> items;
};

Buckets bucket(const GearStream& s, const Problem& P, int threads) {
  Buckets out;
  out.nb = (s.q.n + SB - 1) / SB;
  const int64_t heads = P.B * P.Hkv, per = out.nb + 1;
  out.start.assign(size_t(heads * per), 0);
  if (s.index == nullptr || s.n_out == 0) return out;
  out.items.resize(size_t(heads * s.n_out));
  const int32_t dsb = P.D * SB;  // positions are int32, and so is the division
  bool bad = false;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(|| : bad)
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t b = bh / P.Hkv, h = bh % P.Hkv;
    const int32_t* index = s.index + b * s.ib + h * s.ih;
    const uint16_t* value = s.value + b * s.vb + h * s.vh;
    int64_t* start = out.start.data() + bh * per;
    for (int64_t o = 0; o < s.n_out; ++o) {
      const int64_t pos = index[o];
      if (pos < 0 || pos >= s.q.n * P.D) {
        bad = true;
        continue;
      }
      ++start[int32_t(pos) / dsb + 1];
    }
    for (int64_t k = 1; k < per; ++k) start[k] += start[k - 1];
    std::vector<int64_t> cursor(start, start + out.nb);
    Outlier* items = out.items.data() + bh * s.n_out;
    for (int64_t o = 0; o < s.n_out; ++o) {
      const int64_t pos = index[o];
      if (pos >= 0 && pos < s.q.n * P.D) items[cursor[int32_t(pos) / dsb]++] = {int32_t(pos), half_to_float(value[o])};
    }
  }
  TORCH_CHECK(!bad, "gear: an outlier position lies outside the quantized tokens");
  return out;
}

struct Segment {  // the low-rank segment holding a token: tokens [first, end)
  const Run* run = nullptr;
  int64_t seg = 0, first = 0, end = 0;
};

inline Segment find_segment(const std::vector<Run>& runs, int64_t t) {
  for (const Run& r : runs) {  // a prefill run and a decode run, typically
    if (t >= r.start && t < r.start + r.len * r.nseg) {
      const int64_t s = (t - r.start) / r.len;
      return {&r, s, r.start + s * r.len, r.start + (s + 1) * r.len};
    }
  }
  return {};
}

inline const uint16_t* a_row(const Segment& s, int64_t b, int64_t h, int64_t t) {
  const Run& r = *s.run;
  return r.a + b * r.ab + h * r.ah + s.seg * r.as + (t - s.first) * r.at;
}

// (A B^T)[t, c], summed in fp32 as the torch path's matmul does.
float lowrank_elem(const std::vector<Run>& runs, int64_t b, int64_t h, int64_t t, int64_t c) {
  const Segment s = find_segment(runs, t);
  if (s.run == nullptr) return 0.0f;
  const Run& r = *s.run;
  const uint16_t* a = a_row(s, b, h, t);
  const uint16_t* bc = r.b + b * r.bb + h * r.bh + s.seg * r.bs + c * r.bc;
  float x = 0.0f;
  for (int j = 0; j < r.rank; ++j) x = std::fma(half_to_float(a[j * r.aj]), half_to_float(bc[j * r.bj]), x);
  return x;
}

// One stream's low-rank factors around the current 16-token block: B of the segment holding it,
// transposed to fp32 rows bt[j][0..NC*W) (lanes past D zero), and A of the block's tokens as fp32
// columns col[j][t - t0] when the whole block lies in that segment (the usual case: segments are
// whole blocks of R tokens).
template <int NC>
struct LowRank {
  Segment cur;
  std::vector<float> bt, col;
  int rank = 0;
  int64_t version = 0;  // counts segment loads, so per-segment products know when to refresh
  int64_t t0 = -1;      // block whose columns are in col, -1 if none
  int n = 0;

  // False if t is in no segment.
  bool load(const std::vector<Run>& runs, int64_t b, int64_t h, int64_t t, int D) {
    if (cur.run != nullptr && t >= cur.first && t < cur.end) return true;
    cur = find_segment(runs, t);
    if (cur.run == nullptr) return false;
    const Run& r = *cur.run;
    rank = r.rank;
    ++version;
    bt.assign(size_t(rank) * NC * W, 0.0f);
    const uint16_t* B = r.b + b * r.bb + h * r.bh + cur.seg * r.bs;
    for (int c = 0; c < D; ++c)
      for (int j = 0; j < rank; ++j) bt[size_t(j) * NC * W + c] = half_to_float(B[c * r.bc + j * r.bj]);
    return true;
  }

  // Columns of A for the quantized tokens [b0, b0 + q) of a block, if they share one segment.
  void block(const std::vector<Run>& runs, int64_t b, int64_t h, int64_t b0, int q, int D) {
    t0 = -1;
    if (!load(runs, b, h, b0, D) || b0 + q > cur.end) return;
    t0 = b0;
    n = q;
    col.resize(size_t(rank) * SB);
    const Run& r = *cur.run;
    const uint16_t* a = a_row(cur, b, h, b0);
    for (int j = 0; j < rank; ++j) {
      if (r.at == 1) {  // column-major A (as QR leaves it): one load per column
        store(&col[size_t(j) * SB], load_half(a + j * r.aj, lanes(q)), lanes(SB));
      } else {
        for (int t = 0; t < q; ++t) col[size_t(j) * SB + t] = half_to_float(a[t * r.at + j * r.aj]);
      }
    }
  }

  // (A B^T)[t, c] for a token of the current block.
  float at(int64_t t, int64_t c) const {
    float x = 0.0f;
    for (int j = 0; j < rank; ++j) x = std::fma(col[size_t(j) * SB + (t - t0)], bt[size_t(j) * NC * W + c], x);
    return x;
  }
};

template <int NC, int BITS>
struct GearFormat {
  const GearStream &k, &v;
  const Buckets &kb, &vb;
  int G;
  int64_t Hkv;
  struct State {
    KeyDequant<NC, BITS> key;
    ValueDequant<NC, BITS> value;
    LowRank<NC> klr, vlr;
    std::vector<float> qb, pa;  // q_r . B[:, j] of the key segment; sum_t p_t A[t, j]
    int64_t qb_version = -1;
  };
  State state(const Problem& P) const {
    State s;
    s.value.init(P.D, G);
    return s;
  }

  // Outliers of the block at t0 (a multiple of SB) into its dequantized buffer.
  void patch(const GearStream& st, const Buckets& bk, const LowRank<NC>& lr, int64_t b, int64_t h, int64_t t0, int D,
             float* buf) const {
    const int64_t bh = b * Hkv + h, block = t0 / SB;
    const int64_t* start = bk.start.data() + bh * (bk.nb + 1);
    const Outlier* items = bk.items.data() + bh * st.n_out;
    for (int64_t o = start[block]; o < start[block + 1]; ++o) {
      const int32_t t = items[o].pos / D, c = items[o].pos % D;
      const float lowrank = lr.t0 == t0 ? lr.at(t, c) : lowrank_elem(st.runs, b, h, t, c);
      buf[(t - t0) * NC * W + c] = items[o].value - lowrank;
    }
  }
  void keys(State& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    const int q = int(std::clamp<int64_t>(k.q.n - t0, 0, n));
    if (q > 0) {
      s.key.rows(k.q, b, h, t0, q, D, G, buf);
      s.klr.block(k.runs, b, h, t0, q, D);
      patch(k, kb, s.klr, b, h, t0, D, buf);
    }
    if (q < n) half_rows<NC>(k.window.row(b, h, t0 + q - k.q.n), k.window.st, n - q, D, buf + q * NC * W);
  }
  void values(State& s, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    const int q = int(std::clamp<int64_t>(v.q.n - t0, 0, n));
    if (q > 0) {
      s.value.rows(v.q, b, h, t0, q, D, buf);
      s.vlr.block(v.runs, b, h, t0, q, D);
      patch(v, vb, s.vlr, b, h, t0, D, buf);
    }
    if (q < n) half_rows<NC>(v.window.row(b, h, t0 + q - v.q.n), v.window.st, n - q, D, buf + q * NC * W);
  }

  // d[r*BT + t - t0] += A_t . (q_r B) for the quantized keys of the block at t0 (after keys()).
  void key_terms(State& s, int64_t b, int64_t h, int64_t t0, int n, const Rows& R, int D, float* d) const {
    const int64_t end = std::min(t0 + n, k.q.n);
    LowRank<NC>& lr = s.klr;
    for (int64_t t = t0; t < end;) {
      if (!lr.load(k.runs, b, h, t, D)) {
        ++t;
        continue;
      }
      const int rank = lr.rank;
      if (s.qb_version != lr.version) {
        s.qb_version = lr.version;
        s.qb.assign(size_t(R.n) * rank, 0.0f);
        for (int r = 0; r < R.n; ++r)
          for (int j = 0; j < rank; ++j) {
            vf x = zero();
            for (int c = 0; c < NC; ++c)
              x = fma(load(R.q[r] + c * W, lanes(D - c * W)), load(&lr.bt[size_t(j) * NC * W + c * W], lanes(W)), x);
            s.qb[size_t(r) * rank + j] = hsum(x);
          }
      }
      if (lr.t0 == t0) {  // the block's columns: one vector op per row and rank
        for (int r = 0; r < R.n; ++r) {
          vf x = load(d + r * BT, lanes(lr.n));
          for (int j = 0; j < rank; ++j) x = fma(set1(s.qb[size_t(r) * rank + j]), load(&lr.col[size_t(j) * SB], lanes(W)), x);
          store(d + r * BT, x, lanes(lr.n));
        }
        t = end;
        continue;
      }
      for (const int64_t e = std::min(end, lr.cur.end); t < e; ++t) {
        const uint16_t* a = a_row(lr.cur, b, h, t);
        for (int r = 0; r < R.n; ++r) {
          float x = 0.0f;
          for (int j = 0; j < rank; ++j) x = std::fma(half_to_float(a[j * lr.cur.run->aj]), s.qb[size_t(r) * rank + j], x);
          d[r * BT + (t - t0)] += x;
        }
      }
    }
  }

  // acc[r] += (sum_t p[r*BT + t - t0] A_t) B^T for the quantized values of the block at t0 (after values()).
  void value_terms(State& s, int64_t b, int64_t h, int64_t t0, int n, int nr, int D, const float* p,
                   float* acc) const {
    const int64_t end = std::min(t0 + n, v.q.n);
    LowRank<NC>& lr = s.vlr;
    for (int64_t t = t0; t < end;) {
      if (!lr.load(v.runs, b, h, t, D)) {
        ++t;
        continue;
      }
      const int rank = lr.rank;
      s.pa.assign(size_t(nr) * rank, 0.0f);
      if (lr.t0 == t0) {
        for (int r = 0; r < nr; ++r)
          for (int j = 0; j < rank; ++j)
            s.pa[size_t(r) * rank + j] = hsum(mul(load(p + r * BT, lanes(lr.n)), load(&lr.col[size_t(j) * SB], lanes(W))));
        t = end;
      } else {
        for (const int64_t e = std::min(end, lr.cur.end); t < e; ++t) {
          const uint16_t* a = a_row(lr.cur, b, h, t);
          for (int j = 0; j < rank; ++j) {
            const float aj = half_to_float(a[j * lr.cur.run->aj]);
            for (int r = 0; r < nr; ++r) s.pa[size_t(r) * rank + j] += p[r * BT + (t - t0)] * aj;
          }
        }
      }
      for (int r = 0; r < nr; ++r)
        for (int j = 0; j < rank; ++j) {
          const vf w = set1(s.pa[size_t(r) * rank + j]);
          for (int c = 0; c < NC; ++c) {
            float* ap = acc + r * DMAX + c * W;
            store(ap, fma(w, load(&lr.bt[size_t(j) * NC * W + c * W], lanes(W)), load(ap, lanes(W))), lanes(W));
          }
        }
    }
  }
};

}  // namespace

at::Tensor gear_attention(const GearStream& k, const GearStream& v, int G, int bits, const Problem& P) {
  const int threads = at::get_num_threads();
  const Buckets kb = bucket(k, P, threads), vb = bucket(v, P, threads);
  return dispatch_nc(P.D, [&]<int NC>() {
    if (bits == 2) return attend<NC>(GearFormat<NC, 2>{k, v, kb, vb, G, P.Hkv}, P);
    return attend<NC>(GearFormat<NC, 4>{k, v, kb, vb, G, P.Hkv}, P);
  });
}

}  // namespace kvq
