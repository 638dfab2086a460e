// fp16 K/V, as the fp16 method stores them.
#include "kernels.h"

namespace kvq {

at::Tensor fp16_attention(const Half4& k, const Half4& v, const Problem& P) {
  return dispatch_nc(P.D, [&]<int NC>() { return attend<NC>(Fp16Format<NC>{{}, k, v}, P); });
}

}  // namespace kvq
