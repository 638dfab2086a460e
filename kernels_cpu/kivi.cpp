// KIVI stores: 2/4/8-bit codes with fp16 scale/zero, plus fp16 windows.
#include "kernels.h"

namespace kvq {

at::Tensor kivi_attention(const QuantPart& kq, const QuantPart& vq, const Half4& kw, const Half4& vw, int G, int bits,
                          const Problem& P) {
  return dispatch_nc(P.D, [&]<int NC>() {
    switch (bits) {
      case 2: return attend<NC>(KiviFormat<NC, 2>{{}, kq, vq, kw, vw, G}, P);
      case 4: return attend<NC>(KiviFormat<NC, 4>{{}, kq, vq, kw, vw, G}, P);
      default: return attend<NC>(KiviFormat<NC, 8>{{}, kq, vq, kw, vw, G}, P);
    }
  });
}

}  // namespace kvq
