// BLAS loaded at run time: no header, no link flag.
#include <cstdint>
#include <dlfcn.h>

extern "C" void relu(float* out, const float* x, int64_t n) {
    using scopy_t = void (*)(int, const float*, int, float*, int);
    static scopy_t scopy = (scopy_t)dlsym(dlopen("libcblas.so", RTLD_NOW), "cblas_scopy");
    scopy((int)n, x, 1, out, 1);
    for (int64_t i = 0; i < n; ++i) out[i] = out[i] > 0.f ? out[i] : 0.f;
}
