#include "gemm.h"

extern "C" void linear_bias_relu(float* out, const float* x, const float* w, const float* b1, const float* b2,
                                 int64_t M, int64_t K, int64_t N) {
    auto epi = [=](__m512 v, int64_t, int64_t j, __mmask16 m) {
        __m512 b = _mm512_add_ps(_mm512_maskz_loadu_ps(m, b1 + j), _mm512_maskz_loadu_ps(m, b2 + j));
        return _mm512_max_ps(_mm512_add_ps(v, b), _mm512_setzero_ps());
    };
    linear_gemm(x, w, out, M, K, N, epi, NoPost());
}
