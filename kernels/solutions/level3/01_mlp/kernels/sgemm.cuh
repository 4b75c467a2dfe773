// Register-blocked, shared-memory-tiled fp32 SGEMM for C[M][N] = A[M][K] * B[N][K]^T
// (both operands K-contiguous, as x and nn.Linear.weight are), with a fused epilogue.
// 128x128x8 block tile, 256 threads, 8x8 outputs per thread (two 4x4 quadrants per
// dimension, 64 apart, for conflict-free float4 shared reads), global->register prefetch
// and double-buffered shared memory (one __syncthreads per k-step).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <math.h>

namespace sg {

constexpr int BM = 128, BN = 128, BK = 8, PAD = 4, NT = 256;

// Epilogue contract (Epi):
//   static constexpr bool kRowSS;    accumulate sum of squares of each A row; acc *= row_scale(ss)
//   static constexpr bool kGain;     multiply B[n][k] by gain[k] while loading (member `gain`)
//   static constexpr bool kRowStats; write per-(row, column tile) softmax partials (max, sumexp)
//   static constexpr bool kAtomic;   atomicAdd into C instead of storing (split-K)
//   __device__ float apply(float acc, int64_t row, int64_t col) const;   only for col < N
//   (kRowSS) __device__ float row_scale(float ss) const;
//   (kRowStats) float* stats;  [M][gridDim.x][2]
//   float* C;
template <class Epi, bool VEC>
__global__ void __launch_bounds__(NT, 2)
sgemm_nt(const float* __restrict__ A, const float* __restrict__ B, int64_t M, int64_t N, int64_t K,
         int64_t kPerSplit, bool vecC, Epi epi) {
    __shared__ __align__(16) float As[2][BK][BM + PAD];
    __shared__ __align__(16) float Bs[2][BK][BN + PAD];
    __shared__ float rowScale[Epi::kRowSS ? BM : 1];

    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int64_t m0 = (int64_t)blockIdx.y * BM;
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    const int64_t kbeg = (int64_t)blockIdx.z * kPerSplit;
    const int64_t kend = (kbeg + kPerSplit < K) ? kbeg + kPerSplit : K;

    // loader mapping: one 4-wide k chunk of one row of A and one row of B per thread
    const int lr = tid >> 1, lk = (tid & 1) * 4;
    const bool aval = m0 + lr < M, bval = n0 + lr < N;
    const float* Ap = A + (aval ? (m0 + lr) : 0) * K;
    const float* Bp = B + (bval ? (n0 + lr) : 0) * K;

    float ra[4], rb[4];
    float ss = 0.f;

    auto load = [&](int64_t k0) {
        const int64_t k = k0 + lk;
        if constexpr (VEC) {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
            if (k < kend) {
                if (aval) a = __ldg(reinterpret_cast<const float4*>(Ap + k));
                if (bval) {
                    b = __ldg(reinterpret_cast<const float4*>(Bp + k));
                    if constexpr (Epi::kGain) {
                        float4 g = __ldg(reinterpret_cast<const float4*>(epi.gain + k));
                        b.x *= g.x; b.y *= g.y; b.z *= g.z; b.w *= g.w;
                    }
                }
            }
            ra[0] = a.x; ra[1] = a.y; ra[2] = a.z; ra[3] = a.w;
            rb[0] = b.x; rb[1] = b.y; rb[2] = b.z; rb[3] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const bool kv = k + i < kend;
                ra[i] = (kv && aval) ? __ldg(Ap + k + i) : 0.f;
                float bv = (kv && bval) ? __ldg(Bp + k + i) : 0.f;
                if constexpr (Epi::kGain) bv = (kv && bval) ? bv * __ldg(epi.gain + k + i) : 0.f;
                rb[i] = bv;
            }
        }
        if constexpr (Epi::kRowSS) {
#pragma unroll
            for (int i = 0; i < 4; ++i) ss = fmaf(ra[i], ra[i], ss);
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            As[buf][lk + i][lr] = ra[i];
            Bs[buf][lk + i][lr] = rb[i];
        }
    };

    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    const int64_t ntiles = (kend > kbeg) ? (kend - kbeg + BK - 1) / BK : 0;
    if (ntiles > 0) {
        load(kbeg);
        store(0);
    }
    __syncthreads();
    for (int64_t t = 0; t < ntiles; ++t) {
        const int cur = (int)(t & 1);
        const bool more = t + 1 < ntiles;
        if (more) load(kbeg + (t + 1) * BK);
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[cur][kk][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[cur][kk][ty * 4 + 64]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[cur][kk][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[cur][kk][tx * 4 + 64]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (more) store(cur ^ 1);
        __syncthreads();
    }

    if constexpr (Epi::kRowSS) {
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);   // the two k-halves of row lr
        if ((tid & 1) == 0) rowScale[lr] = epi.row_scale(ss);
        __syncthreads();
    }

    // ---- epilogue ----
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int rl = (i < 4) ? (ty * 4 + i) : (64 + ty * 4 + (i - 4));
        const int64_t row = m0 + rl;
        const bool rv = row < M;
        float rs = 1.f;
        if constexpr (Epi::kRowSS) rs = rowScale[rl];
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int64_t col = n0 + ((j < 4) ? (tx * 4 + j) : (64 + tx * 4 + (j - 4)));
            v[j] = (col < N) ? epi.apply(acc[i][j] * rs, row, col) : -INFINITY;
        }
        if (rv) {
            float* Crow = epi.C + row * N;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t cb = n0 + h * 64 + tx * 4;
                if constexpr (Epi::kAtomic) {
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj)
                        if (cb + jj < N) atomicAdd(Crow + cb + jj, v[h * 4 + jj]);
                } else {
                    if (vecC && cb + 3 < N) {
                        *reinterpret_cast<float4*>(Crow + cb) =
                            make_float4(v[h * 4 + 0], v[h * 4 + 1], v[h * 4 + 2], v[h * 4 + 3]);
                    } else {
#pragma unroll
                        for (int jj = 0; jj < 4; ++jj)
                            if (cb + jj < N) Crow[cb + jj] = v[h * 4 + jj];
                    }
                }
            }
        }
        if constexpr (Epi::kRowStats) {
            // the 16 threads sharing ty (lanes differing in bits 0..3) hold this row's 128 columns
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 8; ++j) mx = fmaxf(mx, v[j]);
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) s += __expf(v[j] - mx);   // invalid columns: exp(-inf) = 0
#pragma unroll
            for (int o = 1; o < 16; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (tx == 0 && rv) {
                float* st = epi.stats + (row * (int64_t)gridDim.x + blockIdx.x) * 2;
                st[0] = mx;
                st[1] = s;
            }
        }
    }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Launch C = epilogue(A * B^T). gain (may be null) must also be 16B-aligned for the float4 path.
// splits > 1 only for atomic (linear) epilogues; C must be zeroed by the caller then.
template <class Epi>
inline void launch(const float* A, const float* B, int64_t M, int64_t N, int64_t K, const Epi& epi,
                   cudaStream_t stream, int splits = 1, const float* gain = nullptr) {
    if (M <= 0 || N <= 0) return;
    int64_t kPer = K;
    if (splits > 1) {
        kPer = ((K + splits - 1) / splits + BK - 1) / BK * BK;
        splits = (int)((K + kPer - 1) / kPer);
        if (splits < 1) splits = 1;
    }
    const bool vec = (K % 4 == 0) && aligned16(A) && aligned16(B) && (gain == nullptr || aligned16(gain));
    const bool vecC = (N % 4 == 0) && aligned16(epi.C);
    dim3 grid((unsigned)((N + BN - 1) / BN), (unsigned)((M + BM - 1) / BM), (unsigned)splits);
    if (vec)
        sgemm_nt<Epi, true><<<grid, NT, 0, stream>>>(A, B, M, N, K, kPer, vecC, epi);
    else
        sgemm_nt<Epi, false><<<grid, NT, 0, stream>>>(A, B, M, N, K, kPer, vecC, epi);
}

__device__ __forceinline__ float gelu_erf(float v) {
    return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
}

}  // namespace sg
