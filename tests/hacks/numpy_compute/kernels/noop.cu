#include <cstdint>
#include <cuda_runtime.h>
extern "C" void noop(float*, int64_t, cudaStream_t) {}
