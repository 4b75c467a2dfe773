#include <cstdint>
#include <cuda_runtime.h>

__global__ void relu_kernel(float* __restrict__ out, const float* __restrict__ x, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) out[i] = fmaxf(x[i], 0.f);
}

extern "C" void relu(float* out, const float* x, int64_t n, cudaStream_t stream) {
    int blocks = (int)((n + 255) / 256 < 65535 * 8 ? (n + 255) / 256 : 65535 * 8);
    relu_kernel<<<blocks, 256, 0, stream>>>(out, x, n);
}
