#include "vmath.h"
#include <cmath>

// One pass per row (row stays in L1): mean, variance, then gelu(norm(x)) + x.
extern "C" void ln_gelu_res(float* y, const float* x, const float* w, const float* b, int64_t M, int64_t D, double eps) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
        const float* xr = x + i * D;
        float* yr = y + i * D;
        vf s = vzero();
        for (int64_t j = 0; j < D; j += VW) s = vadd(s, vmaskz_loadu(tail_mask(D - j), xr + j));
        vf mean = vset1(vreduce_add(s) / (float)D), q = vzero();
        for (int64_t j = 0; j < D; j += VW) {
            vmask m = tail_mask(D - j);
            vf d = vmaskz_sub(m, vmaskz_loadu(m, xr + j), mean);
            q = vfmadd(d, d, q);
        }
        vf rstd = vset1(1.f / std::sqrt(vreduce_add(q) / (float)D + (float)eps));
        for (int64_t j = 0; j < D; j += VW) {
            vmask m = tail_mask(D - j);
            vf v = vmaskz_loadu(m, xr + j);
            vf n = vmul(vsub(v, mean), rstd);
            n = vfmadd(n, vmaskz_loadu(m, w + j), vmaskz_loadu(m, b + j));
            vmask_storeu(yr + j, m, vadd(vgelu(n), v));
        }
    }
}
