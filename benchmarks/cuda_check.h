// CK(call): a CUDA runtime call that must succeed; on an error, print where and exit 1.
// Shared by the standalone sweep and check programs of benchmarks/*.cu.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define CK(x)                                                                                          \
    do {                                                                                               \
        cudaError_t e_ = (x);                                                                          \
        if (e_ != cudaSuccess) {                                                                       \
            std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__,     \
                         __LINE__, #x);                                                                \
            std::exit(1);                                                                              \
        }                                                                                              \
    } while (0)
