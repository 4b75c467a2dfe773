// Small CNN on the GPU, fp32-accurate: conv3x3-ReLU, conv3x3-ReLU, 2x2 max pool, linear.
//   conv3x3_relu      bias + ReLU fused into the convolution: a direct fp32 kernel for 3 input channels
//                     (K = 27 would fill a quarter of the implicit GEMM's 32-deep k tiles), else conv.cuh's
//                     3xTF32 implicit GEMM on the tensor cores
//   maxpool_linear    the pool fused into the classifier: each block reads its channel's conv output once,
//                     pools it in registers and multiplies it into per-channel partial logits; a second kernel
//                     sums the partials over the channels and adds the bias (the pooled map is never written)
#include "conv.cuh"

#include <cstdint>

namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
inline bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

// ------------------------------------------------------------------------------------------------ convolutions
struct EpiBiasRelu {
    using Row = float;
    const float* bias;
    __device__ float row(int co) const { return __ldg(bias + co); }
    __device__ float apply(float acc, float b) const { return fmaxf(acc + b, 0.f); }
};

// y[img][co][oh][ow] = relu(b[co] + sum_{c, kh, kw} w[co][c][kh][kw] x[img][c][oh + kh - 1][ow + kw - 1]), zero
// padding 1. Block: a DH x DW output tile of one image, one pixel per thread, every output channel: the
// thread's 3x3 x CI receptive field in registers, the weights (rows padded to a multiple of 4) in shared
// memory read as broadcast float4. grid (ceil(W / DW), ceil(H / DH), batch).
constexpr int DW = 64, DH = 4, DNT = DW * DH;
template <int CI>
struct Direct {
    static constexpr int K = CI * 9, KP = (K + 3) / 4 * 4;   // weight rows padded to whole float4
    static size_t smem(int co) { return ((size_t)co * KP + co + CI * (DH + 2) * (DW + 2)) * 4; }
};

template <int CI>
__global__ void __launch_bounds__(DNT) conv3x3_direct(float* __restrict__ y, const float* __restrict__ x,
                                                      const float* __restrict__ w, const float* __restrict__ bias,
                                                      int Co, int H, int W) {
    constexpr int K = Direct<CI>::K, KP = Direct<CI>::KP, TW = DW + 2, TH = DH + 2;
    extern __shared__ __align__(16) float cd_smem[];
    float* sw = cd_smem;          // [Co][KP]
    float* sb = sw + Co * KP;     // [Co]
    float* sx = sb + Co;          // [CI][TH][TW]: the input tile with its halo, zero outside the image
    const int tid = threadIdx.x, tx = tid % DW, ty = tid / DW;
    const int w0 = blockIdx.x * DW, h0 = blockIdx.y * DH;
    const int64_t img = blockIdx.z;
    for (int i = tid; i < Co * KP; i += DNT) {
        const int co = i / KP, k = i - co * KP;
        sw[i] = k < K ? __ldg(w + (int64_t)co * K + k) : 0.f;
    }
    for (int i = tid; i < Co; i += DNT) sb[i] = __ldg(bias + i);
    for (int i = tid; i < CI * TH * TW; i += DNT) {
        const int c = i / (TH * TW), r = (i / TW) % TH, cc = i % TW;
        const int ih = h0 - 1 + r, iw = w0 - 1 + cc;
        sx[i] = (ih >= 0 && ih < H && iw >= 0 && iw < W) ? __ldg(x + ((img * CI + c) * H + ih) * W + iw) : 0.f;
    }
    __syncthreads();
    const int oh = h0 + ty, ow = w0 + tx;
    if (oh >= H || ow >= W) return;
    float v[KP];
#pragma unroll
    for (int c = 0; c < CI; ++c)
#pragma unroll
        for (int kh = 0; kh < 3; ++kh)
#pragma unroll
            for (int kw = 0; kw < 3; ++kw) v[(c * 3 + kh) * 3 + kw] = sx[(c * TH + ty + kh) * TW + tx + kw];
#pragma unroll
    for (int k = K; k < KP; ++k) v[k] = 0.f;
    const int64_t plane = (int64_t)H * W;
    float* yp = y + img * Co * plane + (int64_t)oh * W + ow;
#pragma unroll 2
    for (int co = 0; co < Co; ++co) {
        const float4* wr = reinterpret_cast<const float4*>(sw + co * KP);
        float acc = sb[co];
#pragma unroll
        for (int q = 0; q < KP / 4; ++q) {
            const float4 wv = wr[q];
            acc = fmaf(wv.x, v[4 * q], acc);
            acc = fmaf(wv.y, v[4 * q + 1], acc);
            acc = fmaf(wv.z, v[4 * q + 2], acc);
            acc = fmaf(wv.w, v[4 * q + 3], acc);
        }
        yp[co * plane] = fmaxf(acc, 0.f);
    }
}

// ------------------------------------------------------------------------------------------------ pool + linear
// part[c][b][n] = sum_{i < H/2, j < W/2} maxpool2x2(y)[b][c][i][j] * w[n][(c * (H/2) + i) * (W/2) + j]
// (the flattened pooled map is channel-major: channel c's features are one contiguous run of w's row).
// Block: one channel c, PBB batch rows, every class in chunks of PNC (PBB x PNC partial sums per thread).
// grid (C, ceil(B / PBB)).
constexpr int PNT = 256, PBB = 4, PNC = 16;
template <bool VEC>
__global__ void __launch_bounds__(PNT) maxpool_linear_part(float* __restrict__ part, const float* __restrict__ y,
                                                           const float* __restrict__ w, int B, int C, int H, int W,
                                                           int N) {
    __shared__ float red[PNT / 32][PBB * PNC];
    const int c = blockIdx.x, b0 = blockIdx.y * PBB;
    const int Wo = W / 2, P = (H / 2) * Wo;
    const int64_t F = (int64_t)C * P;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* wc = w + (int64_t)c * P;
    for (int n0 = 0; n0 < N; n0 += PNC) {
        float acc[PBB][PNC];
#pragma unroll
        for (int bb = 0; bb < PBB; ++bb)
#pragma unroll
            for (int nn = 0; nn < PNC; ++nn) acc[bb][nn] = 0.f;
        for (int p = tid; p < P; p += PNT) {
            const int i = p / Wo, j = p - i * Wo;
            float wv[PNC];
#pragma unroll
            for (int nn = 0; nn < PNC; ++nn) wv[nn] = n0 + nn < N ? __ldg(wc + (int64_t)(n0 + nn) * F + p) : 0.f;
#pragma unroll
            for (int bb = 0; bb < PBB; ++bb) {
                if (b0 + bb >= B) break;   // block-uniform
                const float* r0 = y + (((int64_t)(b0 + bb) * C + c) * H + 2 * i) * W + 2 * j;
                float v;
                if constexpr (VEC) {
                    const float2 u = __ldcs(reinterpret_cast<const float2*>(r0));
                    const float2 l = __ldcs(reinterpret_cast<const float2*>(r0 + W));
                    v = fmaxf(fmaxf(u.x, u.y), fmaxf(l.x, l.y));
                } else {
                    v = fmaxf(fmaxf(__ldcs(r0), __ldcs(r0 + 1)), fmaxf(__ldcs(r0 + W), __ldcs(r0 + W + 1)));
                }
#pragma unroll
                for (int nn = 0; nn < PNC; ++nn) acc[bb][nn] = fmaf(v, wv[nn], acc[bb][nn]);
            }
        }
#pragma unroll
        for (int bb = 0; bb < PBB; ++bb)
#pragma unroll
            for (int nn = 0; nn < PNC; ++nn) {
                const float s = warp_sum(acc[bb][nn]);
                if (lane == 0) red[warp][bb * PNC + nn] = s;
            }
        __syncthreads();
        if (tid < PBB * PNC) {
            const int b = b0 + tid / PNC, n = n0 + tid % PNC;
            if (b < B && n < N) {
                float s = 0.f;
#pragma unroll
                for (int k = 0; k < PNT / 32; ++k) s += red[k][tid];
                part[((int64_t)c * B + b) * N + n] = s;
            }
        }
        __syncthreads();
    }
}

// out[b][n] = bias[n] + sum_c part[c][b][n]
__global__ void linear_reduce(float* __restrict__ out, const float* __restrict__ part, const float* __restrict__ bias,
                              int B, int C, int N) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, BN = (int64_t)B * N;
    if (i >= BN) return;
    float s = 0.f;
    for (int c = 0; c < C; ++c) s += part[c * BN + i];
    out[i] = s + __ldg(bias + i % N);
}

}  // namespace

// ------------------------------------------------------------------------------------------------ entry points
// y[B][Co][H][W] = relu(conv2d(x[B][Ci][H][W], w[Co][Ci][3][3], padding 1) + b)
extern "C" void conv3x3_relu(float* y, const float* x, const float* w, const float* b, int64_t B, int64_t Ci,
                             int64_t Co, int64_t H, int64_t W, cudaStream_t stream) {
    if (B <= 0 || Co <= 0 || H <= 0 || W <= 0) return;
    if (Ci == 3 && Direct<3>::smem((int)Co) <= 48 * 1024 && B <= 65535) {
        const dim3 grid((unsigned)((W + DW - 1) / DW), (unsigned)((H + DH - 1) / DH), (unsigned)B);
        conv3x3_direct<3><<<grid, DNT, Direct<3>::smem((int)Co), stream>>>(y, x, w, b, (int)Co, (int)H, (int)W);
        return;
    }
    cv::launch(y, x, w, B, Ci, H, W, Co, 3, 3, 1, 1, EpiBiasRelu{b}, stream);
}

// out[B][N] = flatten(maxpool2x2(y[B][C][H][W])) w[N][C * (H/2) * (W/2)]^T + b; part: C * B * N floats of scratch
extern "C" void maxpool_linear(float* out, float* part, const float* y, const float* w, const float* b, int64_t B,
                               int64_t C, int64_t H, int64_t W, int64_t N, cudaStream_t stream) {
    if (B <= 0 || N <= 0) return;
    if (C <= 0 || H < 2 || W < 2) {   // no features: the bias alone
        linear_reduce<<<(unsigned)((B * N + 255) / 256), 256, 0, stream>>>(out, part, b, (int)B, 0, (int)N);
        return;
    }
    const dim3 grid((unsigned)C, (unsigned)((B + PBB - 1) / PBB));
    if (W % 2 == 0 && aligned(y, 8))
        maxpool_linear_part<true><<<grid, PNT, 0, stream>>>(part, y, w, (int)B, (int)C, (int)H, (int)W, (int)N);
    else
        maxpool_linear_part<false><<<grid, PNT, 0, stream>>>(part, y, w, (int)B, (int)C, (int)H, (int)W, (int)N);
    linear_reduce<<<(unsigned)((B * N + 255) / 256), 256, 0, stream>>>(out, part, b, (int)B, (int)C, (int)N);
}
