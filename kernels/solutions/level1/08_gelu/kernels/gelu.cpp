// gelu(x) = 0.5 x (1 + erf(x / sqrt 2)), erfc via Abramowitz-Stegun 7.1.26 (|err| < 1.5e-7).
#include <cstdint>
#include <cmath>
#include <immintrin.h>

#ifdef __AVX512F__
static inline __m512 exp512(__m512 x) {  // x <= 0
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
    return _mm512_mask_mov_ps(_mm512_scalef_ps(p, n), under, _mm512_setzero_ps());
}

static inline __m512 gelu512(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
    __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));
    const __m512 d = _mm512_fmadd_ps(z, _mm512_set1_ps(0.3275911f), one);
    __m512 t = _mm512_rcp14_ps(d);
    t = _mm512_mul_ps(t, _mm512_fnmadd_ps(d, t, _mm512_set1_ps(2.0f)));  // one Newton step
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    __m512 q = _mm512_mul_ps(_mm512_mul_ps(p, t), exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), z)));
    __m512 hq = _mm512_mul_ps(half, q);                       // 0.5 erfc(|x|/sqrt2)
    __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 f = _mm512_mask_mov_ps(_mm512_sub_ps(one, hq), neg, hq);
    return _mm512_mul_ps(x, f);
}
#endif

extern "C" void gelu(float* out, const float* x, int64_t n) {
    const int64_t CH = 16384;
    const int64_t nc = (n + CH - 1) / CH;
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nc; ++c) {
        int64_t i = c * CH;
        const int64_t e = i + CH < n ? i + CH : n;
#ifdef __AVX512F__
        for (; i + 32 <= e; i += 32) {
            _mm512_storeu_ps(out + i, gelu512(_mm512_loadu_ps(x + i)));
            _mm512_storeu_ps(out + i + 16, gelu512(_mm512_loadu_ps(x + i + 16)));
        }
        if (i < e) {
            __mmask16 m = (__mmask16)((1u << (e - i < 16 ? e - i : 16)) - 1);
            _mm512_mask_storeu_ps(out + i, m, gelu512(_mm512_maskz_loadu_ps(m, x + i)));
            i += 16;
        }
#endif
        for (; i < e; ++i) out[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * 0.70710678118654752f));
    }
}
