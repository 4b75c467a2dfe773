#include <cstdint>
extern "C" void crash(float* out, int64_t n) {
    volatile float* p = nullptr;
    out[0] = p[n];
}
