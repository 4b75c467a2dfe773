#include "conv.h"

extern "C" void conv_relu_bias(float* y, const float* x, const float* w, const float* cb, const float* bias,
                               int64_t B, int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t KH, int64_t KW) {
    auto epi = [=](__m512 v, int64_t co) {
        v = _mm512_max_ps(_mm512_add_ps(v, _mm512_set1_ps(cb[co])), _mm512_setzero_ps());
        return _mm512_add_ps(v, _mm512_set1_ps(bias[co]));
    };
    conv2d(y, x, w, B, Ci, H, W, Co, KH, KW, epi);
}
