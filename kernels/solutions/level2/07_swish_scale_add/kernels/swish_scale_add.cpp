#include "vmath.h"

// out = x * sigmoid(x) * scale + y = x / (1 + exp(-x)) * scale + y
extern "C" void swish_scale_add(float* out, const float* x, const float* y, int64_t n, double scale) {
    const __m512 s = _mm512_set1_ps((float)scale), one = _mm512_set1_ps(1.f);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        __m512 sw = _mm512_div_ps(v, _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), v))));
        _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(sw, s, _mm512_maskz_loadu_ps(m, y + i)));
    }
}
