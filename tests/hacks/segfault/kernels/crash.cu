#include <cstdint>
#include <cuda_runtime.h>

__global__ void crash_kernel(float* out, int64_t n) {
    float* p = reinterpret_cast<float*>(0x10);
    out[threadIdx.x] = p[n + threadIdx.x];   // illegal address
}

extern "C" void crash(float* out, int64_t n, cudaStream_t stream) {
    crash_kernel<<<1, 32, 0, stream>>>(out, n);
}
