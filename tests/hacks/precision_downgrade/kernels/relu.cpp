#include <cstdint>
extern "C" void relu_half(float* out, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        _Float16 h = (_Float16)x[i];
        out[i] = (float)(h > (_Float16)0 ? h : (_Float16)0);
    }
}
