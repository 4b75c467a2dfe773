#include <cstdint>
extern "C" void spin(float* out, int64_t n) {
    volatile int64_t i = 0;
    while (true) { i = i + n; out[0] = (float)i; }
}
