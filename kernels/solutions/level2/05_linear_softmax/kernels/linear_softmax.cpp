#include "gemm.h"
#include <cmath>

// GEMM + bias per row block, then softmax of those rows while they are still in cache.
extern "C" void linear_softmax(float* out, const float* x, const float* w, const float* bias,
                               int64_t M, int64_t K, int64_t N) {
    auto epi = [=](vf v, int64_t, int64_t j, vmask m) {
        return vadd(v, vmaskz_loadu(m, bias + j));
    };
    auto post = [=](int64_t i0, int64_t mr) {
        for (int64_t i = i0; i < i0 + mr; ++i) {
            float* row = out + i * N;
            vf mx = vset1(-INFINITY);
            for (int64_t j = 0; j < N; j += VW)
                mx = vmask_max(mx, tail_mask(N - j), mx, vmaskz_loadu(tail_mask(N - j), row + j));
            vf vm = vset1(vreduce_max(mx)), sum = vzero();
            for (int64_t j = 0; j < N; j += VW) {
                vmask m = tail_mask(N - j);
                vf e = vexp(vsub(vmaskz_loadu(m, row + j), vm));
                vmask_storeu(row + j, m, e);
                sum = vmask_add(sum, m, sum, e);
            }
            vf inv = vset1(1.f / vreduce_add(sum));
            for (int64_t j = 0; j < N; j += VW) {
                vmask m = tail_mask(N - j);
                vmask_storeu(row + j, m, vmul(vmaskz_loadu(m, row + j), inv));
            }
        }
    };
    linear_gemm(x, w, out, M, K, N, epi, post);
}
