// Inclusive scan along the middle axis of [outer, len, inner], fp32.
// inner == 1 (the task: scan along the last dim): reproduces ATen's CUDA cumsum association order
// (tensor_kernel_scan_innermost_dim: the row is cut into chunks of 2*nx elements, the running total
// is added to the chunk's first element, then a Sklansky scan inside the chunk), so the result
// matches the reference bit for bit instead of drifting by ~1e-3 along 32768-long rows. For nx == 32
// (64-element chunks; what ATen picks for this shape) one warp owns one row: each lane holds 2
// elements, the 6 Sklansky levels are warp shuffles, and the next 8 chunks are always in flight
// (float2 loads into a second register buffer) while the current 8 are scanned; every row's warp is
// resident at once for 4096 rows on 132 SMs. Other nx use a literal port of the ATen kernel.
// inner > 1: one thread per column, sequential fp32 accumulation (ATen's scan_outer_dim order).
#include <cstdint>
#include <algorithm>
#include <cuda_runtime.h>

namespace {
// ATen's get_log_num_threads_x_inner_scan (uint32 arithmetic, quirks included).
uint32_t log_num_threads_x_inner(uint32_t num_rows, uint32_t row_size) {
    uint32_t lx = 0, ly = 0;
    while (((uint32_t)1 << lx) < row_size) ++lx;
    while (((uint32_t)1 << ly) < num_rows) ++ly;
    uint32_t diff = lx - ly;
    lx = ((uint32_t)9 + diff) / (uint32_t)2;
    return std::min(std::max((uint32_t)4, lx), (uint32_t)9);
}

constexpr int WARPS = 4, U = 8;

template <bool VEC2>
__device__ __forceinline__ void load_chunks(float2 (&v)[U], const float* __restrict__ xr, int64_t len, int64_t c0,
                                            int lane) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int64_t p = (c0 + u) * 64 + 2 * lane;
        if (VEC2 && p + 1 < len) {
            v[u] = __ldcs(reinterpret_cast<const float2*>(xr + p));
        } else {
            v[u].x = p < len ? xr[p] : 0.f;
            v[u].y = p + 1 < len ? xr[p + 1] : 0.f;
        }
    }
}

// Scans chunks c0 .. c0 + U - 1 (those below nchunks) of one row; returns the running total.
template <bool VEC2>
__device__ __forceinline__ float scan_chunks(const float2 (&v)[U], float* __restrict__ orow, int64_t len, int64_t c0,
                                             int64_t nchunks, int lane, float carry) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (c0 + u >= nchunks) break;
        float v0 = v[u].x, v1 = v[u].y;
        if (lane == 0) v0 = v0 + carry;
        v1 = v1 + v0;  // level s = 1
#pragma unroll
        for (int m = 1; m <= 5; ++m) {
            const int src = ((lane >> m) << m) + (1 << (m - 1)) - 1;
            const float t = __shfl_sync(0xffffffffu, v1, src);
            if ((lane >> (m - 1)) & 1) {
                v0 = v0 + t;
                v1 = v1 + t;
            }
        }
        const int64_t p = (c0 + u) * 64 + 2 * lane;
        if (VEC2 && p + 1 < len) {
            __stcs(reinterpret_cast<float2*>(orow + p), make_float2(v0, v1));
        } else {
            if (p < len) orow[p] = v0;
            if (p + 1 < len) orow[p + 1] = v1;
        }
        carry = __shfl_sync(0xffffffffu, v1, 31);
    }
    return carry;
}

// One warp per row. Two register buffers of U chunks alternate: the next U chunks are in flight while the
// current ones are scanned. <= 64 registers so that 32 warps (rows) per SM are resident at once.
template <bool VEC2>
__global__ void __launch_bounds__(WARPS * 32, 8) scan_rows_warp64(float* __restrict__ out, const float* __restrict__ x,
                                                                  int64_t rows, int64_t len) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const float* xr = x + row * len;
    float* orow = out + row * len;
    const int64_t nchunks = (len + 63) / 64;
    float carry = 0.f;
    float2 a[U], b[U];
    load_chunks<VEC2>(a, xr, len, 0, lane);
    for (int64_t c0 = 0; c0 < nchunks; c0 += 2 * U) {
        load_chunks<VEC2>(b, xr, len, c0 + U, lane);
        carry = scan_chunks<VEC2>(a, orow, len, c0, nchunks, lane, carry);
        load_chunks<VEC2>(a, xr, len, c0 + 2 * U, lane);
        carry = scan_chunks<VEC2>(b, orow, len, c0 + U, nchunks, lane, carry);
    }
}

// Literal port of ATen's tensor_kernel_scan_innermost_dim (blockDim = (nx, 512 / nx)).
__global__ void scan_rows_aten(float* __restrict__ tgt, const float* __restrict__ src, int64_t num_rows,
                               int64_t row_size, int log_nx) {
    extern __shared__ float sbuf[];
    const int64_t nx = (int64_t)1 << log_nx;
    float* row_buf = sbuf + nx * 2 * threadIdx.y;
    for (int64_t block_row = (int64_t)blockIdx.x * blockDim.y; block_row < num_rows;
         block_row += (int64_t)blockDim.y * gridDim.x) {
        const int64_t row = block_row + threadIdx.y;
        float block_total = 0.f;
        const float* row_src = src + row * row_size;
        float* row_tgt = tgt + row * row_size;
        const bool row_exists = row < num_rows;
        for (int64_t block_col = 0; block_col < row_size; block_col += 2 * nx) {
            const int64_t col1 = block_col + threadIdx.x, col2 = block_col + nx + threadIdx.x;
            if (row_exists) {
                row_buf[threadIdx.x] = col1 < row_size ? row_src[col1] : 0.f;
                row_buf[nx + threadIdx.x] = col2 < row_size ? row_src[col2] : 0.f;
                if (threadIdx.x == 0) row_buf[0] = row_buf[0] + block_total;
            }
            __syncthreads();
            for (int m = 0; m <= log_nx; ++m) {
                if (row_exists) {
                    const int64_t s = (int64_t)1 << m;
                    const int64_t a = (((int64_t)threadIdx.x >> m) << (m + 1)) | s;
                    const int64_t ti = a + ((int64_t)threadIdx.x % s);
                    const int64_t si = a - 1;
                    row_buf[ti] = row_buf[ti] + row_buf[si];
                }
                __syncthreads();
            }
            if (row_exists) {
                if (col1 < row_size) row_tgt[col1] = row_buf[threadIdx.x];
                if (col2 < row_size) row_tgt[col2] = row_buf[nx + threadIdx.x];
            }
            block_total = row_buf[2 * nx - 1];
            __syncthreads();
        }
    }
}

__global__ void scan_outer(float* __restrict__ out, const float* __restrict__ x, int64_t outer, int64_t len,
                           int64_t inner) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= outer * inner) return;
    const int64_t o = t / inner, i = t % inner;
    const float* xp = x + o * len * inner + i;
    float* op = out + o * len * inner + i;
    float acc = 0.f;
    for (int64_t k = 0; k < len; ++k) {
        acc = acc + xp[k * inner];
        op[k * inner] = acc;
    }
}
}  // namespace

extern "C" void cumsum_mid(float* out, const float* x, int64_t outer, int64_t len, int64_t inner,
                           cudaStream_t stream) {
    if (outer <= 0 || len <= 0 || inner <= 0) return;
    if (inner > 1) {
        const int64_t n = outer * inner;
        scan_outer<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(out, x, outer, len, inner);
        return;
    }
    const int log_nx = (int)log_num_threads_x_inner((uint32_t)outer, (uint32_t)len);
    if (log_nx == 5) {
        const bool vec2 = len % 2 == 0 && (reinterpret_cast<uintptr_t>(x) & 7) == 0 &&
                          (reinterpret_cast<uintptr_t>(out) & 7) == 0;
        const unsigned blocks = (unsigned)((outer + WARPS - 1) / WARPS);
        if (vec2) scan_rows_warp64<true><<<blocks, WARPS * 32, 0, stream>>>(out, x, outer, len);
        else scan_rows_warp64<false><<<blocks, WARPS * 32, 0, stream>>>(out, x, outer, len);
        return;
    }
    const int nx = 1 << log_nx, ny = 512 / nx;
    int64_t grid = (outer + ny - 1) / ny;
    if (grid > 2147483647) grid = 2147483647;
    scan_rows_aten<<<(unsigned)grid, dim3(nx, ny), 512 * 2 * sizeof(float), stream>>>(out, x, outer, len, log_nx);
}
