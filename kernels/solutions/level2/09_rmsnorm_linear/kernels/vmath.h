// AVX-512 float math helpers: exp (Cephes polynomial), erf (A&S 7.1.26, |err| < 1.5e-7), tanh, gelu.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstdlib>

static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 verf(__m512 x) {
    __m512 a = _mm512_abs_ps(x);
    __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(a, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.f)));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    p = _mm512_mul_ps(p, t);
    __m512 y = _mm512_fnmadd_ps(p, vexp(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), a)), _mm512_set1_ps(1.f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(y),   // copy the sign of x
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x80000000))));
}

static inline __m512 vgelu(__m512 x) {  // 0.5 x (1 + erf(x / sqrt 2))
    __m512 e = verf(_mm512_mul_ps(x, _mm512_set1_ps(0.70710678f)));
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), _mm512_add_ps(e, _mm512_set1_ps(1.f)));
}

static inline __m512 vtanh(__m512 x) {  // 1 - 2 / (exp(2x) + 1)
    __m512 e = vexp(_mm512_add_ps(x, x));
    return _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
}

static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

// Growable 64-byte aligned scratch buffer, one per slot (call outside parallel regions).
static inline float* scratch(int slot, size_t n) {
    static float* buf[8] = {};
    static size_t cap[8] = {};
    if (cap[slot] < n) {
        free(buf[slot]);
        buf[slot] = (float*)aligned_alloc(64, (n * 4 + 63) / 64 * 64);
        cap[slot] = n;
    }
    return buf[slot];
}
