// LayerNorm, fused multi-head attention (QK^T -> softmax -> PV per batch/head) and linear + residual.
#include "gemm_epi.h"
#include "vmath16.h"
#include <cfloat>
#include <cmath>
#include <vector>

extern "C" void layernorm(float* out, const float* x, const float* w, const float* b,
                          int64_t rows, int64_t d, double eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * d;
        float* o = out + r * d;
        int64_t j = 0;
        v16 s = {};
        float sum = 0.f;
        for (; j + 16 <= d; j += 16) s += vload(xr + j);
        for (sum = hsum(s); j < d; ++j) sum += xr[j];
        const float mean = sum / d;
        v16 q = {};
        float var = 0.f;
        for (j = 0; j + 16 <= d; j += 16) { v16 t = vload(xr + j) - mean; q = vfma(t, t, q); }
        for (var = hsum(q); j < d; ++j) var += (xr[j] - mean) * (xr[j] - mean);
        const float rstd = 1.f / std::sqrt(var / d + (float)eps);
        for (j = 0; j + 16 <= d; j += 16)
            vstore(o + j, vfma((vload(xr + j) - mean) * rstd, vload(w + j), vload(b + j)));
        for (; j < d; ++j) o[j] = (xr[j] - mean) * rstd * w[j] + b[j];
    }
}

static void softmax_row(float* p, int64_t n) {
    int64_t j = 0;
    v16 vm = vbcast(-INFINITY);
    for (; j + 16 <= n; j += 16) vm = vmax(vm, vload(p + j));
    float m = hmax(vm);
    for (; j < n; ++j) m = p[j] > m ? p[j] : m;
    v16 vs = {};
    for (j = 0; j + 16 <= n; j += 16) { v16 e = vexp(vload(p + j) - m); vstore(p + j, e); vs += e; }
    float s = hsum(vs);
    for (; j < n; ++j) { p[j] = std::exp(p[j] - m); s += p[j]; }
    const float inv = 1.f / s;
    // flush would-be denormals to zero: they make the following P @ V crawl
    for (j = 0; j + 16 <= n; j += 16) {
        v16 v = vload(p + j) * inv;
        vstore(p + j, v < FLT_MIN ? v16{} : v);
    }
    for (; j < n; ++j) p[j] = p[j] * inv < FLT_MIN ? 0.f : p[j] * inv;
}

// qkv: [B, T, 3, H, hd] rows of the fused projection; out: [B, T, H, hd].
extern "C" void attention(float* out, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t hd,
                          double scale) {
    const int64_t D = H * hd, ld = 3 * D;
    Epilogue es;
    es.alpha = (float)scale;
    Epilogue eo;
#pragma omp parallel
    {
        std::vector<float> S(T * T);
#pragma omp for schedule(dynamic, 1)
        for (int64_t bh = 0; bh < B * H; ++bh) {
            const int64_t b = bh / H, h = bh % H;
            const float* q = qkv + b * T * ld + h * hd;
            gemm_serial(T, T, hd, q, ld, q + D, ld, true, S.data(), T, es);
            for (int64_t i = 0; i < T; ++i) softmax_row(S.data() + i * T, T);
            gemm_serial(T, hd, T, S.data(), T, q + 2 * D, ld, false, out + b * T * D + h * hd, D, eo);
        }
    }
}

// out[M,N] = x[M,K] @ w[N,K]^T + b + res[M,N]
extern "C" void linear_residual(float* out, const float* x, const float* w, const float* b,
                                const float* res, int64_t M, int64_t K, int64_t N) {
    Epilogue e;
    e.bias = b; e.bias_mode = BIAS_COL; e.res = res; e.ldr = N;
    gemm(M, N, K, x, K, w, K, true, out, N, e);
}
