// LayerNorm over the last dim (biased variance, affine). One block per row with the row held in
// registers (NT threads x NV float4): mean, then centered variance from the registers, then
// (x - mean) * rstd * w + b -- one HBM read and one write per element. Scalar fallback otherwise.
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
// Blocks kept resident per SM: 2048 threads (32 registers each) while a thread holds <= 4 float4,
// else 128 KB of row registers (e.g. two 16384-float rows).
constexpr int min_blocks(int nt, int nv) { return nv <= 4 ? 2048 / nt : (nt * nv >= 8192 ? 1 : 8192 / (nt * nv)); }

template <int NT, int NV>
__global__ void __launch_bounds__(NT, min_blocks(NT, NV))
ln_reg(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
       float eps, int64_t cols) {
    __shared__ float sh_a[NT / 32], sh_b[NT / 32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * cols;
    float* orow = out + row * cols;
    const int nv4 = (int)(cols >> 2);
    float4 v[NV];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int idx = threadIdx.x + i * NT;
        v[i] = idx < nv4 ? ld4(xr + 4 * (int64_t)idx) : make_float4(0.f, 0.f, 0.f, 0.f);
        s += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    }
    const float mean = block_sum<NT>(s, sh_a) / (float)cols;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int idx = threadIdx.x + i * NT;
        if (idx < nv4) {
            v[i].x -= mean; v[i].y -= mean; v[i].z -= mean; v[i].w -= mean;
            q += (v[i].x * v[i].x + v[i].y * v[i].y) + (v[i].z * v[i].z + v[i].w * v[i].w);
        }
    }
    const float rstd = rsqrtf(block_sum<NT>(q, sh_b) / (float)cols + eps);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int idx = threadIdx.x + i * NT;
        if (idx < nv4) {
            const float4 wv = __ldg(reinterpret_cast<const float4*>(w) + idx);
            const float4 bv = __ldg(reinterpret_cast<const float4*>(b) + idx);
            st4(orow + 4 * (int64_t)idx, make_float4(v[i].x * rstd * wv.x + bv.x, v[i].y * rstd * wv.y + bv.y,
                                                     v[i].z * rstd * wv.z + bv.z, v[i].w * rstd * wv.w + bv.w));
        }
    }
}

constexpr int FB = 256;
__global__ void __launch_bounds__(FB) ln_fallback(float* __restrict__ out, const float* __restrict__ x,
                                                  const float* __restrict__ w, const float* __restrict__ b,
                                                  float eps, int64_t cols) {
    __shared__ float sh_a[FB / 32], sh_b[FB / 32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * cols;
    float* orow = out + row * cols;
    float s = 0.f;
    for (int64_t i = threadIdx.x; i < cols; i += FB) s += xr[i];
    const float mean = block_sum<FB>(s, sh_a) / (float)cols;
    float q = 0.f;
    for (int64_t i = threadIdx.x; i < cols; i += FB) { const float d = xr[i] - mean; q += d * d; }
    const float rstd = rsqrtf(block_sum<FB>(q, sh_b) / (float)cols + eps);
    for (int64_t i = threadIdx.x; i < cols; i += FB) orow[i] = (xr[i] - mean) * rstd * w[i] + b[i];
}

template <int NT>
bool launch_reg(float* out, const float* x, const float* w, const float* b, float eps, int64_t rows, int64_t cols, int64_t nv4, cudaStream_t st) {
    const int64_t nv = (nv4 + NT - 1) / NT;
    if (nv <= 1) ln_reg<NT, 1><<<(unsigned)rows, NT, 0, st>>>(out, x, w, b, eps, cols);
    else if (nv <= 2) ln_reg<NT, 2><<<(unsigned)rows, NT, 0, st>>>(out, x, w, b, eps, cols);
    else if (nv <= 4) ln_reg<NT, 4><<<(unsigned)rows, NT, 0, st>>>(out, x, w, b, eps, cols);
    else if (nv <= 8) ln_reg<NT, 8><<<(unsigned)rows, NT, 0, st>>>(out, x, w, b, eps, cols);
    else if (nv <= 16) ln_reg<NT, 16><<<(unsigned)rows, NT, 0, st>>>(out, x, w, b, eps, cols);
    else return false;
    return true;
}
}  // namespace

extern "C" void layernorm_rows(float* out, const float* x, const float* w, const float* b, int64_t rows, int64_t cols, double eps_d, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) return;
    const int64_t nv4 = cols / 4;
    if (cols % 4 == 0 && aligned16(x) && aligned16(out) && aligned16(w) && aligned16(b)) {
        if (nv4 <= 512 ? launch_reg<128>(out, x, w, b, (float)eps_d, rows, cols, nv4, stream)
                       : launch_reg<512>(out, x, w, b, (float)eps_d, rows, cols, nv4, stream))
            return;
    }
    ln_fallback<<<(unsigned)rows, FB, 0, stream>>>(out, x, w, b, (float)eps_d, cols);
}
