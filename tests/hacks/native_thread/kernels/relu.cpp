#include <chrono>
#include <cstdint>
#include <thread>
extern "C" void relu_later(float* out, const float* x, int64_t n) {
    std::thread([=] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        for (int64_t i = 0; i < n; ++i) out[i] = x[i] > 0.f ? x[i] : 0.f;
    }).detach();
}
