// Packed SGEMM building blocks: C[M,N] (+)= A[M,K] @ B[K,N], row-major, 6x64 AVX-512 micro-tile.
#pragma once
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <algorithm>
#include <immintrin.h>

namespace gemm {
// KC = 384 with each k block summed from zero and then added to C reproduces MKL's rounding order.
constexpr int64_t MR = 6, NR = 64, KC = 384;

// Ap[ib][k][r] = A[ib*MR + r][k0 + k] (rows past M are zero).
static inline void pack_a(float* Ap, const float* A, int64_t lda, int64_t M, int64_t k0, int64_t kc,
                          int64_t ib0, int64_t ib1) {
    for (int64_t ib = ib0; ib < ib1; ++ib) {
        float* d = Ap + ib * kc * MR;
        for (int64_t r = 0; r < MR; ++r) {
            const int64_t i = ib * MR + r;
            if (i < M) {
                const float* s = A + i * lda + k0;
                for (int64_t k = 0; k < kc; ++k) d[k * MR + r] = s[k];
            } else {
                for (int64_t k = 0; k < kc; ++k) d[k * MR + r] = 0.f;
            }
        }
    }
}

// Bp[jp][k][c] = B[k0 + k][jp*NR + c] for panels jp in [jp0, jp1) (cols past N are zero).
static inline void pack_b(float* Bp, const float* B, int64_t ldb, int64_t N, int64_t k0, int64_t kc,
                          int64_t jp0, int64_t jp1) {
    for (int64_t jp = jp0; jp < jp1; ++jp) {
        float* d = Bp + (jp - jp0) * kc * NR;
        const int64_t j0 = jp * NR, nc = std::min(NR, N - j0);
        for (int64_t k = 0; k < kc; ++k) {
            const float* s = B + (k0 + k) * ldb + j0;
            if (nc == NR) std::memcpy(d + k * NR, s, NR * sizeof(float));
            else {
                for (int64_t c = 0; c < nc; ++c) d[k * NR + c] = s[c];
                for (int64_t c = nc; c < NR; ++c) d[k * NR + c] = 0.f;
            }
        }
    }
}

static inline void micro(int64_t kc, const float* Ap, const float* Bp, float* C, int64_t ldc, bool acc) {
#ifdef __AVX512F__
    constexpr int NV = NR / 16;
    __m512 c[MR][NV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) c[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
        __m512 b[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) b[v] = _mm512_load_ps(Bp + k * NR + 16 * v);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const __m512 a = _mm512_set1_ps(Ap[k * MR + r]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            if (acc) c[r][v] = _mm512_add_ps(_mm512_loadu_ps(C + r * ldc + 16 * v), c[r][v]);
            _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
        }
#else
    float c[MR][NR];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NR; ++j) c[r][j] = 0.f;
    for (int64_t k = 0; k < kc; ++k)
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NR; ++j) c[r][j] += Ap[k * MR + r] * Bp[k * NR + j];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NR; ++j) C[r * ldc + j] = acc ? C[r * ldc + j] + c[r][j] : c[r][j];
#endif
}

// C[:, panels jp0..jp1) (+)= Ap (all row blocks) x Bp (those panels), for one k block.
static inline void compute(float* C, int64_t ldc, int64_t M, int64_t N, const float* Ap, const float* Bp,
                           int64_t kc, int64_t jp0, int64_t jp1, bool acc) {
    const int64_t nib = (M + MR - 1) / MR;
    alignas(64) float tmp[MR * NR];
    for (int64_t jp = jp0; jp < jp1; ++jp) {
        const float* bp = Bp + (jp - jp0) * kc * NR;
        const int64_t j0 = jp * NR, nc = std::min(NR, N - j0);
        for (int64_t ib = 0; ib < nib; ++ib) {
            const int64_t i0 = ib * MR, nr = std::min(MR, M - i0);
            float* c = C + i0 * ldc + j0;
            if (nr == MR && nc == NR) { micro(kc, Ap + ib * kc * MR, bp, c, ldc, acc); continue; }
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t j = 0; j < nc; ++j) tmp[r * NR + j] = acc ? c[r * ldc + j] : 0.f;
            micro(kc, Ap + ib * kc * MR, bp, tmp, NR, acc);
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t j = 0; j < nc; ++j) c[r * ldc + j] = tmp[r * NR + j];
        }
    }
}

// Persistent 64-byte aligned scratch buffers (fresh allocations would page-fault on every call).
static inline float* scratch(int slot, int64_t n) {
    static float* buf[256] = {};
    static int64_t cap[256] = {};
    if (cap[slot] < n) {
        std::free(buf[slot]);
        buf[slot] = static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
        cap[slot] = n;
    }
    return buf[slot];
}
}  // namespace gemm
