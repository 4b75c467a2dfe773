// cuBLAS loaded at run time: no header, no link flag.
#include <cstdint>
#include <cuda_runtime.h>
#include <dlfcn.h>

__global__ void relu_inplace(float* out, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = fmaxf(out[i], 0.f);
}

extern "C" void relu(float* out, const float* x, int64_t n, cudaStream_t stream) {
    using create_t = int (*)(void**);
    using copy_t = int (*)(void*, int, const float*, int, float*, int);
    static void* lib = dlopen("libcublas.so", RTLD_NOW);
    static void* handle = nullptr;
    if (!handle) ((create_t)dlsym(lib, "cublasCreate_v2"))(&handle);
    ((copy_t)dlsym(lib, "cublasScopy_v2"))(handle, (int)n, x, 1, out, 1);
    relu_inplace<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(out, n);
}
