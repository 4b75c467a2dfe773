// y = act(x W^T + b) for each MLP layer: the wgmma 3xTF32 GEMM of wgmma.cuh with bias (+ReLU) fused in the
// epilogue.
#include "wgmma.cuh"

namespace {
struct Epi {
    float* C;
    const float* bias;
    int relu;
    __device__ float apply(float acc, int64_t, int64_t col) const {
        float v = acc + __ldg(bias + col);
        return relu ? fmaxf(v, 0.f) : v;
    }
};
}  // namespace

// ws: wg::workspace_bytes(M, N, K, 1, x, 0) bytes of device memory (model_new.py sizes it)
extern "C" void linear(float* out, const float* x, const float* w, const float* b, float* ws,
                       int64_t M, int64_t K, int64_t N, int64_t act, cudaStream_t stream) {
    Epi e;
    e.C = out; e.bias = b; e.relu = act != 0;
    wg::launch(x, w, M, N, K, e, stream, ws);
}
