// CK(call): a CUDA runtime call that must succeed; on an error, print where and exit 1.
// event_times_ms / median_ms: the event timing of the sweep and check programs.
// Shared by the standalone sweep and check programs of benchmarks/*.cu.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

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

// The times (ms, sorted) of `reps` calls of f() on `stream`, each between two CUDA events, after `warmup`
// untimed calls; L2 is not flushed. Empty when a call failed to launch or run: the error is left for the
// caller to read (cudaGetLastError), so a sweep can report a configuration that fails and go on.
template <class F>
std::vector<float> event_times_ms(F&& f, int warmup, int reps, cudaStream_t stream = 0) {
    for (int i = 0; i < warmup; ++i) f();
    if (cudaPeekAtLastError() != cudaSuccess || cudaStreamSynchronize(stream) != cudaSuccess) return {};
    std::vector<cudaEvent_t> ev(2 * reps);
    for (auto& e : ev) CK(cudaEventCreate(&e));
    for (int i = 0; i < reps; ++i) {
        CK(cudaEventRecord(ev[2 * i], stream));
        f();
        CK(cudaEventRecord(ev[2 * i + 1], stream));
    }
    std::vector<float> ms;
    if (cudaPeekAtLastError() == cudaSuccess && cudaStreamSynchronize(stream) == cudaSuccess) {
        ms.resize(reps);
        for (int i = 0; i < reps; ++i) CK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
        std::sort(ms.begin(), ms.end());
    }
    for (auto& e : ev) cudaEventDestroy(e);
    return ms;
}

inline double median_ms(const std::vector<float>& sorted) {
    const size_t n = sorted.size();
    return n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
}
