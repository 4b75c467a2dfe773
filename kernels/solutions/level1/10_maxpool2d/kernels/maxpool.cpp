// Max pooling per (n, c) plane: vertical max of the window rows into a row buffer, then horizontal max.
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>

extern "C" void maxpool2d(float* out, const float* x, int64_t planes, int64_t h, int64_t w,
                          int64_t oh, int64_t ow, int64_t k, int64_t s, int64_t p) {
    const int64_t wp = w + 2 * p + s;  // padded row with -inf borders
    #pragma omp parallel
    {
        std::vector<float> rowbuf(wp, -INFINITY);
        float* vm = rowbuf.data() + p;
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
                const float* base = rowbuf.data();  // base[j] = vm[j - p]
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
    }
}
