// Sweep of how an elementwise stream is written, for the memory-bound solutions (level1/08_gelu,
// level2/07_swish_scale_add), in one run on one GPU:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 --use_fast_math -o stream_variants benchmarks/stream_variants.cu
//   ./stream_variants [--n ELEMENTS] [--reps R]
//
// Variants: cache hints on loads and stores (streaming .cs, as the solutions use now, or default),
// float4s per thread (U), and a grid of one pass (every float4 its own thread) or a grid-stride loop
// capped at 4 waves of resident blocks. Each: one checked launch (every output against a host
// reference, FAIL above 1e-5 relative), then R timed launches, each after an L2 flush (a 256 MiB
// memset), cudaEvents, median. Reported with the bytes moved per second; a device-to-device copy of
// the same bytes is the reference line.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_check.h"

namespace {

constexpr int NT = 256;

struct Gelu {
    static constexpr int inputs = 1;
    __device__ static float f(float x, float) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
    static double ref(double x, double) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
};
struct Swish {
    static constexpr int inputs = 2;
    __device__ static float f(float x, float y) { return x / (1.f + __expf(-x)) * 0.75f + y; }
    static double ref(double x, double y) { return x / (1.0 + std::exp(-x)) * 0.75 + y; }
};

template <bool CS>
__device__ __forceinline__ float4 ld(const float4* p) { if constexpr (CS) return __ldcs(p); else return *p; }
template <bool CS>
__device__ __forceinline__ void st(float4* p, float4 v) { if constexpr (CS) __stcs(p, v); else *p = v; }

template <class Op>
__device__ __forceinline__ float4 apply(float4 a, float4 b) {
    return make_float4(Op::f(a.x, b.x), Op::f(a.y, b.y), Op::f(a.z, b.z), Op::f(a.w, b.w));
}

// One pass: block b owns float4s [b * NT * U, (b + 1) * NT * U), all U loads in flight before the math.
template <class Op, int U, bool LCS, bool SCS>
__global__ void __launch_bounds__(NT) one_pass(float4* __restrict__ out, const float4* __restrict__ x,
                                               const float4* __restrict__ y, int64_t n4) {
    const int64_t base = (int64_t)blockIdx.x * (NT * U) + threadIdx.x;
    float4 a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * NT;
        if (i < n4) {
            a[u] = ld<LCS>(x + i);
            b[u] = Op::inputs == 2 ? ld<LCS>(y + i) : a[u];
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * NT;
        if (i < n4) st<SCS>(out + i, apply<Op>(a[u], b[u]));
    }
}

// Grid-stride: U float4s per thread per iteration, strided by the whole grid.
template <class Op, int U, bool LCS, bool SCS>
__global__ void __launch_bounds__(NT) strided(float4* __restrict__ out, const float4* __restrict__ x,
                                              const float4* __restrict__ y, int64_t n4) {
    const int64_t stride = (int64_t)gridDim.x * NT;
    for (int64_t i = (int64_t)blockIdx.x * NT + threadIdx.x; i < n4; i += U * stride) {
        float4 a[U], b[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * stride < n4) {
                a[u] = ld<LCS>(x + i + u * stride);
                b[u] = Op::inputs == 2 ? ld<LCS>(y + i + u * stride) : a[u];
            }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * stride < n4) st<SCS>(out + i + u * stride, apply<Op>(a[u], b[u]));
    }
}

struct Buffers {
    float *x, *y, *out, *flush;
    int64_t n;
    size_t flush_bytes = 256u << 20;
};

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <class Launch>
float time_ms(const Buffers& b, int reps, Launch launch) {
    cudaEvent_t s, e;
    CK(cudaEventCreate(&s));
    CK(cudaEventCreate(&e));
    std::vector<float> times;
    for (int r = 0; r < reps + 2; ++r) {
        CK(cudaMemsetAsync(b.flush, r & 0xff, b.flush_bytes));
        CK(cudaEventRecord(s));
        launch();
        CK(cudaEventRecord(e));
        CK(cudaEventSynchronize(e));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, s, e));
        if (r >= 2) times.push_back(ms);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(s));
    CK(cudaEventDestroy(e));
    return median(times);
}

template <class Op>
bool check(const Buffers& b, const std::vector<float>& hx, const std::vector<float>& hy) {
    std::vector<float> got(b.n);
    CK(cudaMemcpy(got.data(), b.out, b.n * 4, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < b.n; ++i) {
        const double want = Op::ref(hx[i], hy[i]);
        if (!(std::fabs(got[i] - want) <= 1e-5 * std::max(1.0, std::fabs(want)))) return false;
    }
    return true;
}

template <class Op, int U, bool LCS, bool SCS>
void variant(const Buffers& b, int reps, int sms, const std::vector<float>& hx,
             const std::vector<float>& hy, bool grid_stride) {
    const int64_t n4 = b.n / 4;
    auto* o = reinterpret_cast<float4*>(b.out);
    auto* x = reinterpret_cast<const float4*>(b.x);
    auto* y = reinterpret_cast<const float4*>(b.y);
    const int64_t blocks = grid_stride ? std::min<int64_t>((n4 + NT - 1) / NT, (int64_t)sms * 8 * 4)
                                       : (n4 + NT * U - 1) / (NT * U);
    auto launch = [&] {
        if (grid_stride) strided<Op, U, LCS, SCS><<<(unsigned)blocks, NT>>>(o, x, y, n4);
        else one_pass<Op, U, LCS, SCS><<<(unsigned)blocks, NT>>>(o, x, y, n4);
    };
    CK(cudaMemset(b.out, 0, b.n * 4));
    launch();
    CK(cudaDeviceSynchronize());
    const bool ok = check<Op>(b, hx, hy);
    const float ms = time_ms(b, reps, launch);
    const double bytes = (double)b.n * 4 * (Op::inputs + 1);
    std::printf("%-6s %-11s U=%d loads=%-7s stores=%-7s %s  %8.4f ms  %7.1f GB/s\n",
                Op::inputs == 1 ? "gelu" : "swish", grid_stride ? "grid-stride" : "one-pass", U,
                LCS ? "cs" : "default", SCS ? "cs" : "default", ok ? "PASS" : "FAIL", ms, bytes / ms / 1e6);
}

// The first: the gelu solution's kernel now; the third: the swish solution's.
template <class Op>
void sweep(const Buffers& b, int reps, int sms, const std::vector<float>& hx, const std::vector<float>& hy) {
    variant<Op, 2, true, true>(b, reps, sms, hx, hy, true);
    variant<Op, 2, false, false>(b, reps, sms, hx, hy, true);
    variant<Op, 4, true, true>(b, reps, sms, hx, hy, false);
    variant<Op, 4, false, false>(b, reps, sms, hx, hy, false);
    variant<Op, 4, true, false>(b, reps, sms, hx, hy, false);
    variant<Op, 4, false, true>(b, reps, sms, hx, hy, false);
    variant<Op, 1, false, false>(b, reps, sms, hx, hy, false);
    variant<Op, 1, true, true>(b, reps, sms, hx, hy, false);
    variant<Op, 2, false, false>(b, reps, sms, hx, hy, false);
    variant<Op, 8, false, false>(b, reps, sms, hx, hy, false);
}

}  // namespace

int main(int argc, char** argv) {
    int64_t n = 8192LL * 8192;   // level1/08_gelu's input; level2/07's two inputs are 4096 x 16384 each
    int reps = 30;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!std::strcmp(argv[i], "--n")) n = std::atoll(argv[i + 1]);
        else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
        else { std::fprintf(stderr, "usage: %s [--n ELEMENTS] [--reps R]\n", argv[0]); return 2; }
    }
    n -= n % 4;
    int dev = 0, sms = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    Buffers b{};
    b.n = n;
    CK(cudaMalloc(&b.x, n * 4));
    CK(cudaMalloc(&b.y, n * 4));
    CK(cudaMalloc(&b.out, n * 4));
    CK(cudaMalloc(&b.flush, b.flush_bytes));
    std::vector<float> hx(n), hy(n);
    std::mt19937 rng(0);
    std::normal_distribution<float> dist;
    for (int64_t i = 0; i < n; ++i) hx[i] = dist(rng), hy[i] = dist(rng);
    CK(cudaMemcpy(b.x, hx.data(), n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b.y, hy.data(), n * 4, cudaMemcpyHostToDevice));
    const float copy = time_ms(b, reps, [&] { CK(cudaMemcpyAsync(b.out, b.x, n * 4, cudaMemcpyDeviceToDevice)); });
    std::printf("copy   cudaMemcpyAsync D2D, %lld floats  %8.4f ms  %7.1f GB/s\n", (long long)n, copy,
                2.0 * n * 4 / copy / 1e6);
    sweep<Gelu>(b, reps, sms, hx, hy);
    sweep<Swish>(b, reps, sms, hx, hy);
    return 0;
}
