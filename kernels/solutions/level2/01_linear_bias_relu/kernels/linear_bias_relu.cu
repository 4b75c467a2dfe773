// relu(x W^T + b1 + b2): the wgmma 3xTF32 GEMM of wgmma.cuh with the bias adds and ReLU fused into the epilogue.
#include "wgmma.cuh"

namespace {
struct Epi {
    float* C;
    const float* b1;
    const float* b2;
    __device__ float apply(float acc, int64_t, int64_t col) const {
        return fmaxf(acc + (__ldg(b1 + col) + __ldg(b2 + col)), 0.f);
    }
};
}  // namespace

// ws: wg::workspace_bytes(M, N, K, 1, x, 0) bytes of device memory (model_new.py sizes it)
extern "C" void linear_bias_relu(float* out, const float* x, const float* w, const float* b1, const float* b2,
                                 float* ws, int64_t M, int64_t K, int64_t N, cudaStream_t stream) {
    Epi e;
    e.C = out; e.b1 = b1; e.b2 = b2;
    wg::launch(x, w, M, N, K, e, stream, ws);
}
