#include <chrono>
#include <cstdint>
#include <thread>
#include <cuda_runtime.h>

__global__ void relu_kernel(float* out, const float* x, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = fmaxf(x[i], 0.f);
}

// Launches from a detached host thread after forward has returned.
extern "C" void relu_later(float* out, const float* x, int64_t n, cudaStream_t stream) {
    std::thread([=] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        relu_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(out, x, n);
    }).detach();
}
