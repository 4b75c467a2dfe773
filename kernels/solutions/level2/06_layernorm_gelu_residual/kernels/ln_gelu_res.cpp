#include "vmath.h"
#include <cmath>

// One pass per row (row stays in L1): mean, variance, then gelu(norm(x)) + x.
extern "C" void ln_gelu_res(float* y, const float* x, const float* w, const float* b, int64_t M, int64_t D, double eps) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
        const float* xr = x + i * D;
        float* yr = y + i * D;
        __m512 s = _mm512_setzero_ps();
        for (int64_t j = 0; j < D; j += 16) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(tail_mask(D - j), xr + j));
        __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(s) / (float)D), q = _mm512_setzero_ps();
        for (int64_t j = 0; j < D; j += 16) {
            __mmask16 m = tail_mask(D - j);
            __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, xr + j), mean);
            q = _mm512_fmadd_ps(d, d, q);
        }
        __m512 rstd = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(q) / (float)D + (float)eps));
        for (int64_t j = 0; j < D; j += 16) {
            __mmask16 m = tail_mask(D - j);
            __m512 v = _mm512_maskz_loadu_ps(m, xr + j);
            __m512 n = _mm512_mul_ps(_mm512_sub_ps(v, mean), rstd);
            n = _mm512_fmadd_ps(n, _mm512_maskz_loadu_ps(m, w + j), _mm512_maskz_loadu_ps(m, b + j));
            _mm512_mask_storeu_ps(yr + j, m, _mm512_add_ps(vgelu(n), v));
        }
    }
}
