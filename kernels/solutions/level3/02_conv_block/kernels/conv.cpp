// 3x3 same-padding convolution (im2col + GEMM with fused bias/ReLU) and 2x2 max pooling, NCHW.
#include "gemm_epi.h"
#include <algorithm>
#include <cstring>
#include <omp.h>
#include <vector>

// col[(c*9 + kh*3 + kw), h*W + w] = x[c, h+kh-1, w+kw-1] (zero outside the image)
static void im2col3x3(const float* x, int64_t C, int64_t H, int64_t W, float* col) {
    for (int64_t c = 0; c < C; ++c)
        for (int64_t kh = 0; kh < 3; ++kh)
            for (int64_t kw = 0; kw < 3; ++kw) {
                float* dst = col + ((c * 3 + kh) * 3 + kw) * H * W;
                for (int64_t h = 0; h < H; ++h, dst += W) {
                    int64_t ih = h + kh - 1;
                    if (ih < 0 || ih >= H) { std::memset(dst, 0, W * sizeof(float)); continue; }
                    const float* src = x + (c * H + ih) * W;
                    int64_t lo = std::max<int64_t>(0, 1 - kw), hi = std::min<int64_t>(W, W + 1 - kw);
                    for (int64_t w = 0; w < lo; ++w) dst[w] = 0.f;
                    for (int64_t w = lo; w < hi; ++w) dst[w] = src[w + kw - 1];
                    for (int64_t w = hi; w < W; ++w) dst[w] = 0.f;
                }
            }
}

extern "C" void conv3x3_relu(float* out, const float* x, const float* w, const float* b,
                             int64_t batch, int64_t cin, int64_t cout, int64_t H, int64_t W) {
    const int64_t K = cin * 9, HW = H * W;
    Epilogue e;
    e.bias = b; e.bias_mode = BIAS_ROW; e.act = ACT_RELU;
    if (batch >= omp_get_max_threads()) {
#pragma omp parallel
        {
            std::vector<float> col(K * HW);
#pragma omp for schedule(static)
            for (int64_t n = 0; n < batch; ++n) {
                im2col3x3(x + n * cin * HW, cin, H, W, col.data());
                gemm_serial(cout, HW, K, w, K, col.data(), HW, false, out + n * cout * HW, HW, e);
            }
        }
    } else {
        std::vector<float> col(K * HW);
        for (int64_t n = 0; n < batch; ++n) {
            im2col3x3(x + n * cin * HW, cin, H, W, col.data());
            gemm(cout, HW, K, w, K, col.data(), HW, false, out + n * cout * HW, HW, e);
        }
    }
}

extern "C" void maxpool2x2(float* out, const float* x, int64_t planes, int64_t H, int64_t W) {
    const int64_t Ho = H / 2, Wo = W / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < planes; ++p)
        for (int64_t i = 0; i < Ho; ++i) {
            const float* r0 = x + (p * H + 2 * i) * W;
            const float* r1 = r0 + W;
            float* o = out + (p * Ho + i) * Wo;
            for (int64_t j = 0; j < Wo; ++j)
                o[j] = std::max(std::max(r0[2 * j], r0[2 * j + 1]), std::max(r1[2 * j], r1[2 * j + 1]));
        }
}
