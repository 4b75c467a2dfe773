#include <cstdint>
#include <cuda_runtime.h>

__global__ void slow_relu_kernel(float* out, const float* x, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        long long start = clock64();
        while (clock64() - start < 20000000) {}   // ~10 ms at ~2 GHz: work the timer must count
    }
    if (i < n) out[i] = fmaxf(x[i], 0.f);
}

// Ordered after the caller's stream (so the output is not overwritten by work queued before the
// call), but never joined back: the caller's stream looks finished long before the output is.
extern "C" void relu_on_side_stream(float* out, const float* x, int64_t n, cudaStream_t stream) {
    static cudaStream_t side = nullptr;
    static cudaEvent_t ready = nullptr;
    if (!side) {
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    }
    cudaEventRecord(ready, stream);
    cudaStreamWaitEvent(side, ready, 0);
    slow_relu_kernel<<<(unsigned)((n + 255) / 256), 256, 0, side>>>(out, x, n);
}
