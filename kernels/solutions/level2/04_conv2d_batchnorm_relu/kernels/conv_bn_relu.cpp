#include "conv.h"
#include <cmath>

// BatchNorm(eval) folded into a per-channel affine: relu(conv * s + t).
extern "C" void conv_bn_relu(float* y, const float* x, const float* w, const float* cb, const float* mean,
                             const float* var, const float* gamma, const float* beta, double eps,
                             int64_t B, int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t KH, int64_t KW) {
    float* st = scratch(2, 2 * Co);
    for (int64_t c = 0; c < Co; ++c) {
        float s = gamma[c] / std::sqrt(var[c] + (float)eps);
        st[c] = s;
        st[Co + c] = (cb[c] - mean[c]) * s + beta[c];
    }
    auto epi = [=](vf v, int64_t co) {
        v = vfmadd(v, vset1(st[co]), vset1(st[Co + co]));
        return vmax(v, vzero());
    };
    conv2d(y, x, w, B, Ci, H, W, Co, KH, KW, epi);
}
