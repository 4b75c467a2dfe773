// out[o][i] = scale * sum_r x[o][r][i]  (reduction over the middle axis of [outer, r, inner]).
// One pass over x. A 256-thread block owns a tile of contiguous inner columns of one outer slice:
// TX lanes (one float4 each when inner % 4 == 0) x 256/TX row groups striding over r, with U = 8
// independent loads in flight per thread. TX is the widest of 32/16/8 lanes (512/256/128 contiguous
// bytes per row) that still gives every SM ~3 blocks, so e.g. [64,1024,1024] over dim 1 and
// [8192,16384] over dim 0 both run as 512 co-resident blocks: no tail wave, no second pass.
// Each group of U rows is summed in fp32 and accumulated in double (a long fp32 chain over
// thousands of rows drifts ~1e-4 from the reference); row-group partials combine in shared memory
// in a fixed order, so results are deterministic. Only when even the narrowest tiles leave SMs
// idle is r also split over grid.y, the partials then combined by fp32 atomics into a zeroed output.
#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>

namespace {
constexpr int NT = 256, U = 8;

__device__ __forceinline__ void load(const float* p, float (&f)[4]) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}
__device__ __forceinline__ void load(const float* p, float (&f)[1]) { f[0] = *p; }

template <int VEC>
__global__ void __launch_bounds__(NT, 4)
sum_mid_kernel(float* __restrict__ out, const float* __restrict__ x, int64_t r, int64_t inner,
               int64_t ctiles, int64_t rchunk, int tx_log2, bool atomic, double scale) {
    const int tx = 1 << tx_log2, groups = NT >> tx_log2;
    const int lane = threadIdx.x & (tx - 1), g = threadIdx.x >> tx_log2;
    const int64_t o = blockIdx.x / ctiles;
    const int64_t c0 = (blockIdx.x - o * ctiles) * tx * VEC;  // first column of the tile
    const int64_t col = c0 + lane * VEC;                       // VEC=4 implies inner % 4 == 0
    const int64_t k1 = min(r, ((int64_t)blockIdx.y + 1) * rchunk);
    double acc[VEC];
#pragma unroll
    for (int c = 0; c < VEC; ++c) acc[c] = 0.0;
    if (col < inner) {
        const int64_t step = (int64_t)groups * inner;  // elements between this thread's rows
        int64_t k = (int64_t)blockIdx.y * rchunk + g;
        const float* p = x + (o * r + k) * inner + col;
        for (; k + (U - 1) * groups < k1; k += U * groups, p += U * step) {
            float v[U][VEC];
#pragma unroll
            for (int u = 0; u < U; ++u) load(p + u * step, v[u]);
#pragma unroll
            for (int c = 0; c < VEC; ++c)
                acc[c] += (double)(((v[0][c] + v[1][c]) + (v[2][c] + v[3][c])) +
                                   ((v[4][c] + v[5][c]) + (v[6][c] + v[7][c])));
        }
        for (; k < k1; k += groups, p += step) {
            float v[VEC];
            load(p, v);
#pragma unroll
            for (int c = 0; c < VEC; ++c) acc[c] += (double)v[c];
        }
    }
    __shared__ double part[NT * VEC];  // [row group][column of the tile]
    const int width = tx * VEC;
#pragma unroll
    for (int c = 0; c < VEC; ++c) part[threadIdx.x * VEC + c] = acc[c];
    __syncthreads();
    if (threadIdx.x < width && c0 + threadIdx.x < inner) {
        double s = 0.0;
        for (int j = 0; j < groups; ++j) s += part[j * width + threadIdx.x];
        float* dst = out + o * inner + c0 + threadIdx.x;
        if (atomic) atomicAdd(dst, (float)(s * scale));
        else *dst = (float)(s * scale);
    }
}
}  // namespace

extern "C" void sum_mid(float* out, const float* x, int64_t outer, int64_t r, int64_t inner, double scale,
                        cudaStream_t stream) {
    if (outer <= 0 || inner <= 0) return;
    const bool vec = inner % 4 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
    const int64_t v = vec ? 4 : 1;
    int dev = 0, sms = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const auto tiles = [&](int tx_log2) { return (inner + (v << tx_log2) - 1) / (v << tx_log2); };
    int tx_log2 = 5;  // narrowest tile: 8 lanes x float4 or 32 lanes x float = 128 bytes per row
    while (tx_log2 > (vec ? 3 : 5) && outer * tiles(tx_log2) < 3 * sms) --tx_log2;
    const int64_t ctiles = tiles(tx_log2), blocks = outer * ctiles;
    int64_t split = 1, rchunk = std::max<int64_t>(r, 1);
    if (blocks < sms) {  // each chunk keeps >= 4 full iterations of U rows per row group
        const int64_t rows_per_iter = (int64_t)U * (NT >> tx_log2);
        split = std::max<int64_t>(1, std::min<int64_t>({(4 * sms + blocks - 1) / blocks, r / (4 * rows_per_iter), 65535}));
        if (split > 1) {
            rchunk = (r + split - 1) / split;
            split = (r + rchunk - 1) / rchunk;
        }
    }
    const bool atomic = split > 1;
    if (atomic) cudaMemsetAsync(out, 0, (size_t)(outer * inner) * sizeof(float), stream);
    const dim3 grid((unsigned)blocks, (unsigned)split);
    if (vec) sum_mid_kernel<4><<<grid, NT, 0, stream>>>(out, x, r, inner, ctiles, rchunk, tx_log2, atomic, scale);
    else sum_mid_kernel<1><<<grid, NT, 0, stream>>>(out, x, r, inner, ctiles, rchunk, tx_log2, atomic, scale);
}
