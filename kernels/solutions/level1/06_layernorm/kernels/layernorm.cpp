#include <cstdint>
#include <cmath>
#include <immintrin.h>

// Two passes over a cached row: mean, then centered variance; then the affine output.
static void ln_row(float* o, const float* x, const float* w, const float* b, int64_t n, float eps) {
    int64_t i = 0;
    float s = 0.f;
#ifdef __AVX512F__
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(x + i));
        a1 = _mm512_add_ps(a1, _mm512_loadu_ps(x + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_loadu_ps(x + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_loadu_ps(x + i + 48));
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    for (; i < n; ++i) s += x[i];
    const float mean = s / (float)n;
    float v = 0.f;
    i = 0;
#ifdef __AVX512F__
    __m512 vm = _mm512_set1_ps(mean);
    a0 = _mm512_setzero_ps(); a1 = a0; a2 = a0; a3 = a0;
    for (; i + 64 <= n; i += 64) {
        __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(x + i), vm);
        __m512 d1 = _mm512_sub_ps(_mm512_loadu_ps(x + i + 16), vm);
        __m512 d2 = _mm512_sub_ps(_mm512_loadu_ps(x + i + 32), vm);
        __m512 d3 = _mm512_sub_ps(_mm512_loadu_ps(x + i + 48), vm);
        a0 = _mm512_fmadd_ps(d0, d0, a0);
        a1 = _mm512_fmadd_ps(d1, d1, a1);
        a2 = _mm512_fmadd_ps(d2, d2, a2);
        a3 = _mm512_fmadd_ps(d3, d3, a3);
    }
    v = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#endif
    for (; i < n; ++i) v += (x[i] - mean) * (x[i] - mean);
    const float rstd = 1.0f / std::sqrt(v / (float)n + eps);
    i = 0;
#ifdef __AVX512F__
    __m512 vr = _mm512_set1_ps(rstd);
    for (; i + 16 <= n; i += 16) {
        __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), vr);
        _mm512_storeu_ps(o + i, _mm512_fmadd_ps(y, _mm512_loadu_ps(w + i), _mm512_loadu_ps(b + i)));
    }
#endif
    for (; i < n; ++i) o[i] = (x[i] - mean) * rstd * w[i] + b[i];
}

extern "C" void layernorm_rows(float* out, const float* x, const float* w, const float* b,
                               int64_t rows, int64_t cols, double eps) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) ln_row(out + r * cols, x + r * cols, w, b, cols, (float)eps);
}
