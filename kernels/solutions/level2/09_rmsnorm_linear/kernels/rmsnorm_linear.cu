// linear(x * rsqrt(mean(x^2) + eps) * g): the gain folded into the weight, then one GEMM (wgmma.cuh's 3xTF32).
// gain_columns writes w_g[n][k] = w[n][k] * g[k] (8M elements: ~15 us at HBM bandwidth), so the
// GEMM needs no per-k gain; the GEMM accumulates each x row's sum of squares from the fragments it
// splits anyway (it reads all of K for them) and scales its output rows by rsqrt(ss/K + eps) in the
// epilogue, before the bias add.
#include "wgmma.cuh"

namespace {
struct Epi {
    static constexpr bool kRowSS = true;
    float* C;
    const float* bias;
    float invK, eps;
    __device__ float apply(float acc, int64_t, int64_t col) const { return acc + __ldg(bias + col); }
    __device__ float row_scale(float ss) const { return rsqrtf(ss * invK + eps); }
};

__global__ void gain_columns_kernel(float* __restrict__ w_g, const float* __restrict__ w,
                                    const float* __restrict__ g, int64_t N, int64_t K) {
    const int64_t total = N * K;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
        w_g[i] = w[i] * __ldg(g + i % K);
}
}  // namespace

extern "C" void gain_columns(float* w_g, const float* w, const float* g, int64_t N, int64_t K, cudaStream_t stream) {
    if (N <= 0 || K <= 0) return;
    const int64_t total = N * K;
    const int64_t blocks = (total + 255) / 256;
    gain_columns_kernel<<<(unsigned)(blocks < 132 * 16 ? blocks : 132 * 16), 256, 0, stream>>>(w_g, w, g, N, K);
}

// out = rmsnorm(x) @ w_g^T + bias, w_g = gain_columns(w, g); ws: wg::workspace_bytes(M, N, K, 1, x, 0) bytes
extern "C" void rms_linear(float* out, const float* x, const float* w_g, const float* bias, float* ws,
                           int64_t M, int64_t K, int64_t N, double eps, cudaStream_t stream) {
    Epi e;
    e.C = out; e.bias = bias; e.invK = 1.f / (float)K; e.eps = (float)eps;
    wg::launch(x, w_g, M, N, K, e, stream, ws);
}
