#include "gemm.h"

extern "C" void linear_gelu_scale(float* out, const float* x, const float* w, const float* bias,
                                  int64_t M, int64_t K, int64_t N, double scale) {
    vf s = vset1((float)scale);
    auto epi = [=](vf v, int64_t, int64_t j, vmask m) {
        return vmul(vgelu(vadd(v, vmaskz_loadu(m, bias + j))), s);
    };
    linear_gemm(x, w, out, M, K, N, epi, NoPost());
}
