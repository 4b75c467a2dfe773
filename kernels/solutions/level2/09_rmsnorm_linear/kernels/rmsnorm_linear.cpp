#include "gemm.h"
#include <cmath>

// Row scales 1/sqrt(mean(x^2) + eps) first; the normalization is applied while packing A.
extern "C" void rmsnorm_linear(float* out, const float* x, const float* g, const float* w, const float* bias,
                               int64_t M, int64_t K, int64_t N, double eps) {
    float* rs = scratch(2, M);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
        const float* row = x + i * K;
        vf acc = vzero();
        for (int64_t k = 0; k < K; k += VW) {
            vf v = vmaskz_loadu(tail_mask(K - k), row + k);
            acc = vfmadd(v, v, acc);
        }
        rs[i] = 1.f / std::sqrt(vreduce_add(acc) / (float)K + (float)eps);
    }
    auto epi = [=](vf v, int64_t, int64_t j, vmask m) {
        return vadd(v, vmaskz_loadu(m, bias + j));
    };
    linear_gemm(x, w, out, M, K, N, epi, NoPost(), rs, g);
}
