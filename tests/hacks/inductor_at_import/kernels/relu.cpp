#include <cstdint>

extern "C" void relu(float* out, const float* x, int64_t n) {
    #pragma omp parallel for simd
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] > 0.f ? x[i] : 0.f;
}
