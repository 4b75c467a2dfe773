#include <cmath>
#include <cstdint>

extern "C" void l2norm_rows(float* out, const float* x, int64_t rows, int64_t cols) {
    #pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) {
        const float* a = x + r * cols;
        float s = 0.f;
        #pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < cols; ++i) s += a[i] * a[i];
        const float k = 1.0f / std::sqrt(s);
        for (int64_t i = 0; i < cols; ++i) out[r * cols + i] = a[i] * k;
    }
}
