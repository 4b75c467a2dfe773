#include <cstdlib>
#include <omp.h>
#include "sgemm_pack.h"
using namespace gemm;

// Threads share the packed A block and each owns a contiguous range of 32-column panels of C.
extern "C" void matmul(float* C, const float* A, const float* B, int64_t M, int64_t N, int64_t K) {
    const int64_t nib = (M + MR - 1) / MR, njp = (N + NR - 1) / NR;
    float* Ap = scratch(0, nib * MR * KC);
    #pragma omp parallel
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t jp0 = njp * t / T, jp1 = njp * (t + 1) / T;
        float* Bp = scratch(1 + (int)t, std::max<int64_t>(jp1 - jp0, 1) * NR * KC);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = std::min(KC, K - k0);
            #pragma omp for schedule(static)
            for (int64_t ib = 0; ib < nib; ++ib) pack_a(Ap, A, K, M, k0, kc, ib, ib + 1);
            pack_b(Bp, B, N, N, k0, kc, jp0, jp1);
            compute(C, N, M, N, Ap, Bp, kc, jp0, jp1, k0 > 0);
            #pragma omp barrier
        }
    }
}
