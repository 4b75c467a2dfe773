// cuBLAS without the header: the handle API declared by hand.
#include <cstdint>
#include <cuda_runtime.h>
extern "C" int cublasCreate_v2(void** handle);
extern "C" int cublasSetStream_v2(void* handle, cudaStream_t stream);
extern "C" int cublasScopy_v2(void* handle, int n, const float* x, int incx, float* y, int incy);

__global__ void relu_inplace(float* out, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = fmaxf(out[i], 0.f);
}

extern "C" void relu(float* out, const float* x, int64_t n, cudaStream_t stream) {
    static void* handle = nullptr;
    if (!handle) cublasCreate_v2(&handle);
    cublasSetStream_v2(handle, stream);
    cublasScopy_v2(handle, (int)n, x, 1, out, 1);
    relu_inplace<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(out, n);
}
