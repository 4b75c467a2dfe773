// 2D max pooling (NCHW planes, -inf padding). Fast path for kernel 3 / stride 2 / padding 1 with
// w % 4 == 0: each thread (block = one output row) produces two adjacent outputs from one float4 (plus the
// element to its left) of each of the 3 input rows, and writes them as a float2. Otherwise one
// thread per output loops over its clipped window.
#include <cstdint>
#include <cmath>
#include <cuda_runtime.h>

namespace {
constexpr int NT = 256;

constexpr int NTX = 128;
// grid.x = planes * oh output rows, grid.y * NTX >= w / 4 output pairs per row
__global__ void __launch_bounds__(NTX) maxpool_k3s2p1(float* __restrict__ out, const float* __restrict__ x,
                                                      int h, int w, int oh, int ow) {
    const int qn = w >> 2;
    const int q = blockIdx.y * NTX + threadIdx.x;
    if (q >= qn) return;
    const unsigned r32 = blockIdx.x;  // plane * oh + oy
    const int oy = (int)(r32 % (unsigned)oh);
    const int64_t pl = r32 / (unsigned)oh, r = r32;
    const float* xp = x + pl * h * (int64_t)w;
    float m0 = -INFINITY, m1 = -INFINITY;
    const int iy0 = 2 * oy - 1;
#pragma unroll
    for (int dy = 0; dy < 3; ++dy) {
        const int iy = iy0 + dy;
        if (iy < 0 || iy >= h) continue;
        const float* row = xp + (int64_t)iy * w;
        const float4 v = __ldg(reinterpret_cast<const float4*>(row) + q);
        const float left = q > 0 ? __ldg(row + 4 * q - 1) : -INFINITY;
        m0 = fmaxf(m0, fmaxf(left, fmaxf(v.x, v.y)));
        m1 = fmaxf(m1, fmaxf(v.y, fmaxf(v.z, v.w)));
    }
    __stcs(reinterpret_cast<float2*>(out + r * ow) + q, make_float2(m0, m1));
}

__global__ void __launch_bounds__(NT) maxpool_generic(float* __restrict__ out, const float* __restrict__ x,
                                                      int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                                      int64_t k, int64_t s, int64_t p) {
    const int64_t total = planes * oh * ow;
    const int64_t stride = (int64_t)gridDim.x * NT;
    for (int64_t t = (int64_t)blockIdx.x * NT + threadIdx.x; t < total; t += stride) {
        const int64_t ox = t % ow;
        const int64_t r = t / ow;
        const int64_t oy = r % oh, pl = r / oh;
        const float* xp = x + pl * h * w;
        const int64_t y0 = oy * s - p, x0 = ox * s - p;
        float m = -INFINITY;
        for (int64_t dy = 0; dy < k; ++dy) {
            const int64_t iy = y0 + dy;
            if (iy < 0 || iy >= h) continue;
            for (int64_t dx = 0; dx < k; ++dx) {
                const int64_t ix = x0 + dx;
                if (ix < 0 || ix >= w) continue;
                m = fmaxf(m, __ldg(xp + iy * w + ix));
            }
        }
        out[t] = m;
    }
}
}  // namespace

extern "C" void maxpool2d(float* out, const float* x, int64_t planes, int64_t h, int64_t w,
                          int64_t oh, int64_t ow, int64_t k, int64_t s, int64_t p, cudaStream_t stream) {
    if (planes <= 0 || oh <= 0 || ow <= 0) return;
    int dev = 0, sms = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t cap = (int64_t)sms * 8 * 8;
    const bool fast = k == 3 && s == 2 && p == 1 && w % 4 == 0 && ow * 2 == w && oh == (h - 1) / 2 + 1 &&
                      ((reinterpret_cast<uintptr_t>(x) & 15) == 0) && ((reinterpret_cast<uintptr_t>(out) & 7) == 0);
    if (fast && planes * oh <= 2147483647LL && w < 2147483647LL / 4) {
        dim3 grid((unsigned)(planes * oh), (unsigned)((w / 4 + NTX - 1) / NTX));
        maxpool_k3s2p1<<<grid, NTX, 0, stream>>>(out, x, (int)h, (int)w, (int)oh, (int)ow);
        return;
    }
    int64_t blocks = (planes * oh * ow + NT - 1) / NT;
    if (blocks > cap) blocks = cap;
    maxpool_generic<<<(unsigned)blocks, NT, 0, stream>>>(out, x, planes, h, w, oh, ow, k, s, p);
}
