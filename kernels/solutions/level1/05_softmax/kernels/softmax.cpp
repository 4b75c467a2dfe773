#include <cstdint>
#include <cmath>
#include <immintrin.h>

#ifdef __AVX512F__
// exp(x) for x <= 0 (Cephes polynomial, ~1 ulp); inputs below -87.3 flush to 0.
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.33654f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 y = _mm512_scalef_ps(p, n);
    return _mm512_mask_mov_ps(y, under, _mm512_setzero_ps());
}
#endif

static void softmax_row(float* o, const float* x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#ifdef __AVX512F__
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
    for (; i + 32 <= n; i += 32) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + i));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + i + 16));
    }
    m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
#endif
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    double s = 0.0;
    i = 0;
#ifdef __AVX512F__
    __m512 vm = _mm512_set1_ps(m), s0 = _mm512_setzero_ps(), s1 = s0;
    for (; i + 32 <= n; i += 32) {
        __m512 e0 = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
        __m512 e1 = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), vm));
        _mm512_storeu_ps(o + i, e0);
        _mm512_storeu_ps(o + i + 16, e1);
        s0 = _mm512_add_ps(s0, e0);
        s1 = _mm512_add_ps(s1, e1);
    }
    s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#endif
    for (; i < n; ++i) { o[i] = std::exp(x[i] - m); s += o[i]; }
    const float inv = (float)(1.0 / s);
    i = 0;
#ifdef __AVX512F__
    __m512 vi = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), vi));
#endif
    for (; i < n; ++i) o[i] *= inv;
}

extern "C" void softmax_rows(float* out, const float* x, int64_t rows, int64_t cols) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) softmax_row(out + r * cols, x + r * cols, cols);
}
