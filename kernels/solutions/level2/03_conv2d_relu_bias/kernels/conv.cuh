// Implicit-GEMM conv2d (stride 1, no padding, NCHW): C[co][n] = sum_k W[co][k] * X[k][n] with
// k = (ci, kh, kw), n = (b, oh, ow), fused per-output-channel epilogue.
// 128x128x8 block tile, 256 threads, 8x8 outputs per thread, double-buffered shared memory.
// Each thread gathers one fixed output column n of the im2col operand (its input base offset is
// computed once); the per-k input offsets ci*H*W + kh*W + kw live in a shared-memory table.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <math.h>

namespace cv {

constexpr int BM = 128, BN = 128, BK = 8, PAD = 4, NT = 256;

// Epi: typename Row; __device__ Row row(int co) const; __device__ float apply(float acc, const Row&) const;
template <class Epi, bool VECA>
__global__ void __launch_bounds__(NT, 2)
conv_igemm(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w,
           int64_t Bn, int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t KH, int64_t KW, bool vecY, Epi epi) {
    extern __shared__ long long koff[];   // K entries
    __shared__ __align__(16) float As[2][BK][BM + PAD];
    __shared__ __align__(16) float Bs[2][BK][BN + PAD];

    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int64_t OH = H - KH + 1, OW = W - KW + 1, OHW = OH * OW;
    const int64_t N = Bn * OHW;
    const int64_t K = Ci * KH * KW;
    const int64_t KHW = KH * KW;
    for (int64_t k = tid; k < K; k += NT) {
        const int64_t ci = k / KHW, r = k - ci * KHW, kh = r / KW, kw = r - kh * KW;
        koff[k] = ci * H * W + kh * W + kw;
    }

    const int64_t m0 = (int64_t)blockIdx.y * BM;   // output channels
    const int64_t n0 = (int64_t)blockIdx.x * BN;   // output pixels

    // A (weights) loader: row lr, k chunk lk
    const int lr = tid >> 1, lk = (tid & 1) * 4;
    const bool aval = m0 + lr < Co;
    const float* Ap = w + (aval ? (m0 + lr) : 0) * K;
    // B (im2col) loader: fixed column bn, k rows bk + 2*i
    const int bn = tid & 127, bk = tid >> 7;
    const int64_t nB = n0 + bn;
    const bool bval = nB < N;
    int64_t xoff = 0;
    if (bval) {
        const int64_t b = nB / OHW, p = nB - b * OHW, oh = p / OW, ow = p - oh * OW;
        xoff = b * Ci * H * W + oh * W + ow;
    }
    const float* xp = x + xoff;

    float ra[4], rb[4];
    auto load = [&](int64_t k0) {
        const int64_t k = k0 + lk;
        if constexpr (VECA) {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
            if (aval && k < K) a = __ldg(reinterpret_cast<const float4*>(Ap + k));
            ra[0] = a.x; ra[1] = a.y; ra[2] = a.z; ra[3] = a.w;
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) ra[i] = (aval && k + i < K) ? __ldg(Ap + k + i) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int64_t kb = k0 + bk + 2 * i;
            rb[i] = (bval && kb < K) ? __ldg(xp + koff[kb]) : 0.f;
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            As[buf][lk + i][lr] = ra[i];
            Bs[buf][bk + 2 * i][bn] = rb[i];
        }
    };

    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    __syncthreads();   // koff ready
    const int64_t ntiles = (K + BK - 1) / BK;
    if (ntiles > 0) {
        load(0);
        store(0);
    }
    __syncthreads();
    for (int64_t t = 0; t < ntiles; ++t) {
        const int cur = (int)(t & 1);
        const bool more = t + 1 < ntiles;
        if (more) load((t + 1) * BK);
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

    // ---- epilogue: y[b][co][p] with n = b*OHW + p ----
    int64_t yb[8];   // b*Co*OHW + p for the thread's 8 columns, -1 when n >= N
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int64_t n = n0 + ((j < 4) ? (tx * 4 + j) : (64 + tx * 4 + (j - 4)));
        if (n < N) {
            const int64_t b = n / OHW, p = n - b * OHW;
            yb[j] = b * Co * OHW + p;
        } else {
            yb[j] = -1;
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int64_t co = m0 + ((i < 4) ? (ty * 4 + i) : (64 + ty * 4 + (i - 4)));
        if (co >= Co) continue;
        const typename Epi::Row rp = epi.row((int)co);
        const int64_t coff = co * OHW;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v[4];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) v[jj] = epi.apply(acc[i][h * 4 + jj], rp);
            const int64_t o0 = yb[h * 4];
            if (vecY && o0 >= 0 && yb[h * 4 + 3] == o0 + 3 && yb[h * 4 + 1] == o0 + 1 && yb[h * 4 + 2] == o0 + 2 &&
                ((o0 + coff) & 3) == 0) {
                *reinterpret_cast<float4*>(y + o0 + coff) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int jj = 0; jj < 4; ++jj)
                    if (yb[h * 4 + jj] >= 0) y[yb[h * 4 + jj] + coff] = v[jj];
            }
        }
    }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class Epi>
inline void launch(float* y, const float* x, const float* w, int64_t Bn, int64_t Ci, int64_t H, int64_t W,
                   int64_t Co, int64_t KH, int64_t KW, const Epi& epi, cudaStream_t stream) {
    const int64_t OH = H - KH + 1, OW = W - KW + 1;
    if (Bn <= 0 || Co <= 0 || OH <= 0 || OW <= 0) return;
    const int64_t N = Bn * OH * OW, K = Ci * KH * KW;
    const size_t smem = (size_t)K * sizeof(long long);
    const bool veca = (K % 4 == 0) && aligned16(w);
    const bool vecy = aligned16(y);
    dim3 grid((unsigned)((N + BN - 1) / BN), (unsigned)((Co + BM - 1) / BM));
    if (veca) {
        if (smem > 16 * 1024)
            cudaFuncSetAttribute(conv_igemm<Epi, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        conv_igemm<Epi, true><<<grid, NT, smem, stream>>>(y, x, w, Bn, Ci, H, W, Co, KH, KW, vecy, epi);
    } else {
        if (smem > 16 * 1024)
            cudaFuncSetAttribute(conv_igemm<Epi, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        conv_igemm<Epi, false><<<grid, NT, smem, stream>>>(y, x, w, Bn, Ci, H, W, Co, KH, KW, vecy, epi);
    }
}

}  // namespace cv
