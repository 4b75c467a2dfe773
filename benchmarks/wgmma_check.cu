// Check and timing of the wgmma 3xTF32 GEMM (kernels/solutions/level1/01_matmul/kernels/wgmma.cuh) against sgemm.cuh's mma.sync kernel.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o wgmma_check benchmarks/wgmma_check.cu
//   (or scripts/h200-run.sh wgmma)
//   ./wgmma_check [--reps R] [--warmup W] [--no-check] [--mask BITS]
//   (-gencode=arch=compute_90a,code=sm_90a is -arch=sm_90a; HOPPER.md recommends this form for nvcc 13.0)
//
// Variants (kVariants; --mask bit i selects the i-th, default all): wg::DefaultCfg and other wg::Cfg
// choices; "direct-acc" accumulates on the tensor cores straight into the accumulators, is not
// fp32-accurate at K = 4096, and is only checked there and timed as a speed reference.
// Checks (both B layouts: [N][K] kBKMajor = true, [K][N] kBKMajor = false), against an fp64 host reference,
// error = max |C - ref| / max(1, mean |ref|), FAIL above 1e-4 or on any non-finite output (C is NaN-filled
// before each launch): 4096^3, batch 8 x 2048^3 and 4096 x 4096 x 1023 (2048 sampled outputs per
// batch); 129 x 257 x 67, 1000^3, batch 3 x 150 x 200 x 163 with a bias + ReLU epilogue, and batch 2 x
// 300 x 260 x 200 (odd number of row tiles) (all outputs); the row epilogues (sum-of-squares row scale,
// softmax partials) at 300 x 333 x 200 and 129 x 1000 x 1023 (all outputs). K = 1023 and 67 take the A-copy path.
// Then timings (median of R launches after W warm-up launches, cudaEvents, L2 not flushed, each wg row
// including its B pre-pass) of 4096^3 for both layouts and batch 8 x 2048^3 ([K][N]): every variant, the
// pre-pass alone, and sg::launch (sgemm.cuh's DefaultCfg) on the same data.
#include "../kernels/solutions/level1/01_matmul/kernels/wgmma.cuh"
#include "sgemm.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_check.h"

namespace {

constexpr double kTol = 1e-4;

struct EpiBiasRelu {
    static constexpr bool kRowSS = false, kGain = false, kRowStats = false, kAtomic = false;
    float* C;
    const float* gain = nullptr;
    float* stats = nullptr;
    const float* bias;
    __device__ float apply(float acc, int64_t, int64_t col) const { return fmaxf(acc + __ldg(bias + col), 0.f); }
};

// fast host randn: xorshift64* + Box-Muller
std::vector<float> randn(size_t n, uint64_t seed) {
    std::vector<float> v(n);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    auto next = [&]() {
        s ^= s >> 12; s ^= s << 25; s ^= s >> 27;
        return (double)((s * 0x2545F4914F6CDD1Dull) >> 11) * (1.0 / 9007199254740992.0);
    };
    for (size_t i = 0; i < n; i += 2) {
        const double u1 = std::max(next(), 1e-300), u2 = next();
        const double r = std::sqrt(-2.0 * std::log(u1));
        v[i] = (float)(r * std::cos(6.283185307179586 * u2));
        if (i + 1 < n) v[i + 1] = (float)(r * std::sin(6.283185307179586 * u2));
    }
    return v;
}

struct Case {
    int64_t M, N, K;
    int batch;
    bool full;   // all outputs checked (else 2048 sampled per batch)
    bool epi;    // bias + ReLU epilogue
};

float* g_ws = nullptr;
size_t g_ws_bytes = 0;

void ensure_ws(size_t bytes) {
    if (bytes <= g_ws_bytes) return;
    if (g_ws) CK(cudaFree(g_ws));
    CK(cudaMalloc(&g_ws, bytes));
    g_ws_bytes = bytes;
}

// one launch of wg::launch<.., kBK, Cfg> on the batch-strided problem (bias + ReLU epilogue when bias)
template <bool kBK, class Cfg>
void wg_run(const float* A, const float* B, int64_t M, int64_t N, int64_t K, float* C, const float* bias, int bt) {
    if (bias) {
        EpiBiasRelu e;
        e.C = C; e.bias = bias;
        wg::launch<EpiBiasRelu, kBK, Cfg>(A, B, M, N, K, e, 0, g_ws, bt, M * K, N * K, M * N);
    } else {
        sg::Plain e;
        e.C = C;
        wg::launch<sg::Plain, kBK, Cfg>(A, B, M, N, K, e, 0, g_ws, bt, M * K, N * K, M * N);
    }
}
using RunFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*, const float*, int);
struct Variant {
    const char* name;
    RunFn bk, kn;   // B [N][K], B [K][N]
    bool accurate;  // expected to pass
};
#define WG_VARIANT(NAME, CFG, ACC) Variant{NAME, wg_run<true, CFG>, wg_run<false, CFG>, ACC}
using CfgKT2 = wg::Cfg<4, true, 2, 1>;
using CfgCL2 = wg::Cfg<4, true, 1, 2>;
using CfgKT2CL2 = wg::Cfg<4, true, 2, 2>;
using CfgDirect = wg::Cfg<4, false, 1, 1>;
using CfgPP = wg::Cfg<4, true, 1, 1, true>;
using CfgKT2PP = wg::Cfg<4, true, 2, 1, true>;
// the default configuration first
const Variant kVariants[] = {
    WG_VARIANT("wg default", wg::DefaultCfg, true),
    WG_VARIANT("wg KT2", CfgKT2, true),
    WG_VARIANT("wg cluster2", CfgCL2, true),
    WG_VARIANT("wg KT2+cluster2", CfgKT2CL2, true),
    WG_VARIANT("wg pingpong", CfgPP, true),
    WG_VARIANT("wg KT2+pingpong", CfgKT2PP, true),
    WG_VARIANT("wg direct-acc (inaccurate)", CfgDirect, false),
};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);
unsigned g_mask = ~0u;   // --mask: bit i selects kVariants[i]

// checks every variant (the inaccurate ones only at 4096^3) on one problem; returns whether all
// accurate variants passed
template <bool kBK>
bool run_case(const Case& c) {
    const int64_t M = c.M, N = c.N, K = c.K;
    const int bt = c.batch;
    std::vector<float> A = randn((size_t)bt * M * K, 11 + M + K), B = randn((size_t)bt * N * K, 12 + N + K),
                       bias = randn((size_t)N, 13);
    float *dA, *dB, *dC, *dBias;
    CK(cudaMalloc(&dA, A.size() * 4));
    CK(cudaMalloc(&dB, B.size() * 4));
    CK(cudaMalloc(&dC, (size_t)bt * M * N * 4));
    CK(cudaMalloc(&dBias, N * 4));
    CK(cudaMemcpy(dA, A.data(), A.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, B.data(), B.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dBias, bias.data(), N * 4, cudaMemcpyHostToDevice));
    ensure_ws(wg::workspace_bytes(M, N, K, bt, dA, M * K));
    // reference (B as [N][K] rows) at the checked outputs
    std::vector<int64_t> idx;   // flat index into C
    std::vector<double> ref;
    double mean = 0;
    {
        std::vector<float> bn((size_t)N * K);
        uint64_t rs = 7;
        for (int b = 0; b < bt; ++b) {
            const float* Bb = &B[(size_t)b * N * K];
            if (kBK) std::copy(Bb, Bb + N * K, bn.begin());
            else
                for (int64_t k = 0; k < K; ++k)
                    for (int64_t n = 0; n < N; ++n) bn[n * K + k] = Bb[k * N + n];
            auto one = [&](int64_t m, int64_t n) {
                const float* a = &A[((size_t)b * M + m) * K];
                const float* w = &bn[(size_t)n * K];
                double s = 0;
                for (int64_t k = 0; k < K; ++k) s += (double)a[k] * w[k];
                if (c.epi) s = std::max(s + bias[n], 0.0);
                ref.push_back(s);
                idx.push_back(((int64_t)b * M + m) * N + n);
                mean += std::fabs(s);
            };
            if (c.full) {
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t n = 0; n < N; ++n) one(m, n);
            } else {
                one(0, 0); one(0, N - 1); one(M - 1, 0); one(M - 1, N - 1);
                for (int i = 4; i < 2048; ++i) {
                    rs = rs * 6364136223846793005ull + 1442695040888963407ull;
                    const int64_t m = (int64_t)((rs >> 33) % (uint64_t)M);
                    rs = rs * 6364136223846793005ull + 1442695040888963407ull;
                    const int64_t n = (int64_t)((rs >> 33) % (uint64_t)N);
                    one(m, n);
                }
            }
        }
    }
    const double scale = std::max(1.0, mean / (double)ref.size());
    bool all = true;
    std::vector<float> C((size_t)bt * M * N);
    for (int vi = 0; vi < kNumVariants; ++vi) {
        const Variant& v = kVariants[vi];
        if (!(g_mask >> vi & 1)) continue;
        if (!v.accurate && !(M == 4096 && K == 4096)) continue;
        CK(cudaMemset(dC, 0xff, (size_t)bt * M * N * 4));   // NaN: anything not written fails
        (kBK ? v.bk : v.kn)(dA, dB, M, N, K, dC, c.epi ? dBias : nullptr, bt);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(C.data(), dC, C.size() * 4, cudaMemcpyDeviceToHost));
        int64_t bad = 0;
        for (float x : C) bad += !std::isfinite(x);
        double worst = 0;
        for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::fabs((double)C[idx[i]] - ref[i]) / scale);
        const bool ok = bad == 0 && worst <= kTol;
        if (v.accurate) all &= ok;
        std::printf("check %-18s %-6s batch %d  M %5lld N %5lld K %5lld %s%s  max err %.2e  nonfinite %lld  %s\n",
                    v.name, kBK ? "[N][K]" : "[K][N]", bt, (long long)M, (long long)N, (long long)K,
                    c.full ? "full" : "sampled", c.epi ? " bias+relu" : "", worst, (long long)bad,
                    ok ? "PASS" : (v.accurate ? "FAIL" : "FAIL (expected: not fp32-accurate)"));
        std::fflush(stdout);
    }
    CK(cudaFree(dA)); CK(cudaFree(dB)); CK(cudaFree(dC)); CK(cudaFree(dBias));
    return all;
}

// The row epilogues (DefaultCfg, B [N][K]): C = (A B^T) * rsqrt(ss / K + eps) + bias (kRowSS) and the
// per-(row, 128-column tile) softmax partials of C (kRowStats), all outputs against the fp64 reference.
struct EpiRowSSStats {
    static constexpr bool kRowSS = true, kRowStats = true;
    float* C;
    float* stats;
    const float* bias;
    float invK, eps;
    __device__ float apply(float acc, int64_t, int64_t col) const { return acc + __ldg(bias + col); }
    __device__ float row_scale(float ss) const { return rsqrtf(ss * invK + eps); }
};

bool check_row_epilogues(int64_t M, int64_t N, int64_t K) {
    const float eps = 1e-6f;
    const int64_t ntn = (N + 127) / 128;
    std::vector<float> A = randn((size_t)M * K, 21), B = randn((size_t)N * K, 22), bias = randn((size_t)N, 23);
    float *dA, *dB, *dC, *dS, *dBias;
    CK(cudaMalloc(&dA, A.size() * 4));
    CK(cudaMalloc(&dB, B.size() * 4));
    CK(cudaMalloc(&dC, (size_t)M * N * 4));
    CK(cudaMalloc(&dS, (size_t)M * ntn * 2 * 4));
    CK(cudaMalloc(&dBias, N * 4));
    CK(cudaMemcpy(dA, A.data(), A.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, B.data(), B.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dBias, bias.data(), N * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dC, 0xff, (size_t)M * N * 4));
    CK(cudaMemset(dS, 0xff, (size_t)M * ntn * 2 * 4));
    ensure_ws(wg::workspace_bytes(M, N, K, 1, dA, 0));
    EpiRowSSStats e;
    e.C = dC; e.stats = dS; e.bias = dBias; e.invK = 1.f / (float)K; e.eps = eps;
    wg::launch<EpiRowSSStats, true>(dA, dB, M, N, K, e, 0, g_ws);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> C((size_t)M * N), S((size_t)M * ntn * 2);
    CK(cudaMemcpy(C.data(), dC, C.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(S.data(), dS, S.size() * 4, cudaMemcpyDeviceToHost));
    double worst_c = 0, worst_m = 0, worst_s = 0;
    std::vector<double> ref(N);
    for (int64_t m = 0; m < M; ++m) {
        double ss = 0;
        for (int64_t k = 0; k < K; ++k) ss += (double)A[m * K + k] * A[m * K + k];
        const double scale = 1.0 / std::sqrt(ss / K + eps);
        for (int64_t n = 0; n < N; ++n) {
            double d = 0;
            for (int64_t k = 0; k < K; ++k) d += (double)A[m * K + k] * B[n * K + k];
            ref[n] = d * scale + bias[n];
            const double err = std::fabs(C[m * N + n] - ref[n]);
            worst_c = std::isfinite(C[m * N + n]) ? std::max(worst_c, err) : INFINITY;
        }
        for (int64_t t = 0; t < ntn; ++t) {
            double mx = -INFINITY, sum = 0;
            for (int64_t n = 128 * t; n < std::min(N, 128 * t + 128); ++n) mx = std::max(mx, ref[n]);
            for (int64_t n = 128 * t; n < std::min(N, 128 * t + 128); ++n) sum += std::exp(ref[n] - mx);
            const float gm = S[(m * ntn + t) * 2], gs = S[(m * ntn + t) * 2 + 1];
            worst_m = std::isfinite(gm) ? std::max(worst_m, std::fabs(gm - mx)) : INFINITY;
            worst_s = std::isfinite(gs) ? std::max(worst_s, std::fabs(gs - sum) / sum) : INFINITY;
        }
    }
    const bool ok = worst_c <= kTol && worst_m <= kTol && worst_s <= 1e-3;
    std::printf("check wg default  [N][K] row-sum-of-squares scale + bias + softmax partials  M %lld N %lld K %lld full"
                "  max err %.2e, stats max %.2e, sum rel %.2e  %s\n", (long long)M, (long long)N, (long long)K,
                worst_c, worst_m, worst_s, ok ? "PASS" : "FAIL");
    CK(cudaFree(dA)); CK(cudaFree(dB)); CK(cudaFree(dC)); CK(cudaFree(dS)); CK(cudaFree(dBias));
    return ok;
}

template <class F>
double time_ms(F&& f, int warmup, int reps) {
    const std::vector<float> ms = event_times_ms(f, warmup, reps);
    if (ms.empty()) {
        std::fprintf(stderr, "a timed launch failed: %s\n", cudaGetErrorString(cudaGetLastError()));
        std::exit(1);
    }
    return median_ms(ms);
}

template <bool kBK>
void time_layout(int64_t S, int bt, int warmup, int reps) {
    const int64_t M = S, N = S, K = S;
    std::vector<float> A = randn((size_t)bt * M * K, 1), B = randn((size_t)bt * N * K, 2);
    float *dA, *dB, *dC;
    CK(cudaMalloc(&dA, A.size() * 4));
    CK(cudaMalloc(&dB, B.size() * 4));
    CK(cudaMalloc(&dC, (size_t)bt * M * N * 4));
    CK(cudaMemcpy(dA, A.data(), A.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, B.data(), B.size() * 4, cudaMemcpyHostToDevice));
    ensure_ws(wg::workspace_bytes(M, N, K, bt, dA, M * K));
    sg::Plain e;
    e.C = dC;
    const double flop = 2.0 * bt * M * N * K;
    const char* lay = kBK ? "[N][K]" : "[K][N]";
    auto row = [&](const char* name, double ms) {
        std::printf("time %-6s batch %d %5lld^3  %-36s %8.3f ms  %6.1f TFLOP/s\n", lay, bt, (long long)S, name, ms,
                    flop / (ms * 1e-3) / 1e12);
        std::fflush(stdout);
    };
    for (int vi = 0; vi < kNumVariants; ++vi)
        if (g_mask >> vi & 1) {
            const Variant& v = kVariants[vi];
            row(v.name, time_ms([&] { (kBK ? v.bk : v.kn)(dA, dB, M, N, K, dC, nullptr, bt); }, warmup, reps));
        }
    {
        const int64_t Kp = wg::padded_k(K);
        const double ms = time_ms([&] {
            if (kBK) {
                const int64_t work = (int64_t)bt * N * (Kp / 4);
                wg::prep_b_bk<true><<<(int)std::min<int64_t>((work + 255) / 256, 132 * 16), 256>>>(dB, g_ws, N, K, Kp,
                                                                                                   bt, N * K);
            } else {
                wg::prep_b_kn<<<dim3((unsigned)(Kp / 32), (unsigned)((N + 31) / 32), (unsigned)bt), dim3(32, 8)>>>(
                    dB, g_ws, N, K, Kp, N * K);
            }
        }, warmup, reps);
        std::printf("time %-6s batch %d %5lld^3  %-36s %8.3f ms\n", lay, bt, (long long)S, "  pre-pass alone (in each wg row)", ms);
    }
    row("sg::launch (sgemm.cuh mma.sync)", time_ms([&] {
            sg::launch<sg::Plain, kBK>(dA, dB, M, N, K, e, 0, 1, bt, M * K, N * K, M * N);
        }, warmup, reps));
    CK(cudaFree(dA)); CK(cudaFree(dB)); CK(cudaFree(dC));
}

}  // namespace

int main(int argc, char** argv) {
    int reps = 30, warmup = 5;
    bool skip_checks = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
        else if (a == "--warmup" && i + 1 < argc) warmup = std::atoi(argv[++i]);
        else if (a == "--no-check") skip_checks = true;
        else if (a == "--mask" && i + 1 < argc) g_mask = (unsigned)std::strtoul(argv[++i], nullptr, 0);
        else {
            std::printf("usage: %s [--reps R] [--warmup W] [--no-check] [--mask BITS]\n", argv[0]);
            return 2;
        }
    }
    int dev = 0;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    std::printf("device %s, %d SMs, smem/block optin %zu\n", prop.name, prop.multiProcessorCount,
                prop.sharedMemPerBlockOptin);
    bool all = true;
    if (!skip_checks) {
        const Case cases[] = {
            {129, 257, 67, 1, true, false},   {1000, 1000, 1000, 1, true, false}, {150, 200, 163, 3, true, true},
            {300, 260, 200, 2, true, false},
            {4096, 4096, 4096, 1, false, false}, {2048, 2048, 2048, 8, false, false},
            {4096, 4096, 1023, 1, false, false},
        };
        for (const Case& c : cases) {
            all &= run_case<true>(c);
            all &= run_case<false>(c);
        }
        all &= check_row_epilogues(300, 333, 200);
        all &= check_row_epilogues(129, 1000, 1023);
        std::printf("all checks of the fp32-accurate variants: %s\n", all ? "PASS" : "SOME FAILED");
    }
    time_layout<true>(4096, 1, warmup, reps);
    time_layout<false>(4096, 1, warmup, reps);
    time_layout<false>(2048, 8, warmup, reps);
    if (g_ws) CK(cudaFree(g_ws));
    return all ? 0 : 1;
}
