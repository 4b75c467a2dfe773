// 2D max pooling (NCHW planes, -inf padding). Fast path for kernel 3 / stride 2 / padding 1 with w % 4 == 0:
// a thread owns one float4 column quad q of R consecutive output rows. It loads the 2R + 1 input rows of that
// quad at once (float4 each, rows shared by neighbouring output rows are read once), takes the element left
// of the quad from the neighbouring lane, and writes 2 adjacent outputs per row as a float2.
// Otherwise one thread per output loops over its clipped window.
#include <cstdint>
#include <cmath>
#include <cuda_runtime.h>

namespace {
constexpr int NT = 256;
constexpr int R = 4;  // output rows per thread in the fast path

// thread t: quad q = t % qn of row group g = t / qn; group g: plane g / ng, output rows (g % ng) * R + [0, R)
__global__ void __launch_bounds__(NT) maxpool_k3s2p1(float* __restrict__ out, const float* __restrict__ x,
                                                     unsigned total, unsigned qn, unsigned ng, int h, int w, int oh,
                                                     int ow) {
    const unsigned t = blockIdx.x * NT + threadIdx.x;
    const int lane = threadIdx.x & 31;
    const bool valid = t < total;
    const unsigned g = t / qn, q = t - g * qn;
    const unsigned pl = g / ng;
    const int oy0 = (int)(g - pl * ng) * R;
    const float* xq = x + (int64_t)pl * h * w + 4 * q;
    float4 v[2 * R + 1];
    float lft[2 * R + 1];
#pragma unroll
    for (int i = 0; i <= 2 * R; ++i) {
        const int iy = 2 * oy0 - 1 + i;
        const bool ok = valid && iy >= 0 && iy < h;
        v[i] = ok ? __ldg(reinterpret_cast<const float4*>(xq + (int64_t)iy * w))
                  : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        lft[i] = (ok && lane == 0 && q > 0) ? __ldg(xq + (int64_t)iy * w - 1) : -INFINITY;
    }
    float c0[2 * R + 1], c1[2 * R + 1];  // row maxima over the windows of outputs 2q and 2q + 1
#pragma unroll
    for (int i = 0; i <= 2 * R; ++i) {
        const float up = __shfl_up_sync(0xffffffffu, v[i].w, 1);  // lane - 1 holds quad q - 1 when q > 0
        const float left = lane == 0 ? lft[i] : (q > 0 ? up : -INFINITY);
        c0[i] = fmaxf(left, fmaxf(v[i].x, v[i].y));
        c1[i] = fmaxf(v[i].y, fmaxf(v[i].z, v[i].w));
    }
    if (!valid) return;
    float2* op = reinterpret_cast<float2*>(out + ((int64_t)pl * oh + oy0) * ow) + q;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (oy0 + r >= oh) break;
        __stcs(op + (int64_t)r * (ow / 2), make_float2(fmaxf(c0[2 * r], fmaxf(c0[2 * r + 1], c0[2 * r + 2])),
                                                       fmaxf(c1[2 * r], fmaxf(c1[2 * r + 1], c1[2 * r + 2]))));
    }
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
    const int64_t qn = w / 4, ng = (oh + R - 1) / R, total = planes * ng * qn;
    if (fast && total <= 0xFFFFFFFFLL - NT && h * w < 2147483647LL) {
        maxpool_k3s2p1<<<(unsigned)((total + NT - 1) / NT), NT, 0, stream>>>(
            out, x, (unsigned)total, (unsigned)qn, (unsigned)ng, (int)h, (int)w, (int)oh, (int)ow);
        return;
    }
    int64_t blocks = (planes * oh * ow + NT - 1) / NT;
    if (blocks > cap) blocks = cap;
    maxpool_generic<<<(unsigned)blocks, NT, 0, stream>>>(out, x, planes, h, w, oh, ow, k, s, p);
}
