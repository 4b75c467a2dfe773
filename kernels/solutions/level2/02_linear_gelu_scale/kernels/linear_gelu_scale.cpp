#include "gemm.h"

extern "C" void linear_gelu_scale(float* out, const float* x, const float* w, const float* bias,
                                  int64_t M, int64_t K, int64_t N, double scale) {
    __m512 s = _mm512_set1_ps((float)scale);
    auto epi = [=](__m512 v, int64_t, int64_t j, __mmask16 m) {
        return _mm512_mul_ps(vgelu(_mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j))), s);
    };
    linear_gemm(x, w, out, M, K, N, epi, NoPost());
}
