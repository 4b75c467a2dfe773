// Max pooling per (n, c) plane: vertical max of the window rows into a row buffer, then horizontal max.
// The row buffer's data starts on a 64-byte boundary: with malloc's 16-byte alignment the vector
// loop's stores straddle cache lines by an offset that differs from process to process.
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <algorithm>
#include <new>

extern "C" void maxpool2d(float* out, const float* x, int64_t planes, int64_t h, int64_t w,
                          int64_t oh, int64_t ow, int64_t k, int64_t s, int64_t p) {
    const int64_t wp = w + 2 * p + s;  // padded row with -inf borders
    #pragma omp parallel
    {
        const int64_t lead = (p + 15) / 16 * 16;   // vm[0] on a line, p -inf borders before it
        const int64_t n = lead - p + wp;
        float* rowbuf = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
        if (rowbuf == nullptr) throw std::bad_alloc();
        std::fill(rowbuf, rowbuf + n, -INFINITY);
        float* vm = rowbuf + lead;
        #pragma omp for schedule(static) collapse(2)
        for (int64_t pl = 0; pl < planes; ++pl)
            for (int64_t y = 0; y < oh; ++y) {
                const float* xp = x + pl * h * w;
                const int64_t r0 = std::max<int64_t>(y * s - p, 0), r1 = std::min<int64_t>(y * s - p + k, h);
                const float* a = xp + r0 * w;
                #pragma omp simd
                for (int64_t i = 0; i < w; ++i) vm[i] = a[i];
                for (int64_t r = r0 + 1; r < r1; ++r) {
                    const float* b = xp + r * w;
                    #pragma omp simd
                    for (int64_t i = 0; i < w; ++i) vm[i] = b[i] > vm[i] ? b[i] : vm[i];
                }
                float* o = out + (pl * oh + y) * ow;
                const float* base = vm - p;  // base[j] = vm[j - p]
                if (k == 3 && s == 2) {
                    #pragma omp simd
                    for (int64_t j = 0; j < ow; ++j) {
                        float m0 = base[2 * j], m1 = base[2 * j + 1], m2 = base[2 * j + 2];
                        float m = m0 > m1 ? m0 : m1;
                        o[j] = m2 > m ? m2 : m;
                    }
                } else {
                    for (int64_t j = 0; j < ow; ++j) {
                        float m = -INFINITY;
                        for (int64_t t = 0; t < k; ++t) m = base[j * s + t] > m ? base[j * s + t] : m;
                        o[j] = m;
                    }
                }
            }
        std::free(rowbuf);
    }
}
