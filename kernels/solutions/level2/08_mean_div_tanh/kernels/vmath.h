// Float vector math helpers: exp (Cephes polynomial), erf (A&S 7.1.26, |err| < 1.5e-7), tanh, gelu.
// vf is a vector of VW floats: AVX-512 intrinsics under __AVX512F__, else a GCC vector extension of
// one machine vector (AVX2/FMA, SSE or NEON code, whatever -march gives). A vmask picks lanes: a
// bit mask on AVX-512, a count of leading lanes otherwise (the kernels only mask tails).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>

// The helpers are always inlined, like the intrinsics they stand for.
#define VFN static inline __attribute__((always_inline))

#ifdef __AVX512F__
#include <immintrin.h>

typedef __m512 vf;
typedef __mmask16 vmask;
constexpr int VW = 16;

VFN vf vset1(float a) { return _mm512_set1_ps(a); }
VFN vf vzero() { return _mm512_setzero_ps(); }
VFN vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
VFN vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
VFN vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
VFN vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
VFN vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   // a b + c
VFN vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } // c - a b
VFN vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
VFN vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
VFN vf vabs(vf a) { return _mm512_abs_ps(a); }
VFN vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
VFN vf vscalef(vf a, vf n) { return _mm512_scalef_ps(a, n); }  // a 2^n
VFN vf vcopysign(vf a, vf s) {  // a >= 0 with the sign of s
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a),
        _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32(0x80000000))));
}
VFN float vreduce_add(vf a) { return _mm512_reduce_add_ps(a); }
VFN float vreduce_max(vf a) { return _mm512_reduce_max_ps(a); }
VFN vf vload(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
VFN void vstore(float* p, vf a) { _mm512_store_ps(p, a); }
VFN vmask tail_mask(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }
VFN vf vmaskz_loadu(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // 0 off m
VFN void vmask_storeu(float* p, vmask m, vf a) { _mm512_mask_storeu_ps(p, m, a); }
VFN vf vmask_add(vf src, vmask m, vf a, vf b) { return _mm512_mask_add_ps(src, m, a, b); }  // src off m
VFN vf vmask_max(vf src, vmask m, vf a, vf b) { return _mm512_mask_max_ps(src, m, a, b); }
VFN vf vmaskz_sub(vmask m, vf a, vf b) { return _mm512_maskz_sub_ps(m, a, b); }

#else
#ifdef __AVX__
constexpr int VW = 8;
#else
constexpr int VW = 4;
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef float vfu __attribute__((vector_size(4 * VW), aligned(4), may_alias));  // what a float* points at
typedef int vmask;

VFN vf vset1(float a) { return a - vf{}; }  // exact (a - +0 = a), so a plain broadcast
VFN vf vzero() { return vf{}; }
VFN vf vadd(vf a, vf b) { return a + b; }
VFN vf vsub(vf a, vf b) { return a - b; }
VFN vf vmul(vf a, vf b) { return a * b; }
VFN vf vdiv(vf a, vf b) { return a / b; }
VFN vf vfmadd(vf a, vf b, vf c) { return a * b + c; }  // contracted to an fma where there is one
VFN vf vfnmadd(vf a, vf b, vf c) { return c - a * b; }
VFN vf vmax(vf a, vf b) { return a > b ? a : b; }
VFN vf vmin(vf a, vf b) { return a < b ? a : b; }
VFN vf vabs(vf a) { return (vf)((vi)a & 0x7FFFFFFF); }
VFN vf vround(vf a) {  // to nearest even for |a| < 2^22 (the magic-number add; not under -ffast-math)
    const vf magic = vset1(12582912.f);  // 1.5 * 2^23
    return (a + magic) - magic;
}
VFN vf vscalef(vf a, vf n) {  // a 2^n for integral n in [-126, 128], in two factors that stay normal
    vi k = __builtin_convertvector(n, vi), h = k >> 1;
    return a * (vf)((h + 127) << 23) * (vf)((k - h + 127) << 23);
}
VFN vf vcopysign(vf a, vf s) { return (vf)((vi)a | ((vi)s & (int32_t)0x80000000)); }
VFN float vreduce_add(vf a) {
    float s = a[0];
    for (int i = 1; i < VW; ++i) s += a[i];
    return s;
}
VFN float vreduce_max(vf a) {
    float s = a[0];
    for (int i = 1; i < VW; ++i) s = a[i] > s ? a[i] : s;
    return s;
}
VFN vf vload(const float* p) { return *(const vfu*)p; }
VFN void vstore(float* p, vf a) { *(vfu*)p = a; }
VFN vmask tail_mask(int64_t n) { return n >= VW ? VW : (vmask)n; }
VFN vf vmaskz_loadu(vmask m, const float* p) {
    if (m == VW) return vload(p);
    vf a{};
    std::memcpy(&a, p, m * sizeof(float));
    return a;
}
VFN void vmask_storeu(float* p, vmask m, vf a) {
    if (m == VW) vstore(p, a);
    else std::memcpy(p, &a, m * sizeof(float));
}
VFN vi vlanes(vmask m) {  // -1 in the lanes of m
    vi i;
    for (int l = 0; l < VW; ++l) i[l] = l;
    return i < m;
}
VFN vf vmask_add(vf src, vmask m, vf a, vf b) { return vlanes(m) ? a + b : src; }
VFN vf vmask_max(vf src, vmask m, vf a, vf b) { return vlanes(m) ? vmax(a, b) : src; }
VFN vf vmaskz_sub(vmask m, vf a, vf b) { return vlanes(m) ? a - b : vf{}; }
#endif

static inline vf vexp(vf x) {
    x = vmax(vmin(x, vset1(88.7f)), vset1(-87.3f));
    vf n = vround(vmul(x, vset1(1.44269504f)));
    vf r = vfnmadd(n, vset1(0.693359375f), x);
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vf p = vset1(1.9875691500e-4f);
    p = vfmadd(p, r, vset1(1.3981999507e-3f));
    p = vfmadd(p, r, vset1(8.3334519073e-3f));
    p = vfmadd(p, r, vset1(4.1665795894e-2f));
    p = vfmadd(p, r, vset1(1.6666665459e-1f));
    p = vfmadd(p, r, vset1(5.0000001201e-1f));
    p = vfmadd(vmul(p, r), r, vadd(r, vset1(1.f)));
    return vscalef(p, n);
}

static inline vf verf(vf x) {
    vf a = vabs(x);
    vf t = vdiv(vset1(1.f), vfmadd(a, vset1(0.3275911f), vset1(1.f)));
    vf p = vset1(1.061405429f);
    p = vfmadd(p, t, vset1(-1.453152027f));
    p = vfmadd(p, t, vset1(1.421413741f));
    p = vfmadd(p, t, vset1(-0.284496736f));
    p = vfmadd(p, t, vset1(0.254829592f));
    p = vmul(p, t);
    vf y = vfnmadd(p, vexp(vmul(vsub(vzero(), a), a)), vset1(1.f));
    return vcopysign(y, x);
}

static inline vf vgelu(vf x) {  // 0.5 x (1 + erf(x / sqrt 2))
    vf e = verf(vmul(x, vset1(0.70710678f)));
    return vmul(vmul(x, vset1(0.5f)), vadd(e, vset1(1.f)));
}

static inline vf vtanh(vf x) {  // 1 - 2 / (exp(2x) + 1)
    vf e = vexp(vadd(x, x));
    return vsub(vset1(1.f), vdiv(vset1(2.f), vadd(e, vset1(1.f))));
}

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
