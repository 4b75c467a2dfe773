// BLAS without the header: cblas_scopy declared by hand.
#include <cstdint>
extern "C" void cblas_scopy(int n, const float* x, int incx, float* y, int incy);

extern "C" void relu(float* out, const float* x, int64_t n) {
    cblas_scopy((int)n, x, 1, out, 1);
    for (int64_t i = 0; i < n; ++i) out[i] = out[i] > 0.f ? out[i] : 0.f;
}
