// softmax(x W^T + b, dim=-1).
// Pass 1: the wgmma 3xTF32 GEMM of wgmma.cuh, whose epilogue stores the logits z = acc + b and, per (row,
//         128-column tile), the partial max and sum of exp(z - max) (stats[M][ntn][2]).
// Pass 2: one warp per row merges the ntn partials and rewrites z in place as exp(z - m) / s.
#include "wgmma.cuh"

namespace {
struct Epi {
    static constexpr bool kRowStats = true;
    float* C;
    const float* bias;
    float* stats;
    __device__ float apply(float acc, int64_t, int64_t col) const { return acc + __ldg(bias + col); }
};

__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) { m = m2; s = s2; return; }
    if (m2 > m) { s = s * __expf(m - m2) + s2; m = m2; }
    else        { s = s + s2 * __expf(m2 - m); }
}

__global__ void __launch_bounds__(256)
softmax_finalize(float* __restrict__ out, const float* __restrict__ stats, int64_t M, int64_t N, int ntn, bool vec) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= M) return;
    const float* st = stats + row * ntn * 2;
    float m = -INFINITY, s = 0.f;
    for (int t = lane; t < ntn; t += 32) merge(m, s, st[2 * t], st[2 * t + 1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        merge(m, s, m2, s2);
    }
    const float inv = 1.f / s;
    float* z = out + row * N;
    if (vec) {
        float4* z4 = reinterpret_cast<float4*>(z);
        const int64_t n4 = N / 4;
        for (int64_t c = lane; c < n4; c += 32) {
            float4 v = z4[c];
            v.x = __expf(v.x - m) * inv; v.y = __expf(v.y - m) * inv;
            v.z = __expf(v.z - m) * inv; v.w = __expf(v.w - m) * inv;
            z4[c] = v;
        }
    } else {
        for (int64_t c = lane; c < N; c += 32) z[c] = __expf(z[c] - m) * inv;
    }
}
}  // namespace

// stats: float32 scratch of M * ceil(N / 128) * 2 elements on the device; ws: wg::workspace_bytes(M, N, K, 1, x, 0)
// bytes (model_new.py sizes both).
extern "C" void linear_softmax_gpu(float* out, float* stats, const float* x, const float* w, const float* bias,
                                   float* ws, int64_t M, int64_t K, int64_t N, cudaStream_t stream) {
    if (M <= 0 || N <= 0) return;
    Epi e;
    e.C = out; e.bias = bias; e.stats = stats;
    wg::launch(x, w, M, N, K, e, stream, ws);
    const int ntn = (int)((N + wg::BN - 1) / wg::BN);
    const bool vec = (N % 4 == 0) && wg::aligned16(out);
    softmax_finalize<<<(unsigned)((M + 7) / 8), 256, 0, stream>>>(out, stats, M, N, ntn, vec);
}
