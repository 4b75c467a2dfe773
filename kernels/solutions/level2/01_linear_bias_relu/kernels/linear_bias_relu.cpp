#include "gemm.h"

extern "C" void linear_bias_relu(float* out, const float* x, const float* w, const float* b1, const float* b2,
                                 int64_t M, int64_t K, int64_t N) {
    auto epi = [=](vf v, int64_t, int64_t j, vmask m) {
        vf b = vadd(vmaskz_loadu(m, b1 + j), vmaskz_loadu(m, b2 + j));
        return vmax(vadd(v, b), vzero());
    };
    linear_gemm(x, w, out, M, K, N, epi, NoPost());
}
