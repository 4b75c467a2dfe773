#include "vmath.h"

// out = x * sigmoid(x) * scale + y = x / (1 + exp(-x)) * scale + y
extern "C" void swish_scale_add(float* out, const float* x, const float* y, int64_t n, double scale) {
    const vf s = vset1((float)scale), one = vset1(1.f);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i += VW) {
        vmask m = tail_mask(n - i);
        vf v = vmaskz_loadu(m, x + i);
        vf sw = vdiv(v, vadd(one, vexp(vsub(vzero(), v))));
        vmask_storeu(out + i, m, vfmadd(sw, s, vmaskz_loadu(m, y + i)));
    }
}
