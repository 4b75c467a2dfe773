#include <cstdint>
#include <cuda_runtime.h>

__global__ void relu_kernel(float* out, const float* x, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = fmaxf(x[i], 0.f);
}

extern "C" void relu(float* out, const float* x, int64_t n, cudaStream_t stream) {
    relu_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(out, x, n);
}
extern "C" void noop(float*, int64_t, cudaStream_t) {}
