#include <cstdint>
#include <cmath>
#include <immintrin.h>

static inline float sumsq(const float* x, int64_t n, int64_t& i) {
    float s = 0.f;
    i = 0;
#ifdef __AVX512F__
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= n; i += 64) {
        __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
        __m512 x2 = _mm512_loadu_ps(x + i + 32), x3 = _mm512_loadu_ps(x + i + 48);
        a0 = _mm512_fmadd_ps(x0, x0, a0);
        a1 = _mm512_fmadd_ps(x1, x1, a1);
        a2 = _mm512_fmadd_ps(x2, x2, a2);
        a3 = _mm512_fmadd_ps(x3, x3, a3);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    for (; i < n; ++i) s += x[i] * x[i];
    return s;
}

extern "C" void rmsnorm_rows(float* out, const float* x, const float* w, int64_t rows, int64_t cols, double eps) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * cols;
        float* o = out + r * cols;
        int64_t i;
        const float rr = 1.0f / std::sqrt(sumsq(xr, cols, i) / (float)cols + (float)eps);
        i = 0;
#ifdef __AVX512F__
        __m512 vr = _mm512_set1_ps(rr);
        for (; i + 16 <= cols; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), vr), _mm512_loadu_ps(w + i)));
#endif
        for (; i < cols; ++i) o[i] = xr[i] * rr * w[i];
    }
}
