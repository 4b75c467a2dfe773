#include <cstdint>
#include <cmath>
#include <immintrin.h>

static inline float row_max1(const float* x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#ifdef __AVX512F__
    __m512 a0 = _mm512_set1_ps(-INFINITY), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_max_ps(a0, _mm512_loadu_ps(x + i));
        a1 = _mm512_max_ps(a1, _mm512_loadu_ps(x + i + 16));
        a2 = _mm512_max_ps(a2, _mm512_loadu_ps(x + i + 32));
        a3 = _mm512_max_ps(a3, _mm512_loadu_ps(x + i + 48));
    }
    for (; i + 16 <= n; i += 16) a0 = _mm512_max_ps(a0, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3)));
#endif
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

extern "C" void row_max(float* out, const float* x, int64_t rows, int64_t cols) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_max1(x + r * cols, cols);
}
