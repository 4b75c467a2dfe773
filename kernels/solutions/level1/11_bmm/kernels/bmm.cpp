#include <cstdlib>
#include <omp.h>
#include "sgemm_pack.h"
using namespace gemm;

// One batch per thread at a time; each thread packs its own A and B blocks.
extern "C" void bmm(float* C, const float* A, const float* B, int64_t batch, int64_t M, int64_t N, int64_t K) {
    const int64_t nib = (M + MR - 1) / MR, njp = (N + NR - 1) / NR;
    #pragma omp parallel
    {
        const int t = omp_get_thread_num();
        float* Ap = scratch(2 * t, nib * MR * KC);
        float* Bp = scratch(2 * t + 1, njp * NR * KC);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            const float* a = A + b * M * K;
            const float* bb = B + b * K * N;
            float* c = C + b * M * N;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = std::min(KC, K - k0);
                pack_a(Ap, a, K, M, k0, kc, 0, nib);
                pack_b(Bp, bb, N, N, k0, kc, 0, njp);
                compute(c, N, M, N, Ap, Bp, kc, 0, njp, k0 > 0);
            }
        }
    }
}
