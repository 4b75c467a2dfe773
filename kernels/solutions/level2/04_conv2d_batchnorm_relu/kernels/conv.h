// Conv2d (stride 1, no padding) for AVX-512 as an implicit GEMM, one output row at a time:
// rows = output channels (blocks of <= 14, weights packed [K][mr]), columns = output pixels of
// the row, whose im2col slice is packed into 32-wide panels [K][32] (stays in L1/L2).
#pragma once
#include "vmath.h"
#include <algorithm>

constexpr int64_t MR = 14;

template <int R, class Epi>
static inline void conv_ukernel(int64_t K, const float* a, const float* b,
                                float* y, int64_t ystride, int64_t co0, int64_t nc, const Epi& epi) {
    __m512 c0[R], c1[R];
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
    __mmask16 m0 = tail_mask(nc), m1 = nc > 16 ? tail_mask(nc - 16) : 0;
    for (int64_t k = 0; k < K; ++k, a += R, b += 32) {
        __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
#pragma GCC unroll 14
        for (int r = 0; r < R; ++r) {
            __m512 av = _mm512_set1_ps(a[r]);
            c0[r] = _mm512_fmadd_ps(av, b0, c0[r]);
            c1[r] = _mm512_fmadd_ps(av, b1, c1[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float* o = y + (co0 + r) * ystride;
        _mm512_mask_storeu_ps(o, m0, epi(c0[r], co0 + r));
        if (m1) _mm512_mask_storeu_ps(o + 16, m1, epi(c1[r], co0 + r));
    }
}

// y[n][co][oh][ow] = epi(sum_k w[co][k] x[n][ci][oh+kh][ow+kw], co), k = (ci, kh, kw)
template <class Epi>
static inline void conv2d(float* y, const float* x, const float* w, int64_t B, int64_t Ci, int64_t H, int64_t W,
                          int64_t Co, int64_t KH, int64_t KW, const Epi& epi) {
    int64_t OH = H - KH + 1, OW = W - KW + 1, K = Ci * KH * KW, nb = (Co + MR - 1) / MR;
    float* ap = scratch(0, Co * K);
    int64_t* kofs = (int64_t*)scratch(1, 2 * K);
    for (int64_t ci = 0, k = 0; ci < Ci; ++ci)
        for (int64_t kh = 0; kh < KH; ++kh)
            for (int64_t kw = 0; kw < KW; ++kw, ++k) kofs[k] = ci * H * W + kh * W + kw;
    auto start = [=](int64_t b) { return b * Co / nb; };
    for (int64_t b = 0; b < nb; ++b) {
        int64_t c0 = start(b), mr = start(b + 1) - c0;
        for (int64_t r = 0; r < mr; ++r)
            for (int64_t k = 0; k < K; ++k) ap[c0 * K + k * mr + r] = w[(c0 + r) * K + k];
    }
    int64_t np = (OW + 31) / 32;
#pragma omp parallel
    {
        static thread_local float* bp = nullptr;
        static thread_local int64_t cap = 0;
        if (cap < np * 32 * K) { free(bp); cap = np * 32 * K; bp = (float*)aligned_alloc(64, cap * 4); }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t n = 0; n < B; ++n)
            for (int64_t oh = 0; oh < OH; ++oh) {
                const float* xr = x + n * Ci * H * W + oh * W;
                for (int64_t p = 0; p < np; ++p) {
                    int64_t nc = std::min<int64_t>(32, OW - p * 32);
                    __mmask16 m0 = tail_mask(nc), m1 = nc > 16 ? tail_mask(nc - 16) : 0;
                    for (int64_t k = 0; k < K; ++k) {
                        const float* src = xr + kofs[k] + p * 32;
                        float* dst = bp + (p * K + k) * 32;
                        _mm512_store_ps(dst, _mm512_maskz_loadu_ps(m0, src));
                        _mm512_store_ps(dst + 16, _mm512_maskz_loadu_ps(m1, src + 16));
                    }
                }
                for (int64_t b = 0; b < nb; ++b) {
                    int64_t c0 = start(b), mr = start(b + 1) - c0;
                    for (int64_t p = 0; p < np; ++p) {
                        float* yp = y + n * Co * OH * OW + oh * OW + p * 32;
                        int64_t nc = std::min<int64_t>(32, OW - p * 32);
                        switch (mr) {
#define UK(R) case R: conv_ukernel<R>(K, ap + c0 * K, bp + p * K * 32, yp, OH * OW, c0, nc, epi); break;
                        UK(1) UK(2) UK(3) UK(4) UK(5) UK(6) UK(7) UK(8) UK(9) UK(10) UK(11) UK(12) UK(13) UK(14)
#undef UK
                        }
                    }
                }
            }
    }
}
