#include "vmath.h"
#include <algorithm>

// x[B][C][L]: per (b, 256-wide column block) sum over C, then tanh(x * C / sum) while the block is in L2.
extern "C" void mean_div_tanh(float* y, const float* x, int64_t B, int64_t C, int64_t L) {
    constexpr int64_t LB = 256;
    int64_t nl = (L + LB - 1) / LB;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t lb = 0; lb < nl; ++lb) {
            int64_t l0 = lb * LB, w = std::min(LB, L - l0);
            const float* xb = x + b * C * L + l0;
            float* yb = y + b * C * L + l0;
            alignas(64) float inv[LB];
            for (int64_t j = 0; j < w; j += 16) {
                __mmask16 m = tail_mask(w - j);
                __m512 s = _mm512_setzero_ps();
                for (int64_t c = 0; c < C; ++c) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, xb + c * L + j));
                _mm512_store_ps(inv + j, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_div_ps(s, _mm512_set1_ps((float)C))));
            }
            for (int64_t c = 0; c < C; ++c)
                for (int64_t j = 0; j < w; j += 16) {
                    __mmask16 m = tail_mask(w - j);
                    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xb + c * L + j), _mm512_load_ps(inv + j));
                    _mm512_mask_storeu_ps(yb + c * L + j, m, vtanh(v));
                }
        }
}
