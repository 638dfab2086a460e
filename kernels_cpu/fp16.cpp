// fp16 K/V, as the fp16 method stores them; read whole, or truncated to keep_bits in registers
// (the truncation method's store: fp16 bytes are all loaded, so it runs at fp16's speed).
#include "bits.h"
#include "kernels.h"

namespace kvq {

namespace {

// fp16 rows truncated to k bits: half_rows with the read rule applied before the conversion.
template <int NC>
inline void half_rows_keep(const uint16_t* src, int64_t st, int n, int D, Keep k, float* buf) {
  for (int t = 0; t < n; ++t) {
    prefetch_span(src + (t + PF) * st, 2 * D);  // a row at a time, as half_rows
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c)
      store(buf + t * NC * W + c * W, half_keep(src + t * st + c * W, lanes(D - c * W), k), lanes(W));
  }
}

template <int NC>
struct Fp16KeepFormat : NoTerms {
  Half4 k, v;
  Keep keep;
  struct State {};
  State state(const Problem&) const { return {}; }
  void keys(State&, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    half_rows_keep<NC>(k.row(b, h, t0), k.st, n, D, keep, buf);
  }
  void values(State&, int64_t b, int64_t h, int64_t t0, int n, int D, float* buf) const {
    half_rows_keep<NC>(v.row(b, h, t0), v.st, n, D, keep, buf);
  }
};

}  // namespace

at::Tensor fp16_attention(const Half4& k, const Half4& v, int keep_bits, const Problem& P) {
  if (keep_bits < 16)
    return dispatch_nc(P.D, [&]<int NC>() { return attend<NC>(Fp16KeepFormat<NC>{{}, k, v, Keep(keep_bits)}, P); });
  return dispatch_nc(P.D, [&]<int NC>() { return attend<NC>(Fp16Format<NC>{{}, k, v}, P); });
}

}  // namespace kvq
