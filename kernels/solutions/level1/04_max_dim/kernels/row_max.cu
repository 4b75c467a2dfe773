// Row max over the last dim (values only). One 256-thread block per row streams the row with
// float4 loads (4 independent loads in flight per thread), then warp-shuffle + shared-memory max.
// Capped at 32 registers so 8 blocks (2048 threads, 128 KB of loads in flight) stay resident per SM.
// Scalar loop when the row is not float4-aligned.
#include <cstdint>
#include <cuda_runtime.h>

// helpers have external (inline) linkage so unused ones draw no warning
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide reductions; `sh` must hold NT/32 floats and must not be reused before the next
// __syncthreads (each call site uses its own array).
template <int NT>
__device__ __forceinline__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) s += sh[w];
    return s;
}
template <int NT>
__device__ __forceinline__ float block_max(float v, float* sh) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = sh[0];
#pragma unroll
    for (int w = 1; w < NT / 32; ++w) m = fmaxf(m, sh[w]);
    return m;
}
__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

namespace {
__device__ __forceinline__ float max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }

constexpr int NT = 256;
template <bool VEC>
__global__ void __launch_bounds__(NT, 8) row_max_kernel(float* __restrict__ out, const float* __restrict__ x, int64_t cols) {
    __shared__ float sh[NT / 32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * cols;
    float m = -INFINITY;
    if (VEC) {
        const float4* p = reinterpret_cast<const float4*>(xr) + threadIdx.x;
        const int64_t n = (cols >> 2) - threadIdx.x;  // float4s left from p onwards, strided by NT
        int64_t i = 0;
        for (; i + 3 * NT < n; i += 4 * NT) {
            const float4 a = p[i], b = p[i + NT];
            const float4 c = p[i + 2 * NT], d = p[i + 3 * NT];
            m = fmaxf(m, fmaxf(fmaxf(max4(a), max4(b)), fmaxf(max4(c), max4(d))));
        }
        for (; i < n; i += NT) {
            m = fmaxf(m, max4(p[i]));
        }
    } else {
        for (int64_t i = threadIdx.x; i < cols; i += NT) m = fmaxf(m, xr[i]);
    }
    m = block_max<NT>(m, sh);
    if (threadIdx.x == 0) out[row] = m;
}
}  // namespace

extern "C" void row_max(float* out, const float* x, int64_t rows, int64_t cols, cudaStream_t stream) {
    if (rows <= 0) return;
    if (cols % 4 == 0 && aligned16(x)) row_max_kernel<true><<<(unsigned)rows, NT, 0, stream>>>(out, x, cols);
    else row_max_kernel<false><<<(unsigned)rows, NT, 0, stream>>>(out, x, cols);
}
