// Packed fp32 GEMM: C[M,N] = A[M,K] B[K,N] with a fused per-element epilogue, MR x NR register tiles.
// B is packed once into NR-column panels [N/NR][K][NR]; A is packed per block of <= MR rows [K][mr].
// AVX-512: 32 columns x 14 rows (28 of its 32 registers); narrower vectors: 2 VW x 6 rows (12 of AVX2's 16).
#pragma once
#include "vmath.h"
#include <algorithm>

constexpr int64_t NR = 2 * VW, MR = VW == 16 ? 14 : 6;

struct RowBlocks {  // M rows split into n blocks of balanced height <= MR
    int64_t M, n;
    explicit RowBlocks(int64_t M) : M(M), n((M + MR - 1) / MR) {}
    int64_t start(int64_t b) const { return b * M / n; }
};

// panel j0 of B from W[N][K] (nn.Linear weight, i.e. B = W^T)
static inline void pack_b_nk(const float* w, int64_t N, int64_t K, int64_t j0, float* dst) {
    for (int64_t c = 0; c < NR; ++c) {
        const float* src = w + (j0 + c) * K;
        if (j0 + c < N) for (int64_t k = 0; k < K; ++k) dst[k * NR + c] = src[k];
        else for (int64_t k = 0; k < K; ++k) dst[k * NR + c] = 0.f;
    }
}

// a(r, k) = A[(r0 + r) * lda + k], optionally times rs[r0 + r] then cs[k]
static inline void pack_a(const float* A, int64_t lda, int64_t r0, int64_t mr, int64_t K, float* dst,
                          const float* rs = nullptr, const float* cs = nullptr) {
    for (int64_t r = 0; r < mr; ++r) {
        const float* a = A + (r0 + r) * lda;
        if (!rs) for (int64_t k = 0; k < K; ++k) dst[k * mr + r] = a[k];
        else { float s = rs[r0 + r]; for (int64_t k = 0; k < K; ++k) dst[k * mr + r] = a[k] * s * cs[k]; }
    }
}

// epi(v, row, col, mask) -> value to store for VW columns starting at col
template <int R, class Epi>
static inline void ukernel(int64_t K, const float* a, const float* b, float* C, int64_t ldc,
                           int64_t i0, int64_t j0, int64_t nc, const Epi& epi) {
    vf c0[R], c1[R];
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = vzero();
    for (int64_t k = 0; k < K; ++k, a += R, b += NR) {
        vf b0 = vload(b), b1 = vload(b + VW);
#pragma GCC unroll 14
        for (int r = 0; r < R; ++r) {
            vf av = vset1(a[r]);
            c0[r] = vfmadd(av, b0, c0[r]);
            c1[r] = vfmadd(av, b1, c1[r]);
        }
    }
    vmask m0 = tail_mask(nc), m1 = nc > VW ? tail_mask(nc - VW) : 0;
    for (int r = 0; r < R; ++r) {
        float* c = C + (i0 + r) * ldc + j0;
        vmask_storeu(c, m0, epi(c0[r], i0 + r, j0, m0));
        if (m1) vmask_storeu(c + VW, m1, epi(c1[r], i0 + r, j0 + VW, m1));
    }
}

// rows [i0, i0+mr) of C, all N columns; ap is the packed A block
template <class Epi>
static inline void gemm_rows(int64_t i0, int64_t mr, int64_t N, int64_t K, const float* ap, const float* Bp,
                             float* C, int64_t ldc, const Epi& epi) {
    for (int64_t j0 = 0; j0 < N; j0 += NR) {
        const float* bp = Bp + j0 * K;
        int64_t nc = std::min(NR, N - j0);
        switch (mr) {
#define UK(R) case R: if constexpr (R <= MR) ukernel<R>(K, ap, bp, C, ldc, i0, j0, nc, epi); break;
            UK(1) UK(2) UK(3) UK(4) UK(5) UK(6) UK(7) UK(8) UK(9) UK(10) UK(11) UK(12) UK(13) UK(14)
#undef UK
        }
    }
}

// Full linear-layer GEMM: C[M,N] = epi(x[M,K] W[N,K]^T); post(i0, mr) runs on each finished row block.
template <class Epi, class Post>
static inline void linear_gemm(const float* x, const float* w, float* C, int64_t M, int64_t K, int64_t N,
                               const Epi& epi, const Post& post, const float* rs = nullptr, const float* cs = nullptr) {
    int64_t np = (N + NR - 1) / NR;
    RowBlocks rb(M);
    float* Bp = scratch(0, np * NR * K);
    float* Ap = scratch(1, M * K);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < np; ++p) pack_b_nk(w, N, K, p * NR, Bp + p * NR * K);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < rb.n; ++b) {
            int64_t i0 = rb.start(b), mr = rb.start(b + 1) - i0;
            float* ap = Ap + i0 * K;
            pack_a(x, K, i0, mr, K, ap, rs, cs);
            gemm_rows(i0, mr, N, K, ap, Bp, C, N, epi);
            post(i0, mr);
        }
    }
}

struct NoPost { void operator()(int64_t, int64_t) const {} };
