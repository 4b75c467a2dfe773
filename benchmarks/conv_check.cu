// Correctness check and timing of the CUDA conv2d solutions built on the 3xTF32 implicit GEMM, on one GPU.
// One program per kernel, picked with -DCHECK=conv2d|relu_bias|bn_relu (default conv2d); they cannot share a
// translation unit (each .cu includes its own copy of conv.cuh and defines an anonymous-namespace Epi):
//   conv2d:    kernels/solutions/level1/02_conv2d/kernels/conv2d.cu                 (conv + bias, padding)
//   relu_bias: kernels/solutions/level2/03_conv2d_relu_bias/kernels/conv_relu_bias.cu (relu(conv + cb) + bias)
//   bn_relu:   kernels/solutions/level2/04_conv2d_batchnorm_relu/kernels/conv_bn_relu.cu
//              (relu((conv + cb - mean) * gamma / sqrt(var + eps) + beta), eps = 1e-5)
// (all three through kernels/conv.cuh, one header copied into each solution, stride 1; the level-2 ones
// through its unpadded variant)
//
//   for c in conv2d relu_bias bn_relu; do
//     nvcc -O3 -std=c++17 -arch=sm_90 -DCHECK=$c -o conv_check_$c benchmarks/conv_check.cu && ./conv_check_$c
//   done
//   (add --use_fast_math to build them with the evaluator's flags)
//
// For each shape: random inputs (x ~ U(-2, 2); w, conv bias ~ U(-1/sqrt(K), 1/sqrt(K)) as nn.Conv2d's init;
// the level-2 bias ~ U(-0.2, 0.2); BatchNorm mean, beta ~ U(-0.2, 0.2), var, gamma ~ U(0.5, 1.5) as the
// task's), the kernel on a non-default stream into an output pre-filled with NaN, compared with a naive
// direct convolution plus the epilogue computed on the GPU in fp64: PASS when every output is finite and
// max |err| / max(1, mean |ref|) < 1e-5. One shape per kernel passes misaligned w / out pointers (the 4-byte
// weight loads and scalar stores). Then the task's GPU shape (conv2d: N=32, C=CO=128, 128x128, 3x3, pad 1;
// relu_bias: N=32, C=64, CO=128, 128x128, 3x3; bn_relu: N=32, C=CO=128, 128x128, 3x3) is timed: median of
// 20 cudaEvent-timed calls after 3 warm-ups, in ms and TFLOP/s (2*N*CO*OH*OW*C*KH*KW / t).
// Exit status 1 on any failure.
#define CHECK_ID_conv2d 1
#define CHECK_ID_relu_bias 2
#define CHECK_ID_bn_relu 3
#ifndef CHECK
#define CHECK conv2d
#endif
#define CHECK_CAT2(a, b) a##b
#define CHECK_CAT(a, b) CHECK_CAT2(a, b)
#define CHECK_ID CHECK_CAT(CHECK_ID_, CHECK)

#if CHECK_ID == 1
#include "../kernels/solutions/level1/02_conv2d/kernels/conv2d.cu"
#elif CHECK_ID == 2
#include "../kernels/solutions/level2/03_conv2d_relu_bias/kernels/conv_relu_bias.cu"
#elif CHECK_ID == 3
#include "../kernels/solutions/level2/04_conv2d_batchnorm_relu/kernels/conv_bn_relu.cu"
#else
#error "CHECK must be conv2d, relu_bias or bn_relu"
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_check.h"

namespace {

#if CHECK_ID == 1
constexpr const char* kName = "conv2d (level1/02)";
constexpr int kChans = 1;   // bias
#elif CHECK_ID == 2
constexpr const char* kName = "conv_relu_bias (level2/03)";
constexpr int kChans = 2;   // conv bias, bias
#else
constexpr const char* kName = "conv_bn_relu (level2/04)";
constexpr int kChans = 5;   // conv bias, running mean, running var, gamma, beta
constexpr double kEps = 1e-5;   // BatchNorm2d's default
#endif

struct Chan {
    const float* c[5];
};

// fp64 direct convolution and this program's epilogue
__global__ void ref_conv(double* __restrict__ ref, const float* __restrict__ x, const float* __restrict__ w,
                         const Chan ch, int64_t N, int64_t C, int64_t H, int64_t W, int64_t CO,
                         int64_t KH, int64_t KW, int64_t ph, int64_t pw, int64_t OH, int64_t OW) {
    const int64_t total = N * CO * OH * OW;
    for (int64_t o = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; o < total;
         o += (int64_t)gridDim.x * blockDim.x) {
        const int64_t ow = o % OW, oh = (o / OW) % OH, co = (o / (OW * OH)) % CO, n = o / (OW * OH * CO);
        double s = 0;
        for (int64_t ci = 0; ci < C; ++ci) {
            const float* xc = x + (n * C + ci) * H * W;
            const float* wc = w + (co * C + ci) * KH * KW;
            for (int64_t kh = 0; kh < KH; ++kh) {
                const int64_t ih = oh - ph + kh;
                if (ih < 0 || ih >= H) continue;
                for (int64_t kw = 0; kw < KW; ++kw) {
                    const int64_t iw = ow - pw + kw;
                    if (iw < 0 || iw >= W) continue;
                    s += (double)xc[ih * W + iw] * (double)wc[kh * KW + kw];
                }
            }
        }
#if CHECK_ID == 1
        ref[o] = s + ch.c[0][co];
#elif CHECK_ID == 2
        ref[o] = fmax(s + ch.c[0][co], 0.0) + ch.c[1][co];
#else
        ref[o] = fmax((s + ch.c[0][co] - ch.c[1][co]) * ch.c[3][co] / sqrt((double)ch.c[2][co] + kEps) + ch.c[4][co],
                      0.0);
#endif
    }
}

struct Shape {
    int64_t N, C, H, W, CO, KH, KW, ph, pw;   // ph, pw must be 0 for the level-2 kernels
    bool misalign;   // w and out one float past a 16-byte boundary
    bool timed;
};

void call(float* out, const float* x, const float* w, const Chan& ch, const Shape& s, cudaStream_t stream) {
#if CHECK_ID == 1
    conv2d(out, x, w, ch.c[0], s.N, s.C, s.H, s.W, s.CO, s.KH, s.KW, s.ph, s.pw, stream);
#elif CHECK_ID == 2
    conv_relu_bias(out, x, w, ch.c[0], ch.c[1], s.N, s.C, s.H, s.W, s.CO, s.KH, s.KW, stream);
#else
    conv_bn_relu(out, x, w, ch.c[0], ch.c[1], ch.c[2], ch.c[3], ch.c[4], kEps, s.N, s.C, s.H, s.W, s.CO, s.KH,
                 s.KW, stream);
#endif
}

bool run_shape(const Shape& s, cudaStream_t stream) {
    const int64_t OH = s.H + 2 * s.ph - s.KH + 1, OW = s.W + 2 * s.pw - s.KW + 1;
    const int64_t nx = s.N * s.C * s.H * s.W, K = s.C * s.KH * s.KW, nw = s.CO * K, no = s.N * s.CO * OH * OW;
    const int off = s.misalign ? 1 : 0;

    std::mt19937 rng(12345);
    std::uniform_real_distribution<float> ux(-2.f, 2.f);
    const float bound = 1.f / std::sqrt((float)std::max<int64_t>(K, 1));
    std::uniform_real_distribution<float> uw(-bound, bound);
    std::uniform_real_distribution<float> usmall(-0.2f, 0.2f), upos(0.5f, 1.5f);
    std::vector<float> hx(nx), hw(nw), hc[kChans];
    for (auto& v : hx) v = ux(rng);
    for (auto& v : hw) v = uw(rng);
    for (int c = 0; c < kChans; ++c) {
        hc[c].resize(s.CO);
        for (auto& v : hc[c]) {
            if (c == 0) v = uw(rng);                                     // the conv's bias
            else if (kChans == 5 && (c == 2 || c == 3)) v = upos(rng);   // running var, gamma
            else v = usmall(rng);                                        // bias, running mean, beta
        }
    }

    float *dx, *dw, *dout, *dc[kChans];
    double* dref;
    CK(cudaMalloc(&dx, std::max<int64_t>(nx, 1) * sizeof(float)));
    CK(cudaMalloc(&dw, (nw + off) * sizeof(float)));
    CK(cudaMalloc(&dout, (no + off) * sizeof(float)));
    CK(cudaMalloc(&dref, no * sizeof(double)));
    CK(cudaMemcpy(dx, hx.data(), nx * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw + off, hw.data(), nw * sizeof(float), cudaMemcpyHostToDevice));
    Chan ch{};
    for (int c = 0; c < kChans; ++c) {
        CK(cudaMalloc(&dc[c], s.CO * sizeof(float)));
        CK(cudaMemcpy(dc[c], hc[c].data(), s.CO * sizeof(float), cudaMemcpyHostToDevice));
        ch.c[c] = dc[c];
    }
    CK(cudaMemset(dout, 0xff, (no + off) * sizeof(float)));   // NaN: unwritten outputs fail

    call(dout + off, dx, dw + off, ch, s, stream);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(stream));
    ref_conv<<<4096, 256, 0, stream>>>(dref, dx, dw + off, ch, s.N, s.C, s.H, s.W, s.CO, s.KH, s.KW, s.ph, s.pw,
                                       OH, OW);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(stream));

    std::vector<float> hout(no);
    std::vector<double> href(no);
    CK(cudaMemcpy(hout.data(), dout + off, no * sizeof(float), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(href.data(), dref, no * sizeof(double), cudaMemcpyDeviceToHost));
    double maxerr = 0, sumabs = 0;
    int64_t nonfinite = 0, worst = 0;
    for (int64_t i = 0; i < no; ++i) {
        sumabs += std::fabs(href[i]);
        if (!std::isfinite(hout[i])) { ++nonfinite; continue; }
        const double e = std::fabs((double)hout[i] - href[i]);
        if (e > maxerr) { maxerr = e; worst = i; }
    }
    const double rel = maxerr / std::max(1.0, sumabs / (double)std::max<int64_t>(no, 1));
    const bool ok = nonfinite == 0 && rel < 1e-5;
    std::printf("%s  N=%lld C=%lld H=%lld W=%lld CO=%lld K=%lldx%lld pad=%lld,%lld%s: max|err|=%.3e (at %lld) "
                "mean|ref|=%.3e rel=%.3e non-finite=%lld\n",
                ok ? "PASS" : "FAIL", (long long)s.N, (long long)s.C, (long long)s.H, (long long)s.W,
                (long long)s.CO, (long long)s.KH, (long long)s.KW, (long long)s.ph, (long long)s.pw,
                s.misalign ? " (misaligned w/out)" : "", maxerr, (long long)worst, sumabs / std::max<int64_t>(no, 1),
                rel, (long long)nonfinite);

    if (s.timed) {
        constexpr int R = 20;
        const std::vector<float> ms =
            event_times_ms([&] { call(dout + off, dx, dw + off, ch, s, stream); }, 3, R, stream);
        if (ms.empty()) {
            std::fprintf(stderr, "a timed launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
            std::exit(1);
        }
        const double med = median_ms(ms);
        const double flop = 2.0 * s.N * s.CO * OH * OW * s.C * s.KH * s.KW;
        std::printf("TIME  N=%lld C=%lld H=%lld W=%lld CO=%lld K=%lldx%lld: median %.3f ms (min %.3f, max %.3f), "
                    "%.1f TFLOP/s (%.1f GFLOP)\n",
                    (long long)s.N, (long long)s.C, (long long)s.H, (long long)s.W, (long long)s.CO,
                    (long long)s.KH, (long long)s.KW, med, ms[0], ms[R - 1], flop / (med * 1e-3) / 1e12, flop / 1e9);
    }
    CK(cudaFree(dx));
    CK(cudaFree(dw));
    CK(cudaFree(dout));
    CK(cudaFree(dref));
    for (int c = 0; c < kChans; ++c) CK(cudaFree(dc[c]));
    return ok;
}

}  // namespace

int main() {
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const Shape shapes[] = {
    // N   C    H    W   CO  KH KW ph pw misalign timed
#if CHECK_ID == 1
        {3, 5, 17, 19, 7, 3, 3, 1, 1, false, false},        // K=45 (4-byte weight loads), odd pixels
        {1, 64, 33, 31, 130, 1, 1, 0, 0, false, false},     // 1x1, two co tiles, odd pixels
        {2, 6, 23, 21, 9, 5, 5, 2, 2, false, false},        // 5x5, K=150
        {2, 12, 20, 22, 40, 3, 3, 1, 1, true, false},       // K=108, misaligned w/out: scalar paths
        {2, 9, 11, 9, 20, 3, 5, 1, 2, false, false},        // 3x5 kernel
        {2, 32, 16, 16, 256, 3, 3, 1, 1, false, false},     // K=288, two co tiles, float2 stores
        {32, 128, 128, 128, 128, 3, 3, 1, 1, false, true},  // the task's GPU shape, timed
#else
        {3, 5, 17, 19, 7, 3, 3, 0, 0, false, false},        // K=45 (4-byte weight loads), 15x17 odd pixels
        {1, 64, 33, 31, 130, 1, 1, 0, 0, false, false},     // 1x1, two co tiles, odd pixels
        {2, 12, 20, 22, 40, 3, 3, 0, 0, true, false},       // K=108, misaligned w/out: scalar paths
        {2, 9, 11, 9, 200, 3, 5, 0, 0, false, false},       // 3x5 kernel, K=135, two co tiles (second partial)
#if CHECK_ID == 2
        {32, 64, 128, 128, 128, 3, 3, 0, 0, false, true},   // the task's GPU shape, timed
#else
        {32, 128, 128, 128, 128, 3, 3, 0, 0, false, true},  // the task's GPU shape, timed
#endif
#endif
    };
    std::printf("%s\n", kName);
    bool ok = true;
    for (const auto& s : shapes) ok &= run_shape(s, stream);
    CK(cudaStreamDestroy(stream));
    std::printf(ok ? "ALL PASS\n" : "SOME FAILED\n");
    return ok ? 0 : 1;
}
