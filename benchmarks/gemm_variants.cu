// Sweep of compile-time configurations of the 3xTF32 GEMM (sgemm.cuh) in one run, on one GPU.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o gemm_variants benchmarks/gemm_variants.cu
//   ./gemm_variants [--size S | --m M --n N --k K] [--reps R] [--warmup W] [--no-epi]
//
// For each configuration (the first kernel first) and both B layouts ([N][K]: kBKMajor = true, as nn.Linear
// weights and the level-2/3 solutions; [K][N]: kBKMajor = false, as matmul and bmm): one checked launch
// (sampled outputs against an fp64 host reference: max |err| / max(1, mean |ref|); FAIL above 1e-4 or on
// any non-finite output), then W warm-up launches and R timed launches (cudaEvents, median; L2 not
// flushed). Before that, unless --no-epi, every configuration runs the epilogue features (row sum of
// squares + gain + row softmax stats, split-K atomics, batches, odd K) at small sizes against a full
// fp64 reference. A configuration that fails to launch prints the error and the sweep goes on.
#include "sgemm.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.h"

namespace {

constexpr double kTol = 1e-4;

// ---------------------------------------------------------------- configurations
// GemmCfg<BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, kTileAcc, kPreSplit, kFastSplit, KUNROLL>
using C00 = sg::GemmCfg<128, 128, 32, 2, 4, 3, 1>;                        // the first kernel: 2x4 warps of 64x32
using C01 = sg::GemmCfg<128, 128, 32, 2, 4, 3, 1, true, false, false>;     // + tile accumulation
using C02 = sg::GemmCfg<128, 128, 32, 2, 4, 3, 1, false, true, false>;     // + pre-split in smem
using C03 = sg::GemmCfg<128, 128, 32, 2, 4, 3, 1, true, true, false>;      // + both
using C04 = sg::GemmCfg<128, 128, 32, 2, 4, 3, 1, false, false, true>;     // fast split
using C05 = sg::GemmCfg<128, 128, 32, 2, 4, 3, 1, true, false, true>;      // fast split + tile acc
using C06 = sg::GemmCfg<128, 128, 32, 2, 4, 3, 1, true, true, true>;       // fast split + tile acc + pre-split
using C07 = sg::GemmCfg<128, 256, 32, 2, 4, 3, 1, false, false, false>;    // 64x64 warp tiles
using C08 = sg::GemmCfg<128, 256, 32, 2, 4, 3, 1, false, true, false>;     // 64x64 warp tiles + pre-split
using C09 = sg::GemmCfg<128, 256, 32, 2, 4, 3, 1, false, false, true>;     // 64x64 warp tiles + fast split
using C10 = sg::GemmCfg<256, 128, 32, 4, 2, 3, 1, false, true, false>;     // 64x64 (4x2 warps) + pre-split
using C11 = sg::GemmCfg<128, 128, 32, 2, 2, 3, 2, false, false, true>;     // 4 warps of 64x64, 2 blocks/SM
using C12 = sg::GemmCfg<128, 128, 32, 2, 2, 2, 2, false, true, false>;     // same, pre-split, 2 stages
using C13 = sg::GemmCfg<128, 256, 32, 2, 4, 4, 1, false, false, true>;     // 64x64 warp tiles, 4 stages, fast split
using C14 = sg::GemmCfg<256, 128, 32, 4, 2, 3, 1, false, false, true>;     // 64x64 (4x2 warps), fast split

#define SG_CONFIGS(X)                                                                                  \
    X(C00, "first 128x128x32 w2x4(64x32) s3 b1")                                                     \
    X(C01, "128x128 w2x4(64x32) s3 b1 tileacc")                                                        \
    X(C02, "128x128 w2x4(64x32) s3 b1 presplit")                                                       \
    X(C03, "128x128 w2x4(64x32) s3 b1 tileacc+presplit")                                               \
    X(C04, "128x128 w2x4(64x32) s3 b1 fastsplit")                                                      \
    X(C05, "128x128 w2x4(64x32) s3 b1 fastsplit+tileacc")                                              \
    X(C06, "128x128 w2x4(64x32) s3 b1 fastsplit+tileacc+presplit")                                     \
    X(C07, "128x256 w2x4(64x64) s3 b1")                                                                \
    X(C08, "128x256 w2x4(64x64) s3 b1 presplit")                                                       \
    X(C09, "128x256 w2x4(64x64) s3 b1 fastsplit")                                                      \
    X(C10, "256x128 w4x2(64x64) s3 b1 presplit")                                                       \
    X(C11, "128x128 w2x2(64x64) s3 b2 fastsplit")                                                      \
    X(C12, "128x128 w2x2(64x64) s2 b2 presplit")                                                      \
    X(C13, "128x256 w2x4(64x64) s4 b1 fastsplit")                                                      \
    X(C14, "256x128 w4x2(64x64) s3 b1 fastsplit")

// ---------------------------------------------------------------- epilogues under test
// RMSNorm-like: (sum_k A[m][k] * gain[k] * B(k, n)) * rsqrt(ss / K + eps) + bias[n], with softmax stats
template <bool kStats>
struct EpiFull {
    static constexpr bool kRowSS = true, kGain = true, kRowStats = kStats, kAtomic = false;
    float* C;
    const float* gain;
    float* stats;
    const float* bias;
    float invK;
    __device__ float apply(float acc, int64_t, int64_t col) const { return acc + __ldg(bias + col); }
    __device__ float row_scale(float ss) const { return rsqrtf(ss * invK + 1e-5f); }
};
struct EpiAtomic {
    static constexpr bool kRowSS = false, kGain = false, kRowStats = false, kAtomic = true;
    float* C;
    const float* gain = nullptr;
    float* stats = nullptr;
    __device__ float apply(float acc, int64_t, int64_t) const { return acc; }
};

// ---------------------------------------------------------------- helpers
struct Opts {
    int64_t M = 4096, N = 4096, K = 4096;
    int reps = 20, warmup = 3;
    bool epi = true;
};

bool fatal_error = false;   // a sticky error (fault): nothing more can run on the device

// after a launch: true when it went fine; prints the error otherwise
bool launch_ok(const char* what) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e == cudaSuccess) return true;
    std::printf("    %s: launch failed: %s\n", what, cudaGetErrorString(e));
    if (cudaDeviceSynchronize() != cudaSuccess || cudaGetLastError() != cudaSuccess) fatal_error = true;
    return false;
}

std::vector<float> randn(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}

// B(k, n) of a [N][K] (bk) or [K][N] buffer
inline float bget(const std::vector<float>& B, bool bk, int64_t k, int64_t n, int64_t N, int64_t K) {
    return bk ? B[n * K + k] : B[k * N + n];
}

// --------------------------------------------------------------- epilogue feature checks (small sizes)
// returns the worst normalized error (NaN / inf when something is not finite)
template <class Cfg, bool kBK>
double check_full_epi(int64_t M, int64_t N, int64_t K, uint32_t seed) {
    constexpr bool kStats = Cfg::BN == 128;   // kRowStats needs BN == 128
    const int ntn = (int)((N + 127) / 128);
    std::vector<float> A = randn(M * K, seed), B = randn(N * K, seed + 1), gain = randn(K, seed + 2),
                       bias = randn(N, seed + 3);
    float *dA, *dB, *dC, *dG, *dBias, *dS;
    CK(cudaMalloc(&dA, M * K * 4));
    CK(cudaMalloc(&dB, N * K * 4));
    CK(cudaMalloc(&dC, M * N * 4));
    CK(cudaMalloc(&dG, K * 4));
    CK(cudaMalloc(&dBias, N * 4));
    CK(cudaMalloc(&dS, M * ntn * 2 * 4));
    CK(cudaMemcpy(dA, A.data(), M * K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, B.data(), N * K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dG, gain.data(), K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dBias, bias.data(), N * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(dC, 0xff, M * N * 4));
    CK(cudaMemset(dS, 0xff, M * ntn * 2 * 4));
    EpiFull<kStats> e;
    e.C = dC; e.gain = dG; e.stats = dS; e.bias = dBias; e.invK = 1.f / (float)K;
    sg::launch<EpiFull<kStats>, kBK, Cfg>(dA, dB, M, N, K, e, 0);
    double worst = 0;
    if (launch_ok("epilogue rowss+gain+stats")) {
        std::vector<float> C(M * N), S(M * ntn * 2);
        CK(cudaMemcpy(C.data(), dC, M * N * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(S.data(), dS, M * ntn * 2 * 4, cudaMemcpyDeviceToHost));
        std::vector<double> ref(M * N);
        double mean = 0;
        for (int64_t m = 0; m < M; ++m) {
            double ss = 0;
            for (int64_t k = 0; k < K; ++k) ss += (double)A[m * K + k] * A[m * K + k];
            const double rs = 1.0 / std::sqrt(ss / K + 1e-5);
            for (int64_t n = 0; n < N; ++n) {
                double s = 0;
                for (int64_t k = 0; k < K; ++k) s += (double)A[m * K + k] * gain[k] * bget(B, kBK, k, n, N, K);
                ref[m * N + n] = s * rs + bias[n];
                mean += std::fabs(ref[m * N + n]);
            }
        }
        mean /= (double)(M * N);
        const double scale = std::max(1.0, mean);
        for (int64_t i = 0; i < M * N; ++i) {
            const double d = std::fabs((double)C[i] - ref[i]) / scale;
            if (!(d <= worst)) worst = d;   // NaN propagates
        }
        if (kStats) {
            for (int64_t m = 0; m < M; ++m)
                for (int t = 0; t < ntn; ++t) {
                    double mx = -INFINITY, se = 0;
                    for (int64_t n = t * 128; n < std::min<int64_t>(N, t * 128 + 128); ++n)
                        mx = std::max(mx, ref[m * N + n]);
                    for (int64_t n = t * 128; n < std::min<int64_t>(N, t * 128 + 128); ++n)
                        se += std::exp(ref[m * N + n] - mx);
                    const float* st = &S[(m * ntn + t) * 2];
                    // the max is one of the outputs (same scale); the sum relative to itself (__expf)
                    const double d0 = std::fabs(st[0] - mx) / scale, d1 = std::fabs(st[1] - se) / se;
                    if (!(d0 <= worst)) worst = d0;
                    if (!(d1 <= worst)) worst = d1;
                }
        }
    } else {
        worst = NAN;
    }
    CK(cudaFree(dA)); CK(cudaFree(dB)); CK(cudaFree(dC)); CK(cudaFree(dG)); CK(cudaFree(dBias)); CK(cudaFree(dS));
    return worst;
}

// split-K atomics (kBK) or batches (plain), full reference
template <class Cfg, bool kBK, bool kAtomicSplit>
double check_split_batch(int64_t M, int64_t N, int64_t K, int batch, int splits, uint32_t seed) {
    std::vector<float> A = randn(batch * M * K, seed), B = randn(batch * N * K, seed + 1);
    float *dA, *dB, *dC;
    CK(cudaMalloc(&dA, batch * M * K * 4));
    CK(cudaMalloc(&dB, batch * N * K * 4));
    CK(cudaMalloc(&dC, batch * M * N * 4));
    CK(cudaMemcpy(dA, A.data(), batch * M * K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, B.data(), batch * N * K * 4, cudaMemcpyHostToDevice));
    if (kAtomicSplit) {
        CK(cudaMemset(dC, 0, batch * M * N * 4));
        EpiAtomic e;
        e.C = dC;
        sg::launch<EpiAtomic, kBK, Cfg>(dA, dB, M, N, K, e, 0, splits, batch, M * K, N * K, M * N);
    } else {
        CK(cudaMemset(dC, 0xff, batch * M * N * 4));
        sg::Plain e;
        e.C = dC;
        sg::launch<sg::Plain, kBK, Cfg>(dA, dB, M, N, K, e, 0, 1, batch, M * K, N * K, M * N);
    }
    double worst = 0;
    if (launch_ok(kAtomicSplit ? "epilogue split-K atomic" : "batched plain")) {
        std::vector<float> C(batch * M * N);
        CK(cudaMemcpy(C.data(), dC, batch * M * N * 4, cudaMemcpyDeviceToHost));
        std::vector<double> ref(batch * M * N);
        double mean = 0;
        for (int b = 0; b < batch; ++b)
            for (int64_t m = 0; m < M; ++m)
                for (int64_t n = 0; n < N; ++n) {
                    double s = 0;
                    const float* a = &A[(b * M + m) * K];
                    for (int64_t k = 0; k < K; ++k) {
                        const float bv = kBK ? B[b * N * K + n * K + k] : B[b * N * K + k * N + n];
                        s += (double)a[k] * bv;
                    }
                    ref[(b * M + m) * N + n] = s;
                    mean += std::fabs(s);
                }
        mean /= (double)(batch * M * N);
        const double scale = std::max(1.0, mean);
        for (size_t i = 0; i < ref.size(); ++i) {
            const double d = std::fabs((double)C[i] - ref[i]) / scale;
            if (!(d <= worst)) worst = d;
        }
    } else {
        worst = NAN;
    }
    CK(cudaFree(dA)); CK(cudaFree(dB)); CK(cudaFree(dC));
    return worst;
}

template <class Cfg>
bool check_epilogues(const char* name) {
    double w = 0;
    auto upd = [&](double d) { if (!(d <= w)) w = d; };
    // N = 260: a partial column tile; K = 203: the scalar (non-16-byte) load path; K = 200: vector path
    upd(check_full_epi<Cfg, true>(300, 260, 200, 11));
    if (!fatal_error) upd(check_full_epi<Cfg, true>(130, 260, 203, 12));
    if (!fatal_error) upd(check_full_epi<Cfg, false>(300, 260, 200, 13));
    if (!fatal_error) upd(check_full_epi<Cfg, false>(130, 131, 203, 14));
    if (!fatal_error) upd(check_split_batch<Cfg, true, true>(200, 260, 1000, 2, 3, 15));
    if (!fatal_error) upd(check_split_batch<Cfg, true, true>(70, 130, 333, 1, 2, 16));
    if (!fatal_error) upd(check_split_batch<Cfg, false, false>(150, 200, 160, 3, 1, 17));
    if (!fatal_error) upd(check_split_batch<Cfg, false, false>(65, 99, 77, 2, 1, 18));
    const bool ok = !fatal_error && w <= kTol;
    std::printf("epilogues  %-48s max err %.2e  %s\n", name, w, ok ? "ok" : "FAIL");
    return ok;
}

// --------------------------------------------------------------- the big timed GEMM
struct Problem {
    int64_t M, N, K;
    float *dA, *dB, *dC;
    std::vector<float> A, B;
    std::vector<int64_t> sm, sn;       // sampled outputs
    std::vector<double> ref[2];        // [kBK]
    double scale[2];
};

struct Row {
    std::string name;
    bool bk;
    int smem;
    double err, ms, tflops;
    bool ok;
};

template <class Cfg, bool kBK>
Row run_config(const char* name, Problem& P, const Opts& o) {
    Row row{name, kBK, sg::smem_bytes<kBK, Cfg>(), NAN, NAN, 0, false};
    const int64_t M = P.M, N = P.N, K = P.K;
    sg::Plain e;
    e.C = P.dC;
    CK(cudaMemset(P.dC, 0xff, M * N * 4));   // NaN: anything not written fails the check
    sg::launch<sg::Plain, kBK, Cfg>(P.dA, P.dB, M, N, K, e, 0);
    if (!launch_ok(name)) return row;
    std::vector<float> C(M * N);
    CK(cudaMemcpy(C.data(), P.dC, M * N * 4, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (float v : C) bad += !std::isfinite(v);
    double worst = 0;
    for (size_t s = 0; s < P.sm.size(); ++s) {
        const double d = std::fabs((double)C[P.sm[s] * N + P.sn[s]] - P.ref[kBK][s]) / P.scale[kBK];
        if (!(d <= worst)) worst = d;
    }
    row.err = bad ? NAN : worst;
    row.ok = bad == 0 && worst <= kTol;

    const std::vector<float> ms =
        event_times_ms([&] { sg::launch<sg::Plain, kBK, Cfg>(P.dA, P.dB, M, N, K, e, 0); }, o.warmup, o.reps);
    if (ms.empty()) {
        launch_ok(name);   // reports the failure
        return row;
    }
    row.ms = median_ms(ms);
    row.tflops = 2.0 * M * N * K / (row.ms * 1e-3) / 1e12;
    return row;
}

void print_row(const Row& r) {
    std::printf("%-6s %-48s smem %6d  err %.2e  %s  median %8.3f ms  %6.1f TFLOP/s\n",
                r.bk ? "[N][K]" : "[K][N]", r.name.c_str(), r.smem, r.err, r.ok ? "ok  " : "FAIL", r.ms,
                r.tflops);
}

}  // namespace

int main(int argc, char** argv) {
    Opts o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> long long {
            if (i + 1 >= argc) { std::fprintf(stderr, "missing value after %s\n", a.c_str()); std::exit(2); }
            return std::atoll(argv[++i]);
        };
        if (a == "--size") o.M = o.N = o.K = next();
        else if (a == "--m") o.M = next();
        else if (a == "--n") o.N = next();
        else if (a == "--k") o.K = next();
        else if (a == "--reps") o.reps = (int)next();
        else if (a == "--warmup") o.warmup = (int)next();
        else if (a == "--no-epi") o.epi = false;
        else {
            std::printf("usage: %s [--size S | --m M --n N --k K] [--reps R] [--warmup W] [--no-epi]\n", argv[0]);
            return a == "--help" || a == "-h" ? 0 : 2;
        }
    }
    if (o.M <= 0 || o.N <= 0 || o.K <= 0 || o.reps <= 0 || o.warmup < 0) {
        std::fprintf(stderr, "sizes and reps must be positive\n");
        return 2;
    }
    int dev = 0;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    std::printf("device %s, %d SMs, smem/block optin %zu, smem/SM %zu\n", prop.name, prop.multiProcessorCount,
                prop.sharedMemPerBlockOptin, prop.sharedMemPerMultiprocessor);

    bool all_epi_ok = true;
    if (o.epi) {
#define X(C, NAME) if (!fatal_error) all_epi_ok &= check_epilogues<C>(NAME);
        SG_CONFIGS(X)
#undef X
        if (fatal_error) { std::printf("FATAL: device error, stopping\n"); return 1; }
    }

    Problem P;
    P.M = o.M; P.N = o.N; P.K = o.K;
    const int64_t M = P.M, N = P.N, K = P.K;
    std::printf("GEMM M=%lld N=%lld K=%lld, %d warm-up + %d timed launches per config\n", (long long)M,
                (long long)N, (long long)K, o.warmup, o.reps);
    P.A = randn(M * K, 1);
    P.B = randn(N * K, 2);
    CK(cudaMalloc(&P.dA, M * K * 4));
    CK(cudaMalloc(&P.dB, N * K * 4));
    CK(cudaMalloc(&P.dC, M * N * 4));
    CK(cudaMemcpy(P.dA, P.A.data(), M * K * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(P.dB, P.B.data(), N * K * 4, cudaMemcpyHostToDevice));
    {
        std::mt19937 rng(3);
        const int ns = 2048;
        P.sm = {0, 0, M - 1, M - 1};
        P.sn = {0, N - 1, 0, N - 1};
        for (int s = 4; s < ns; ++s) {
            P.sm.push_back((int64_t)(rng() % (uint64_t)M));
            P.sn.push_back((int64_t)(rng() % (uint64_t)N));
        }
        for (int bk = 0; bk < 2; ++bk) {
            double mean = 0;
            P.ref[bk].resize(P.sm.size());
            for (size_t s = 0; s < P.sm.size(); ++s) {
                double acc = 0;
                const float* a = &P.A[P.sm[s] * K];
                for (int64_t k = 0; k < K; ++k) acc += (double)a[k] * bget(P.B, bk, k, P.sn[s], N, K);
                P.ref[bk][s] = acc;
                mean += std::fabs(acc);
            }
            P.scale[bk] = std::max(1.0, mean / (double)P.sm.size());
        }
    }

    std::vector<Row> rows;
    for (int bk = 1; bk >= 0 && !fatal_error; --bk) {
        std::printf("-- B layout %s (%s)\n", bk ? "[N][K]" : "[K][N]",
                    bk ? "kBKMajor=true: nn.Linear weights, level2/3" : "kBKMajor=false: matmul, bmm");
        if (bk) {
#define X(C, NAME) if (!fatal_error) { rows.push_back(run_config<C, true>(NAME, P, o)); print_row(rows.back()); }
            SG_CONFIGS(X)
#undef X
        } else {
#define X(C, NAME) if (!fatal_error) { rows.push_back(run_config<C, false>(NAME, P, o)); print_row(rows.back()); }
            SG_CONFIGS(X)
#undef X
        }
        std::fflush(stdout);
    }
    if (fatal_error) std::printf("FATAL: device error, stopping early\n");
    for (int bk = 1; bk >= 0; --bk) {
        const Row* best = nullptr;
        const Row* def = nullptr;
        for (const Row& r : rows) {
            if (r.bk != (bool)bk) continue;
            if (!def) def = &r;
            if (r.ok && std::isfinite(r.ms) && (!best || r.ms < best->ms)) best = &r;
        }
        if (best)
            std::printf("best %s: %s  %.3f ms  %.1f TFLOP/s  (first kernel %.3f ms)\n", bk ? "[N][K]" : "[K][N]",
                        best->name.c_str(), best->ms, best->tflops, def ? def->ms : NAN);
        else
            std::printf("best %s: none passed\n", bk ? "[N][K]" : "[K][N]");
    }
    if (o.epi) std::printf("epilogue checks: %s\n", all_epi_ok ? "all ok" : "SOME FAILED");
    CK(cudaFree(P.dA)); CK(cudaFree(P.dB)); CK(cudaFree(P.dC));
    return fatal_error ? 1 : 0;
}
