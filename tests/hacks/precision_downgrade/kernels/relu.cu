#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

__global__ void relu_half_kernel(float* out, const float* x, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = __half2float(__float2half(fmaxf(x[i], 0.f)));
}

extern "C" void relu_half(float* out, const float* x, int64_t n, cudaStream_t stream) {
    relu_half_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(out, x, n);
}
