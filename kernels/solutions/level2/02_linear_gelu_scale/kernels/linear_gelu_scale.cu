// gelu_erf(x W^T + b) * scale: the wgmma 3xTF32 GEMM of wgmma.cuh with bias, exact GELU and scaling fused
// into the epilogue.
#include "wgmma.cuh"

namespace {
struct Epi {
    float* C;
    const float* bias;
    float scale;
    __device__ float apply(float acc, int64_t, int64_t col) const {
        const float v = acc + __ldg(bias + col);
        return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)) * scale;
    }
};
}  // namespace

// ws: wg::workspace_bytes(M, N, K, 1, x, 0) bytes of device memory (model_new.py sizes it)
extern "C" void linear_gelu_scale(float* out, const float* x, const float* w, const float* bias, float* ws,
                                  int64_t M, int64_t K, int64_t N, double scale, cudaStream_t stream) {
    Epi e;
    e.C = out; e.bias = bias; e.scale = (float)scale;
    wg::launch(x, w, M, N, K, e, stream, ws);
}
