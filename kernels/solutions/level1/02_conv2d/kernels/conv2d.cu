// Stride-1 NCHW conv2d with bias as an implicit GEMM on CUDA cores (fp32, no TF32):
// per image n, out[n] (CO x OH*OW) = W (CO x C*KH*KW, the weight's own layout) @ im2col(x[n]).
// 128x128x8 block tile, 256 threads, 8x8 outputs per thread, register prefetch + double-buffered
// shared memory. The im2col B tile is gathered on the fly (zero padding by bounds checks); each
// thread's 4 output pixels are fixed, so their (oh, ow) are decoded once.
#include <cstdint>
#include <cuda_runtime.h>

namespace {
constexpr int BM = 128, BN = 128, BK = 8, NT = 256, APAD = 4;

__global__ void __launch_bounds__(NT, 2)
conv_igemm_kernel(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ w,
                  const float* __restrict__ bias, int C, int H, int W, int CO, int KH, int KW,
                  int ph, int pw, int OH, int OW, bool vec_out) {
    __shared__ __align__(16) float As[2][BK][BM + APAD];
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x;
    const int n = blockIdx.z;
    const int P = OH * OW, KHW = KH * KW, Kd = C * KHW;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const float* xn = x + (int64_t)n * C * H * W;
    float* on = out + (int64_t)n * CO * P;

    const int a_row = tid >> 1, a_col = (tid & 1) * 4;   // weight tile: 128 co x 8 k
    const int b_row = tid >> 5, b_col = (tid & 31) * 4;  // im2col tile: 8 k x 128 pixels
    const bool a_mok = m0 + a_row < CO;
    const float* Ap = w + (int64_t)(m0 + a_row) * Kd + a_col;

    int oh[4], ow[4];  // top-left input coordinate of each of this thread's 4 pixels
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int p = n0 + b_col + j;
        oh[j] = p < P ? p / OW - ph : -(1 << 29);  // out-of-range pixels always fail the bounds check
        ow[j] = p % OW - pw;
    }

    float4 ra, rb;
    auto load = [&](int k0) {
        const int gk = k0 + a_col;
        ra.x = (a_mok && gk + 0 < Kd) ? __ldg(Ap + k0 + 0) : 0.f;
        ra.y = (a_mok && gk + 1 < Kd) ? __ldg(Ap + k0 + 1) : 0.f;
        ra.z = (a_mok && gk + 2 < Kd) ? __ldg(Ap + k0 + 2) : 0.f;
        ra.w = (a_mok && gk + 3 < Kd) ? __ldg(Ap + k0 + 3) : 0.f;
        const int k = k0 + b_row;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (k < Kd) {
            const int ci = k / KHW, r = k - ci * KHW;
            const int kh = r / KW, kw = r - kh * KW;
            const float* xc = xn + (int64_t)ci * H * W;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int ih = oh[j] + kh, iw = ow[j] + kw;
                if ((unsigned)ih < (unsigned)H && (unsigned)iw < (unsigned)W) v[j] = __ldg(xc + ih * W + iw);
            }
        }
        rb = make_float4(v[0], v[1], v[2], v[3]);
    };
    auto store = [&](int buf) {
        As[buf][a_col + 0][a_row] = ra.x;
        As[buf][a_col + 1][a_row] = ra.y;
        As[buf][a_col + 2][a_row] = ra.z;
        As[buf][a_col + 3][a_row] = ra.w;
        *reinterpret_cast<float4*>(&Bs[buf][b_row][b_col]) = rb;
    };

    const int tx = tid & 15, ty = tid >> 4;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    load(0);
    store(0);
    __syncthreads();
    int buf = 0;
    for (int k0 = 0; k0 < Kd; k0 += BK) {
        const bool has_next = k0 + BK < Kd;
        if (has_next) load(k0 + BK);
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[buf][kk][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[buf][kk][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][kk][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][kk][64 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (has_next) {
            store(buf ^ 1);
            __syncthreads();
            buf ^= 1;
        }
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int co = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
        if (co >= CO) continue;
        const float bv = __ldg(bias + co);
        float* op = on + (int64_t)co * P;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int p = n0 + h * 64 + tx * 4;
            if (vec_out && p + 3 < P) {
                *reinterpret_cast<float4*>(op + p) = make_float4(acc[i][h * 4 + 0] + bv, acc[i][h * 4 + 1] + bv,
                                                                 acc[i][h * 4 + 2] + bv, acc[i][h * 4 + 3] + bv);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (p + j < P) op[p + j] = acc[i][h * 4 + j] + bv;
            }
        }
    }
}
}  // namespace

extern "C" void conv2d(float* out, const float* x, const float* w, const float* bias,
                       int64_t N, int64_t C, int64_t H, int64_t W, int64_t CO, int64_t KH, int64_t KW,
                       int64_t ph, int64_t pw, cudaStream_t stream) {
    const int64_t OH = H + 2 * ph - KH + 1, OW = W + 2 * pw - KW + 1;
    if (N <= 0 || CO <= 0 || OH <= 0 || OW <= 0) return;
    const int64_t P = OH * OW;
    const bool vec_out = P % 4 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
    dim3 grid((unsigned)((P + BN - 1) / BN), (unsigned)((CO + BM - 1) / BM), (unsigned)N);
    conv_igemm_kernel<<<grid, NT, 0, stream>>>(out, x, w, bias, (int)C, (int)H, (int)W, (int)CO, (int)KH,
                                                (int)KW, (int)ph, (int)pw, (int)OH, (int)OW, vec_out);
}
