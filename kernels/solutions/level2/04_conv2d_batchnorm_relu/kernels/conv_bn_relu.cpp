#include "conv.h"
#include <cmath>

// BatchNorm(eval) folded into a per-channel affine: relu(conv * s + t).
extern "C" void conv_bn_relu(float* y, const float* x, const float* w, const float* cb, const float* mean,
                             const float* var, const float* gamma, const float* beta, double eps,
                             int64_t B, int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t KH, int64_t KW) {
    float* st = scratch(2, 2 * Co);
    for (int64_t c = 0; c < Co; ++c) {
        float s = gamma[c] / std::sqrt(var[c] + (float)eps);
        st[c] = s;
        st[Co + c] = (cb[c] - mean[c]) * s + beta[c];
    }
    auto epi = [=](__m512 v, int64_t co) {
        v = _mm512_fmadd_ps(v, _mm512_set1_ps(st[co]), _mm512_set1_ps(st[Co + co]));
        return _mm512_max_ps(v, _mm512_setzero_ps());
    };
    conv2d(y, x, w, B, Ci, H, W, Co, KH, KW, epi);
}
