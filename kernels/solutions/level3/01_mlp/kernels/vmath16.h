// 16-lane float vectors (one AVX-512 register) and vector exp / erf / gelu.
#pragma once
#include <cstdint>
#include <cmath>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

static inline v16 vload(const float* p) { return *(const v16u*)p; }
static inline void vstore(float* p, v16 v) { *(v16u*)p = v; }
static inline v16 vbcast(float s) {
#ifdef __AVX512F__
    return _mm512_set1_ps(s);
#else
    return v16{} + s;
#endif
}
static inline v16 vfma(v16 a, v16 b, v16 c) {
#ifdef __AVX512F__
    return _mm512_fmadd_ps(a, b, c);
#else
    return a * b + c;
#endif
}
static inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
static inline v16 vmin(v16 a, v16 b) { return a < b ? a : b; }
static inline float hsum(v16 v) { float s = 0.f; for (int i = 0; i < 16; ++i) s += v[i]; return s; }
static inline float hmax(v16 v) { float s = v[0]; for (int i = 1; i < 16; ++i) s = v[i] > s ? v[i] : s; return s; }

// Cephes expf: exact range reduction, degree-6 polynomial (~1 ulp); clamps to [-87.3, 88.3].
static inline v16 vexp(v16 x) {
    x = vmin(vmax(x, vbcast(-87.3f)), vbcast(88.3f));
    v16 n = (x * 1.44269504f + 12582912.f) - 12582912.f;   // round to nearest
    v16 r = vfma(n, vbcast(-0.693359375f), x);
    r = vfma(n, vbcast(2.12194440e-4f), r);
    v16 p = vbcast(1.9875691500e-4f);
    p = vfma(p, r, vbcast(1.3981999507e-3f));
    p = vfma(p, r, vbcast(8.3334519073e-3f));
    p = vfma(p, r, vbcast(4.1665795894e-2f));
    p = vfma(p, r, vbcast(1.6666665459e-1f));
    p = vfma(p, r, vbcast(5.0000001201e-1f));
    v16 y = vfma(p, r * r, r + 1.f);
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return y * (v16)bits;
}

// 1 / x (rcp14 estimate refined by one Newton step on AVX-512).
static inline v16 vrcp(v16 x) {
#ifdef __AVX512F__
    v16 r = _mm512_rcp14_ps(x);
    return r * (2.f - x * r);
#else
    return 1.f / x;
#endif
}

// Abramowitz-Stegun 7.1.26 erf (|error| < 1.5e-7).
static inline v16 verf(v16 x) {
    v16i sign = (v16i)x & (int32_t)0x80000000;
    v16 a = (v16)((v16i)x & 0x7fffffff);
    v16 t = vrcp(vfma(a, vbcast(0.3275911f), vbcast(1.f)));
    v16 p = vbcast(1.061405429f);
    p = vfma(p, t, vbcast(-1.453152027f));
    p = vfma(p, t, vbcast(1.421413741f));
    p = vfma(p, t, vbcast(-0.284496736f));
    p = vfma(p, t, vbcast(0.254829592f));
    v16 y = 1.f - p * t * vexp(-(a * a));
    return (v16)((v16i)y | sign);
}

static inline v16 vgelu(v16 x) { return 0.5f * x * (1.f + verf(x * 0.70710678118654752f)); }
static inline float sgelu(float x) { return 0.5f * x * (1.f + std::erf(x * 0.70710678118654752f)); }
