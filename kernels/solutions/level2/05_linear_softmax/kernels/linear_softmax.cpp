#include "gemm.h"
#include <cmath>

// GEMM + bias per 14-row block, then softmax of those rows while they are still in cache.
extern "C" void linear_softmax(float* out, const float* x, const float* w, const float* bias,
                               int64_t M, int64_t K, int64_t N) {
    auto epi = [=](__m512 v, int64_t, int64_t j, __mmask16 m) {
        return _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
    };
    auto post = [=](int64_t i0, int64_t mr) {
        for (int64_t i = i0; i < i0 + mr; ++i) {
            float* row = out + i * N;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < N; j += 16)
                mx = _mm512_mask_max_ps(mx, tail_mask(N - j), mx, _mm512_maskz_loadu_ps(tail_mask(N - j), row + j));
            __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < N; j += 16) {
                __mmask16 m = tail_mask(N - j);
                __m512 e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), vm));
                _mm512_mask_storeu_ps(row + j, m, e);
                sum = _mm512_mask_add_ps(sum, m, sum, e);
            }
            __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
            for (int64_t j = 0; j < N; j += 16) {
                __mmask16 m = tail_mask(N - j);
                _mm512_mask_storeu_ps(row + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), inv));
            }
        }
    };
    linear_gemm(x, w, out, M, K, N, epi, post);
}
