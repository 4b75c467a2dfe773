// Row softmax over the last dim. One block per row with the whole row held in registers
// (NT threads x NV float4 each): one HBM read + one write per element. Block max, then
// sum of exp(x - max), then exp(x - max) * (1 / sum). Rows that do not fit in registers or
// are not float4-aligned use a three-pass scalar fallback.
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
__device__ __forceinline__ float4 ld4(const float* p) { return __ldcs(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ void st4(float* p, float4 v) { __stcs(reinterpret_cast<float4*>(p), v); }
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

namespace {
template <int NT, int NV>
__global__ void __launch_bounds__(NT) softmax_reg(float* __restrict__ out, const float* __restrict__ x, int64_t cols) {
    __shared__ float sh_m[NT / 32], sh_s[NT / 32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * cols;
    float* orow = out + row * cols;
    const int nv4 = (int)(cols >> 2);
    float4 v[NV];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int idx = threadIdx.x + i * NT;
        v[i] = idx < nv4 ? ld4(xr + 4 * (int64_t)idx) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        m = fmaxf(m, fmaxf(fmaxf(v[i].x, v[i].y), fmaxf(v[i].z, v[i].w)));
    }
    m = block_max<NT>(m, sh_m);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        v[i].x = __expf(v[i].x - m);
        v[i].y = __expf(v[i].y - m);
        v[i].z = __expf(v[i].z - m);
        v[i].w = __expf(v[i].w - m);
        s += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    }
    s = block_sum<NT>(s, sh_s);
    const float inv = 1.0f / s;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int idx = threadIdx.x + i * NT;
        if (idx < nv4) st4(orow + 4 * (int64_t)idx, make_float4(v[i].x * inv, v[i].y * inv, v[i].z * inv, v[i].w * inv));
    }
}

constexpr int FB = 256;
__global__ void __launch_bounds__(FB) softmax_fallback(float* __restrict__ out, const float* __restrict__ x, int64_t cols) {
    __shared__ float sh_m[FB / 32], sh_s[FB / 32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * cols;
    float* orow = out + row * cols;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < cols; i += FB) m = fmaxf(m, xr[i]);
    m = block_max<FB>(m, sh_m);
    float s = 0.f;
    for (int64_t i = threadIdx.x; i < cols; i += FB) s += __expf(xr[i] - m);
    s = block_sum<FB>(s, sh_s);
    const float inv = 1.0f / s;
    for (int64_t i = threadIdx.x; i < cols; i += FB) orow[i] = __expf(xr[i] - m) * inv;
}

template <int NT>
bool launch_reg(float* out, const float* x, int64_t rows, int64_t cols, int64_t nv4, cudaStream_t st) {
    const int64_t nv = (nv4 + NT - 1) / NT;
    if (nv <= 1) softmax_reg<NT, 1><<<(unsigned)rows, NT, 0, st>>>(out, x, cols);
    else if (nv <= 2) softmax_reg<NT, 2><<<(unsigned)rows, NT, 0, st>>>(out, x, cols);
    else if (nv <= 4) softmax_reg<NT, 4><<<(unsigned)rows, NT, 0, st>>>(out, x, cols);
    else if (nv <= 8) softmax_reg<NT, 8><<<(unsigned)rows, NT, 0, st>>>(out, x, cols);
    else if (nv <= 16) softmax_reg<NT, 16><<<(unsigned)rows, NT, 0, st>>>(out, x, cols);
    else return false;
    return true;
}
}  // namespace

extern "C" void softmax_rows(float* out, const float* x, int64_t rows, int64_t cols, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) return;
    const int64_t nv4 = cols / 4;
    if (cols % 4 == 0 && aligned16(x) && aligned16(out)) {
        if (nv4 <= 512 ? launch_reg<128>(out, x, rows, cols, nv4, stream)
                       : launch_reg<512>(out, x, rows, cols, nv4, stream))
            return;
    }
    softmax_fallback<<<(unsigned)rows, FB, 0, stream>>>(out, x, cols);
}
