// y = act(x W^T + b) for each MLP layer: a 3xTF32 tensor-core GEMM with bias (+ReLU) fused in the epilogue.
// Layers without activation whose tile grid would fill at most half of the SMs use split-K with
// atomicAdd into a zeroed output (bias added by split 0).
#include "sgemm.cuh"

namespace {
struct Epi {
    static constexpr bool kRowSS = false, kGain = false, kRowStats = false, kAtomic = false;
    float* C;
    const float* bias;
    int relu;
    const float* gain = nullptr;
    float* stats = nullptr;
    __device__ float apply(float acc, int64_t, int64_t col) const {
        float v = acc + __ldg(bias + col);
        return relu ? fmaxf(v, 0.f) : v;
    }
};
struct EpiSplit {
    static constexpr bool kRowSS = false, kGain = false, kRowStats = false, kAtomic = true;
    float* C;
    const float* bias;
    const float* gain = nullptr;
    float* stats = nullptr;
    __device__ float apply(float acc, int64_t, int64_t col) const {
        return blockIdx.z == 0 ? acc + __ldg(bias + col) : acc;
    }
};
}  // namespace

extern "C" void linear(float* out, const float* x, const float* w, const float* b,
                       int64_t M, int64_t K, int64_t N, int64_t act, cudaStream_t stream) {
    if (M <= 0 || N <= 0) return;
    const int64_t tiles = ((M + sg::BM - 1) / sg::BM) * ((N + sg::BN - 1) / sg::BN);
    int dev = 0, sms = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);   // one resident block per SM
    if (act == 0 && 2 * tiles <= sms && K >= 1024) {
        int64_t splits = (sms + tiles - 1) / tiles;
        if (splits > 4) splits = 4;
        if (splits > 1) {
            cudaMemsetAsync(out, 0, (size_t)(M * N) * sizeof(float), stream);
            EpiSplit e;
            e.C = out; e.bias = b;
            sg::launch(x, w, M, N, K, e, stream, (int)splits);
            return;
        }
    }
    Epi e;
    e.C = out; e.bias = b; e.relu = act != 0;
    sg::launch(x, w, M, N, K, e, stream);
}
