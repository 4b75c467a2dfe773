// y = gelu_erf(layernorm(x) * w + b) + x, one block of 256 threads per row, one pass over memory:
// the row is held in registers (float4, VPT per thread), mean and variance by two block reductions.
// Generic fallback (D % 4 != 0, misaligned, or D > 16384): same math re-reading the row from global.
#include <cstdint>
#include <cuda_runtime.h>
#include <math.h>

namespace {
constexpr int NT = 256;

__device__ __forceinline__ float gelu_erf(float v) { return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)); }

__device__ __forceinline__ float block_sum(float v, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < NT / 32; ++i) t += sh[i];
    return t;
}

template <int VPT>
__global__ void __launch_bounds__(NT)
ln_reg(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
       int64_t D, float eps) {
    __shared__ float sh1[NT / 32], sh2[NT / 32];
    const int64_t row = blockIdx.x;
    const int64_t D4 = D / 4;
    const float4* xr = reinterpret_cast<const float4*>(x + row * D);
    float4* yr = reinterpret_cast<float4*>(y + row * D);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const float4* b4 = reinterpret_cast<const float4*>(b);
    float4 v[VPT];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int64_t idx = threadIdx.x + (int64_t)i * NT;
        v[i] = idx < D4 ? __ldg(xr + idx) : make_float4(0.f, 0.f, 0.f, 0.f);
        s += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    }
    const float mean = block_sum(s, sh1) / (float)D;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int64_t idx = threadIdx.x + (int64_t)i * NT;
        if (idx < D4) {
            const float a = v[i].x - mean, bb = v[i].y - mean, c = v[i].z - mean, d = v[i].w - mean;
            q += (a * a + bb * bb) + (c * c + d * d);
        }
    }
    const float rstd = rsqrtf(block_sum(q, sh2) / (float)D + eps);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int64_t idx = threadIdx.x + (int64_t)i * NT;
        if (idx < D4) {
            const float4 ww = __ldg(w4 + idx), bb = __ldg(b4 + idx), xv = v[i];
            float4 o;
            o.x = gelu_erf(fmaf((xv.x - mean) * rstd, ww.x, bb.x)) + xv.x;
            o.y = gelu_erf(fmaf((xv.y - mean) * rstd, ww.y, bb.y)) + xv.y;
            o.z = gelu_erf(fmaf((xv.z - mean) * rstd, ww.z, bb.z)) + xv.z;
            o.w = gelu_erf(fmaf((xv.w - mean) * rstd, ww.w, bb.w)) + xv.w;
            yr[idx] = o;
        }
    }
}

__global__ void __launch_bounds__(NT)
ln_generic(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
           int64_t D, float eps) {
    __shared__ float sh1[NT / 32], sh2[NT / 32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * D;
    float* yr = y + row * D;
    float s = 0.f;
    for (int64_t i = threadIdx.x; i < D; i += NT) s += xr[i];
    const float mean = block_sum(s, sh1) / (float)D;
    float q = 0.f;
    for (int64_t i = threadIdx.x; i < D; i += NT) { const float d = xr[i] - mean; q += d * d; }
    const float rstd = rsqrtf(block_sum(q, sh2) / (float)D + eps);
    for (int64_t i = threadIdx.x; i < D; i += NT) {
        const float xv = xr[i];
        yr[i] = gelu_erf(fmaf((xv - mean) * rstd, w[i], b[i])) + xv;
    }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
}  // namespace

extern "C" void ln_gelu_res(float* y, const float* x, const float* w, const float* b, int64_t M, int64_t D,
                            double eps, cudaStream_t stream) {
    if (M <= 0 || D <= 0) return;
    const float e = (float)eps;
    const bool vec = D % 4 == 0 && aligned16(y) && aligned16(x) && aligned16(w) && aligned16(b);
    const int64_t D4 = D / 4;
    const unsigned grid = (unsigned)M;
    if (vec && D4 <= NT * 1)       ln_reg<1><<<grid, NT, 0, stream>>>(y, x, w, b, D, e);
    else if (vec && D4 <= NT * 2)  ln_reg<2><<<grid, NT, 0, stream>>>(y, x, w, b, D, e);
    else if (vec && D4 <= NT * 4)  ln_reg<4><<<grid, NT, 0, stream>>>(y, x, w, b, D, e);
    else if (vec && D4 <= NT * 8)  ln_reg<8><<<grid, NT, 0, stream>>>(y, x, w, b, D, e);
    else if (vec && D4 <= NT * 16) ln_reg<16><<<grid, NT, 0, stream>>>(y, x, w, b, D, e);
    else                           ln_generic<<<grid, NT, 0, stream>>>(y, x, w, b, D, e);
}
