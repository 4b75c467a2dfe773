#include "gemm.h"
#include <cmath>

// Row scales 1/sqrt(mean(x^2) + eps) first; the normalization is applied while packing A.
extern "C" void rmsnorm_linear(float* out, const float* x, const float* g, const float* w, const float* bias,
                               int64_t M, int64_t K, int64_t N, double eps) {
    float* rs = scratch(2, M);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
        const float* row = x + i * K;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) {
            __m512 v = _mm512_maskz_loadu_ps(tail_mask(K - k), row + k);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        rs[i] = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)K + (float)eps);
    }
    auto epi = [=](__m512 v, int64_t, int64_t j, __mmask16 m) {
        return _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
    };
    linear_gemm(x, w, out, M, K, N, epi, NoPost(), rs, g);
}
