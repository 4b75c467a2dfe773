#include "vmath.h"
#include <algorithm>

// x[B][C][L]: per (b, 256-wide column block) sum over C, then tanh(x * C / sum) while the block is in L2.
extern "C" void mean_div_tanh(float* y, const float* x, int64_t B, int64_t C, int64_t L) {
    constexpr int64_t LB = 256;
    int64_t nl = (L + LB - 1) / LB;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t lb = 0; lb < nl; ++lb) {
            int64_t l0 = lb * LB, w = std::min(LB, L - l0);
            const float* xb = x + b * C * L + l0;
            float* yb = y + b * C * L + l0;
            alignas(64) float inv[LB];
            for (int64_t j = 0; j < w; j += VW) {
                vmask m = tail_mask(w - j);
                vf s = vzero();
                for (int64_t c = 0; c < C; ++c) s = vadd(s, vmaskz_loadu(m, xb + c * L + j));
                vstore(inv + j, vdiv(vset1(1.f), vdiv(s, vset1((float)C))));
            }
            for (int64_t c = 0; c < C; ++c)
                for (int64_t j = 0; j < w; j += VW) {
                    vmask m = tail_mask(w - j);
                    vf v = vmul(vmaskz_loadu(m, xb + c * L + j), vload(inv + j));
                    vmask_storeu(yb + c * L + j, m, vtanh(v));
                }
        }
}
