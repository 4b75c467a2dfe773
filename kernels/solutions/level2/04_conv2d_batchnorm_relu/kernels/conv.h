// Conv2d (stride 1, no padding) as an implicit GEMM, one output row at a time:
// rows = output channels (blocks of <= MR, weights packed [K][mr]), columns = output pixels of
// the row, whose im2col slice is packed into NR-wide panels [K][NR] (stays in L1/L2).
// AVX-512: 32 columns x 14 channels (28 of its 32 registers); narrower vectors: 2 VW x 6 (12 of AVX2's 16).
#pragma once
#include "vmath.h"
#include <algorithm>

constexpr int64_t NR = 2 * VW, MR = VW == 16 ? 14 : 6;

template <int R, class Epi>
static inline void conv_ukernel(int64_t K, const float* a, const float* b,
                                float* y, int64_t ystride, int64_t co0, int64_t nc, const Epi& epi) {
    vf c0[R], c1[R];
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = vzero();
    vmask m0 = tail_mask(nc), m1 = nc > VW ? tail_mask(nc - VW) : 0;
    for (int64_t k = 0; k < K; ++k, a += R, b += NR) {
        vf b0 = vload(b), b1 = vload(b + VW);
#pragma GCC unroll 14
        for (int r = 0; r < R; ++r) {
            vf av = vset1(a[r]);
            c0[r] = vfmadd(av, b0, c0[r]);
            c1[r] = vfmadd(av, b1, c1[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float* o = y + (co0 + r) * ystride;
        vmask_storeu(o, m0, epi(c0[r], co0 + r));
        if (m1) vmask_storeu(o + VW, m1, epi(c1[r], co0 + r));
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
    int64_t np = (OW + NR - 1) / NR;
#pragma omp parallel
    {
        static thread_local float* bp = nullptr;
        static thread_local int64_t cap = 0;
        if (cap < np * NR * K) { free(bp); cap = np * NR * K; bp = (float*)aligned_alloc(64, cap * 4); }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t n = 0; n < B; ++n)
            for (int64_t oh = 0; oh < OH; ++oh) {
                const float* xr = x + n * Ci * H * W + oh * W;
                for (int64_t p = 0; p < np; ++p) {
                    int64_t nc = std::min(int64_t{NR}, OW - p * NR);
                    vmask m0 = tail_mask(nc), m1 = nc > VW ? tail_mask(nc - VW) : 0;
                    for (int64_t k = 0; k < K; ++k) {
                        const float* src = xr + kofs[k] + p * NR;
                        float* dst = bp + (p * K + k) * NR;
                        vstore(dst, vmaskz_loadu(m0, src));
                        vstore(dst + VW, vmaskz_loadu(m1, src + VW));
                    }
                }
                for (int64_t b = 0; b < nb; ++b) {
                    int64_t c0 = start(b), mr = start(b + 1) - c0;
                    for (int64_t p = 0; p < np; ++p) {
                        float* yp = y + n * Co * OH * OW + oh * OW + p * NR;
                        int64_t nc = std::min(int64_t{NR}, OW - p * NR);
                        switch (mr) {
#define UK(R) case R: if constexpr (R <= MR) \
    conv_ukernel<R>(K, ap + c0 * K, bp + p * K * NR, yp, OH * OW, c0, nc, epi); break;
                        UK(1) UK(2) UK(3) UK(4) UK(5) UK(6) UK(7) UK(8) UK(9) UK(10) UK(11) UK(12) UK(13) UK(14)
#undef UK
                        }
                    }
                }
            }
    }
}
