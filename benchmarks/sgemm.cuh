// fp32 GEMM on the tensor cores with fp32 accuracy ("3xTF32"), with a fused epilogue, on mma.sync: what the GEMM
// solutions ran before wgmma.cuh (kernels/solutions/*/*/kernels/wgmma.cuh), kept as its reference and for the sweep.
//
// Each fp32 operand x is split into big = tf32(x) and small = tf32(x - big); the product is
// a_small*b_big + a_big*b_small + a_big*b_big (the dropped a_small*b_small is ~2^-22 relative),
// by mma.sync.m16n8k8 tf32, summed into the fp32 accumulators one k8 step at a time. Plain fp32 on the CUDA cores tops out at ~67
// TFLOP/s on an H200; three tf32 products still run faster than one fp32 FMA there.
//
// 128x128x32 block tile, 4 warps (2 x 2, 64x64 each), 2 blocks per SM, a 3-stage cp.async pipeline,
// the fast split, padded shared-memory rows (fragment loads are bank-conflict-free), grouped tile
// order for L2 reuse: DefaultCfg;
// GemmCfg makes these (and the split / accumulation strategy) compile-time choices, swept by
// benchmarks/gemm_variants.cu.
// A is [M][K] row-major; B is [N][K] (kBKMajor, as nn.Linear.weight) or [K][N].
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <math.h>

namespace sg {

// Compile-time tuning of the kernel; every solution uses DefaultCfg.
//   BM x BN x BK block tile; WARPS_M x WARPS_N warps, each owning a (BM / WARPS_M) x (BN / WARPS_N)
//   warp tile of m16n8 fragments; a STAGES-deep cp.async pipeline; MIN_BLOCKS resident blocks per SM
//   asked of __launch_bounds__; KUNROLL: unroll of the k8 loop inside a BK tile; GROUP_M: grouped tile order.
//   kTileAcc:  the three products of all k8 steps of one BK tile are summed on the tensor cores into a
//              per-fragment temporary that is added to the fp32 accumulators once per BK tile (else once
//              per k8 step); the truncating tensor-core accumulation then spans at most BK of K.
//   kPreSplit: once a stage has landed, the block splits it once in shared memory (tf32 big in place,
//              small into one extra stage-shaped buffer), so the fragment loads need no conversions.
//   kFastSplit: big = round-to-nearest-away tf32 by integer add and mask (as cvt.rna for finite x; sm_90
//              emulates cvt.rna.tf32 with ~4 instructions), small = x - big truncated to tf32 (not rounded:
//              ~2^-21 instead of ~2^-22 relative per product; NaN still propagates through small).
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, int MIN_BLOCKS_,
          bool kTileAcc_ = false, bool kPreSplit_ = false, bool kFastSplit_ = false, int KUNROLL_ = 1,
          int GROUP_M_ = 8>
struct GemmCfg {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
    static constexpr int NT = 32 * WARPS_M * WARPS_N, STAGES = STAGES_, MIN_BLOCKS = MIN_BLOCKS_;
    static constexpr int KUNROLL = KUNROLL_, GROUP_M = GROUP_M_;
    static constexpr bool kTileAcc = kTileAcc_, kPreSplit = kPreSplit_, kFastSplit = kFastSplit_;
    static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;   // warp tile
    static constexpr int MI = WTM / 16, NJ = WTN / 8;              // m16 x n8 fragments per warp tile
    static constexpr int APITCH = BK + 4;    // A tile [BM][APITCH]; also B tile [BN][APITCH] when B is [N][K]
    static constexpr int BNPITCH = BN + 8;   // B tile [BK][BNPITCH] when B is [K][N]

    static_assert(BK % 8 == 0 && BK >= 8, "BK must be a multiple of 8");
    static_assert(WTM % 16 == 0 && WTM * WARPS_M == BM, "warp tile rows must be a multiple of 16");
    static_assert(WTN % 8 == 0 && WTN * WARPS_N == BN, "warp tile columns must be a multiple of 8");
    static_assert(NT <= 1024 && MIN_BLOCKS >= 1 && STAGES >= 2, "bad thread count, blocks or stages");
    static_assert((BM * BK / 4) % NT == 0 && (BN * BK / 4) % NT == 0 && (BK * BN / 4) % NT == 0,
                  "tiles must split evenly over the threads in 16-byte chunks");
    static_assert(BN % 4 == 0 && (BK / 8) % KUNROLL == 0 && KUNROLL >= 1, "bad BN or KUNROLL");
    static_assert(GROUP_M >= 1, "bad GROUP_M");
};
// The fastest of benchmarks/gemm_variants.cu on the H200 (2026-12-01): 4096^3 in 2.22 ms for either
// B layout, vs 2.84 ms for the first kernel (128x128, 2 x 4 warps of 64x32, 1 block per SM, cvt.rna).
using DefaultCfg = GemmCfg<128, 128, 32, 2, 2, 3, 2, false, false, true>;

// the default configuration's constants (callers size their grids and softmax stats with BM / BN)
constexpr int BM = DefaultCfg::BM, BN = DefaultCfg::BN, BK = DefaultCfg::BK, NT = DefaultCfg::NT,
              STAGES = DefaultCfg::STAGES, GROUP_M = DefaultCfg::GROUP_M;
constexpr int APITCH = DefaultCfg::APITCH, BNPITCH = DefaultCfg::BNPITCH;

template <bool kBKMajor, class Cfg = DefaultCfg>
__host__ __device__ constexpr int stage_floats() {
    return Cfg::BM * Cfg::APITCH + (kBKMajor ? Cfg::BN * Cfg::APITCH : Cfg::BK * Cfg::BNPITCH);
}
// STAGES pipeline stages, plus (kPreSplit) one stage-shaped buffer for the small halves
template <bool kBKMajor, class Cfg = DefaultCfg>
__host__ __device__ constexpr int smem_bytes() {
    return (Cfg::STAGES + (Cfg::kPreSplit ? 1 : 0)) * stage_floats<kBKMajor, Cfg>() * 4;
}
// static shared memory of the kernel (the kRowStats reduction buffer)
template <class Epi, class Cfg = DefaultCfg>
__host__ __device__ constexpr int static_smem_bytes() {
    return (Epi::kRowStats ? 2 * Cfg::WARPS_N * Cfg::BM : 1) * 4;
}
constexpr int kMaxSmemPerBlock = 227 * 1024;   // sm_90 opt-in limit (dynamic + static)
constexpr int kSmemPerSM = 228 * 1024;         // sm_90, of which 1 KB is reserved per resident block

// Epilogue contract (Epi):
//   static constexpr bool kRowSS;    acc *= row_scale(sum of squares of the A row over all K)
//   static constexpr bool kGain;     B[n][k] is multiplied by gain[k] (member `gain`)
//   static constexpr bool kRowStats; write per-(row, 128-column tile) softmax partials (max, sumexp)
//                                    to stats[M][ceil(N/128)][2]  (configurations with BN = 128 only)
//   static constexpr bool kAtomic;   atomicAdd into C instead of storing (split-K)
//   __device__ float apply(float acc, int64_t row, int64_t col) const;   only for col < N
//   (kRowSS) __device__ float row_scale(float ss) const;
//   float* C;  const float* gain;  float* stats;
struct Plain {
    static constexpr bool kRowSS = false, kGain = false, kRowStats = false, kAtomic = false;
    float* C;
    const float* gain = nullptr;
    float* stats = nullptr;
    __device__ float apply(float acc, int64_t, int64_t) const { return acc; }
};

struct Shape {
    int64_t M, N, K, kPerSplit;
    int splits;
    int64_t sA, sB, sC;   // batch strides (elements)
};

__device__ __forceinline__ uint32_t tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
template <bool kFast = false>
__device__ __forceinline__ void split(float x, uint32_t& big, uint32_t& small) {
    if constexpr (kFast) {
        big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
        small = __float_as_uint(x - __uint_as_float(big)) & 0xffffe000u;
    } else {
        big = tf32(x);
        small = tf32(x - __uint_as_float(big));
    }
}
// d = a * b + c
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                    const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
// cp.async of `bytes` (4 or 16) from global to shared; src_bytes = 0 zero-fills (out of range).
template <int bytes>
__device__ __forceinline__ void cp_async(float* dst, const float* src, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    const int n = valid ? bytes : 0;
    if constexpr (bytes == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int n>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(n)); }

// c / D and c % D for c >= 0 (shifts and masks when D is a power of two)
template <int D>
__device__ __forceinline__ int divp(int c) {
    if constexpr ((D & (D - 1)) == 0) {
        int sh = 0;
        while ((1 << sh) < D) ++sh;
        return c >> sh;
    } else {
        return c / D;
    }
}
template <int D>
__device__ __forceinline__ int modp(int c) {
    if constexpr ((D & (D - 1)) == 0) return c & (D - 1);
    else return c % D;
}

// Big warp tiles (64 x 64 and up) leave few registers: their 16-byte loads keep one base pointer per
// tile and step it, instead of letting the compiler hoist one pointer per chunk out of the k loop.
template <class Cfg>
__host__ __device__ constexpr bool kLeanLoads() { return Cfg::MI * Cfg::NJ >= 32; }

// One [ROWS][BK] tile of a K-contiguous matrix X (row stride K) into smem [ROWS][APITCH].
template <int ROWS, class Cfg, bool VEC>
__device__ __forceinline__ void load_kmajor(float* s, const float* X, int64_t r0, int64_t rows_total,
                                            int64_t k0, int64_t kend, int64_t K, int tid) {
    constexpr int BK = Cfg::BK, NT = Cfg::NT, APITCH = Cfg::APITCH;
    if constexpr (VEC && kLeanLoads<Cfg>()) {
        // this thread's chunks: column kc of rows rb, rb + RSTEP, ...: one base pointer, one k test
        constexpr int CPR = BK / 4, RSTEP = NT / CPR;   // 16-byte chunks per row, rows per pass
        static_assert(NT % CPR == 0 && ROWS % RSTEP == 0, "uneven k-major tile load");
        const int rb = divp<CPR>(tid), kc = modp<CPR>(tid) * 4;
        const bool kok = k0 + kc < kend;                  // kend % 4 == 0 on this path
        const int64_t rows_left = rows_total - r0 - rb;
        const float* p = X + (r0 + rb) * K + k0 + kc;
        float* d = s + rb * APITCH + kc;
#pragma unroll
        for (int i = 0; i < ROWS / RSTEP; ++i) {
            const bool ok = kok && i * RSTEP < rows_left;
            cp_async<16>(d + i * RSTEP * APITCH, ok ? p + (int64_t)i * RSTEP * K : X, ok);
        }
    } else if constexpr (VEC) {
        constexpr int CPR = BK / 4;   // 16-byte chunks per row
#pragma unroll
        for (int i = 0; i < (ROWS * CPR) / NT; ++i) {
            const int c = tid + i * NT, r = divp<CPR>(c), kc = modp<CPR>(c) * 4;
            const bool ok = r0 + r < rows_total && k0 + kc < kend;   // kend % 4 == 0 on this path
            cp_async<16>(s + r * APITCH + kc, ok ? X + (r0 + r) * K + k0 + kc : X, ok);
        }
    } else {
#pragma unroll 4
        for (int i = 0; i < (ROWS * BK) / NT; ++i) {
            const int c = tid + i * NT, r = divp<BK>(c), kc = modp<BK>(c);
            const bool ok = r0 + r < rows_total && k0 + kc < kend;
            cp_async<4>(s + r * APITCH + kc, ok ? X + (r0 + r) * K + k0 + kc : X, ok);
        }
    }
}

// One [BK][BN] tile of an N-contiguous B ([K][N], row stride N) into smem [BK][BNPITCH].
template <class Cfg, bool VEC>
__device__ __forceinline__ void load_nmajor(float* s, const float* B, int64_t n0, int64_t N, int64_t k0,
                                            int64_t kend, int tid) {
    constexpr int BK = Cfg::BK, BN = Cfg::BN, NT = Cfg::NT, BNPITCH = Cfg::BNPITCH;
    if constexpr (VEC && kLeanLoads<Cfg>()) {
        constexpr int CPR = BN / 4, KSTEP = NT / CPR;   // 16-byte chunks per k row, k rows per pass
        static_assert(NT % CPR == 0 && BK % KSTEP == 0, "uneven n-major tile load");
        const int kb = divp<CPR>(tid), nc = modp<CPR>(tid) * 4;
        const bool nok = n0 + nc < N;                     // N % 4 == 0 on this path
        const int64_t k_left = kend - k0 - kb;
        const float* p = B + (k0 + kb) * N + n0 + nc;
        float* d = s + kb * BNPITCH + nc;
#pragma unroll
        for (int i = 0; i < BK / KSTEP; ++i) {
            const bool ok = nok && i * KSTEP < k_left;
            cp_async<16>(d + i * KSTEP * BNPITCH, ok ? p + (int64_t)i * KSTEP * N : B, ok);
        }
    } else if constexpr (VEC) {
        constexpr int CPR = BN / 4;
#pragma unroll
        for (int i = 0; i < (BK * CPR) / NT; ++i) {
            const int c = tid + i * NT, k = divp<CPR>(c), nc = modp<CPR>(c) * 4;
            const bool ok = k0 + k < kend && n0 + nc < N;            // N % 4 == 0 on this path
            cp_async<16>(s + k * BNPITCH + nc, ok ? B + (k0 + k) * N + n0 + nc : B, ok);
        }
    } else {
#pragma unroll 4
        for (int i = 0; i < (BK * BN) / NT; ++i) {
            const int c = tid + i * NT, k = divp<BN>(c), n = modp<BN>(c);
            const bool ok = k0 + k < kend && n0 + n < N;
            cp_async<4>(s + k * BNPITCH + n, ok ? B + (k0 + k) * N + n0 + n : B, ok);
        }
    }
}

// kPreSplit: four consecutive floats at p become tf32 big (in place) and small (at q), after * gain
template <bool kFast>
__device__ __forceinline__ void split4(float* p, float* q, float4 gain, bool kGain) {
    float4 v = *reinterpret_cast<const float4*>(p);
    if (kGain) {
        v.x *= gain.x; v.y *= gain.y; v.z *= gain.z; v.w *= gain.w;
    }
    uint32_t b[4], s[4];
    split<kFast>(v.x, b[0], s[0]);
    split<kFast>(v.y, b[1], s[1]);
    split<kFast>(v.z, b[2], s[2]);
    split<kFast>(v.w, b[3], s[3]);
    *reinterpret_cast<float4*>(p) = make_float4(__uint_as_float(b[0]), __uint_as_float(b[1]),
                                                __uint_as_float(b[2]), __uint_as_float(b[3]));
    *reinterpret_cast<float4*>(q) = make_float4(__uint_as_float(s[0]), __uint_as_float(s[1]),
                                                __uint_as_float(s[2]), __uint_as_float(s[3]));
}

// kPreSplit: split one landed stage s (k0: its first k) into big (in place) and small (sm, same layout).
// Only the BK columns (A, [N][K] B) or BN columns ([K][N] B) the fragments read are touched.
template <class Cfg, bool kBKMajor, class Epi>
__device__ __forceinline__ void presplit_stage(float* s, float* sm, const Epi& epi, int64_t k0, int64_t kend,
                                               int tid) {
    constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, NT = Cfg::NT;
    constexpr int APITCH = Cfg::APITCH, BNPITCH = Cfg::BNPITCH, CPR = BK / 4;
    const float4 one = make_float4(1.f, 1.f, 1.f, 1.f);
#pragma unroll
    for (int i = 0; i < (BM * CPR) / NT; ++i) {
        const int c = tid + i * NT, off = divp<CPR>(c) * APITCH + modp<CPR>(c) * 4;
        split4<Cfg::kFastSplit>(s + off, sm + off, one, false);
    }
    float* sb = s + BM * APITCH;
    float* qb = sm + BM * APITCH;
    if constexpr (kBKMajor) {
#pragma unroll
        for (int i = 0; i < (BN * CPR) / NT; ++i) {
            const int c = tid + i * NT, kc = modp<CPR>(c) * 4, off = divp<CPR>(c) * APITCH + kc;
            float4 gn = one;
            if constexpr (Epi::kGain) {
                const int64_t k = k0 + kc;
                gn.x = k < kend ? __ldg(epi.gain + k) : 0.f;
                gn.y = k + 1 < kend ? __ldg(epi.gain + k + 1) : 0.f;
                gn.z = k + 2 < kend ? __ldg(epi.gain + k + 2) : 0.f;
                gn.w = k + 3 < kend ? __ldg(epi.gain + k + 3) : 0.f;
            }
            split4<Cfg::kFastSplit>(sb + off, qb + off, gn, Epi::kGain);
        }
    } else {
        constexpr int CPRN = BN / 4;
#pragma unroll
        for (int i = 0; i < (BK * CPRN) / NT; ++i) {
            const int c = tid + i * NT, k = divp<CPRN>(c), off = k * BNPITCH + modp<CPRN>(c) * 4;
            float4 gn = one;
            if constexpr (Epi::kGain) {
                const float gk = k0 + k < kend ? __ldg(epi.gain + k0 + k) : 0.f;
                gn = make_float4(gk, gk, gk, gk);
            }
            split4<Cfg::kFastSplit>(sb + off, qb + off, gn, Epi::kGain);
        }
    }
}

template <class Epi, bool kBKMajor, bool VEC, class Cfg = DefaultCfg>
__global__ void __launch_bounds__(Cfg::NT, Cfg::MIN_BLOCKS)
gemm_tf32x3(const float* __restrict__ A, const float* __restrict__ B, Shape sh, bool vecC, Epi epi) {
    constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
    constexpr int APITCH = Cfg::APITCH, BNPITCH = Cfg::BNPITCH, GROUP_M = Cfg::GROUP_M;
    constexpr int WARPS_N = Cfg::WARPS_N, WTM = Cfg::WTM, WTN = Cfg::WTN, MI = Cfg::MI, NJ = Cfg::NJ;
    constexpr int SF = stage_floats<kBKMajor, Cfg>();
    static_assert(!Epi::kRowStats || BN == 128, "kRowStats writes per-128-column-tile stats: needs BN == 128");
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[Epi::kRowStats ? 2 * WARPS_N * BM : 1];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int wm = divp<WARPS_N>(warp), wn = modp<WARPS_N>(warp);   // warp tile origin: (wm * WTM, wn * WTN)

    // grouped tile order: GROUP_M row tiles walk the column tiles together
    const int num_n = (int)((sh.N + BN - 1) / BN), num_m = (int)((sh.M + BM - 1) / BM);
    const int pid = blockIdx.x, width = GROUP_M * num_n;
    const int first_m = (pid / width) * GROUP_M;
    const int gsize = min(num_m - first_m, GROUP_M);
    const int tm = first_m + (pid % width) % gsize, tn = (pid % width) / gsize;
    const int64_t m0 = (int64_t)tm * BM, n0 = (int64_t)tn * BN;

    const int batch = blockIdx.z / sh.splits, part = blockIdx.z % sh.splits;
    A += batch * sh.sA;
    B += batch * sh.sB;
    float* C = epi.C + batch * sh.sC;
    const int64_t M = sh.M, N = sh.N, K = sh.K;
    const int64_t kbeg = part * sh.kPerSplit;
    const int64_t kend = min(kbeg + sh.kPerSplit, K);
    const int ntiles = kend > kbeg ? (int)((kend - kbeg + BK - 1) / BK) : 0;

    auto load_stage = [&](int stage, int t) {
        float* s = smem + stage * SF;
        const int64_t k0 = kbeg + (int64_t)t * BK;
        load_kmajor<BM, Cfg, VEC>(s, A, m0, M, k0, kend, K, tid);
        if constexpr (kBKMajor) load_kmajor<BN, Cfg, VEC>(s + BM * APITCH, B, n0, N, k0, kend, K, tid);
        else load_nmajor<Cfg, VEC>(s + BM * APITCH, B, n0, N, k0, kend, tid);
    };

    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
    float ss[MI][2] = {};

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ntiles) load_stage(s, s);
        cp_commit();
    }
    for (int t = 0; t < ntiles; ++t) {
        cp_wait<STAGES - 2>();
        __syncthreads();   // tile t landed for every thread; stage (t-1) % STAGES is free again
        if (t + STAGES - 1 < ntiles) load_stage((t + STAGES - 1) % STAGES, t + STAGES - 1);
        cp_commit();

        float* const Ast = smem + (t % STAGES) * SF;
        if constexpr (Cfg::kPreSplit) {
            // stage t % STAGES has landed and no cp.async still targets it (the ones in flight fill
            // the other stages); the small buffer was last read for tile t - 1, before the barrier above
            presplit_stage<Cfg, kBKMajor>(Ast, smem + STAGES * SF, epi, kbeg + (int64_t)t * BK, kend, tid);
            __syncthreads();
        }
        const float* As = Ast;
        const float* Bs = As + BM * APITCH;
        const float* Aq = smem + STAGES * SF;   // kPreSplit: the small halves, same layout as a stage
        const float* Bq = Aq + BM * APITCH;

        constexpr int TI = Cfg::kTileAcc ? MI : 1, TJ = Cfg::kTileAcc ? NJ : 1;
        float tacc[TI][TJ][4];   // kTileAcc: the products of this BK tile
        if constexpr (Cfg::kTileAcc) {
#pragma unroll
            for (int i = 0; i < TI; ++i)
#pragma unroll
                for (int j = 0; j < TJ; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) tacc[i][j][r] = 0.f;
        }
        // unrolled (KUNROLL = BK / 8), the fragments of all k8 steps of the default config stay live and spill
#pragma unroll Cfg::KUNROLL
        for (int kk = 0; kk < BK; kk += 8) {
            uint32_t bb[NJ][2], bs[NJ][2];
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int n = wn * WTN + j * 8 + g;
                int o0, o1;
                if constexpr (kBKMajor) {
                    o0 = n * APITCH + kk + tig;
                    o1 = n * APITCH + kk + tig + 4;
                } else {
                    o0 = (kk + tig) * BNPITCH + n;
                    o1 = (kk + tig + 4) * BNPITCH + n;
                }
                if constexpr (Cfg::kPreSplit) {
                    bb[j][0] = __float_as_uint(Bs[o0]);
                    bb[j][1] = __float_as_uint(Bs[o1]);
                    bs[j][0] = __float_as_uint(Bq[o0]);
                    bs[j][1] = __float_as_uint(Bq[o1]);
                } else {
                    float b0 = Bs[o0], b1 = Bs[o1];
                    if constexpr (Epi::kGain) {
                        const int64_t k = kbeg + (int64_t)t * BK + kk + tig;
                        b0 *= k < kend ? __ldg(epi.gain + k) : 0.f;
                        b1 *= k + 4 < kend ? __ldg(epi.gain + k + 4) : 0.f;
                    }
                    split<Cfg::kFastSplit>(b0, bb[j][0], bs[j][0]);
                    split<Cfg::kFastSplit>(b1, bb[j][1], bs[j][1]);
                }
            }
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const int ao = (wm * WTM + i * 16 + g) * APITCH + kk + tig;
                uint32_t ab[4], as[4];
                float a[4];
                if constexpr (Cfg::kPreSplit) {
                    const int offs[4] = {0, 8 * APITCH, 4, 8 * APITCH + 4};
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        ab[r] = __float_as_uint(As[ao + offs[r]]);
                        as[r] = __float_as_uint(Aq[ao + offs[r]]);
                        if constexpr (Epi::kRowSS) a[r] = __uint_as_float(ab[r]) + __uint_as_float(as[r]);
                    }
                } else {
                    const float* ar = As + ao;
                    a[0] = ar[0]; a[1] = ar[8 * APITCH]; a[2] = ar[4]; a[3] = ar[8 * APITCH + 4];
                }
                if constexpr (Epi::kRowSS) {
                    ss[i][0] = fmaf(a[0], a[0], fmaf(a[2], a[2], ss[i][0]));
                    ss[i][1] = fmaf(a[1], a[1], fmaf(a[3], a[3], ss[i][1]));
                }
                if constexpr (!Cfg::kPreSplit) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) split<Cfg::kFastSplit>(a[r], ab[r], as[r]);
                }
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    if constexpr (Cfg::kTileAcc) {
                        float (&tt)[4] = tacc[Cfg::kTileAcc ? i : 0][Cfg::kTileAcc ? j : 0];
                        mma(tt, as, bb[j][0], bb[j][1], tt);
                        mma(tt, ab, bs[j][0], bs[j][1], tt);
                        mma(tt, ab, bb[j][0], bb[j][1], tt);
                    } else {
                        // the three products of one k8 step, then a round-to-nearest fp32 add: the
                        // tensor cores' own accumulation truncates, which over K = 4096 drifts by 1e-2
                        const float zero[4] = {0.f, 0.f, 0.f, 0.f};
                        float tt[4];
                        mma(tt, as, bb[j][0], bb[j][1], zero);
                        mma(tt, ab, bs[j][0], bs[j][1], tt);
                        mma(tt, ab, bb[j][0], bb[j][1], tt);
#pragma unroll
                        for (int r = 0; r < 4; ++r) acc[i][j][r] += tt[r];
                    }
                }
            }
        }
        if constexpr (Cfg::kTileAcc) {
#pragma unroll
            for (int i = 0; i < TI; ++i)
#pragma unroll
                for (int j = 0; j < TJ; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[i][j][r] += tacc[i][j][r];
        }
    }
    cp_wait<0>();

    // ---- epilogue: fragment (i, j, r) is row wm*WTM + i*16 + g + 8*(r/2), column wn*WTN + j*8 + 2*tig + r%2
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t row = m0 + wm * WTM + i * 16 + g + 8 * h;
            float rs = 1.f;
            if constexpr (Epi::kRowSS) {
                float v = ss[i][h];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                rs = epi.row_scale(v);
            }
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int64_t col = n0 + wn * WTN + j * 8 + 2 * tig;
                float* v = &acc[i][j][2 * h];
                v[0] = col < N ? epi.apply(v[0] * rs, row, col) : -INFINITY;
                v[1] = col + 1 < N ? epi.apply(v[1] * rs, row, col + 1) : -INFINITY;
                if (row >= M) continue;
                float* Crow = C + row * N;
                if constexpr (Epi::kAtomic) {
                    if (col < N) atomicAdd(Crow + col, v[0]);
                    if (col + 1 < N) atomicAdd(Crow + col + 1, v[1]);
                } else if (vecC && col + 1 < N) {
                    *reinterpret_cast<float2*>(Crow + col) = make_float2(v[0], v[1]);
                } else {
                    if (col < N) Crow[col] = v[0];
                    if (col + 1 < N) Crow[col + 1] = v[1];
                }
            }
        }

    if constexpr (Epi::kRowStats) {
        // row max, then sum of exp(v - max), over this block's 128 columns: 4 lanes (tig) per
        // warp, then the WARPS_N warps (wn) sharing the row through shared memory
        float* rmax = red;
        float* rsum = red + WARPS_N * BM;
        float mx[MI][2];
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m = -INFINITY;
#pragma unroll
                for (int j = 0; j < NJ; ++j) m = fmaxf(m, fmaxf(acc[i][j][2 * h], acc[i][j][2 * h + 1]));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                if (tig == 0) rmax[wn * BM + wm * WTM + i * 16 + g + 8 * h] = m;
            }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int rl = wm * WTM + i * 16 + g + 8 * h;
                float m;
                if constexpr (WARPS_N == 4) {
                    m = fmaxf(fmaxf(rmax[rl], rmax[BM + rl]), fmaxf(rmax[2 * BM + rl], rmax[3 * BM + rl]));
                } else {
                    m = rmax[rl];
#pragma unroll
                    for (int w = 1; w < WARPS_N; ++w) m = fmaxf(m, rmax[w * BM + rl]);
                }
                mx[i][h] = m;
                float s = 0.f;
                if (m != -INFINITY) {
#pragma unroll
                    for (int j = 0; j < NJ; ++j) s += __expf(acc[i][j][2 * h] - m) + __expf(acc[i][j][2 * h + 1] - m);
                }
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                if (tig == 0) rsum[wn * BM + rl] = s;
            }
        __syncthreads();
        if (wn == 0 && tig == 0) {
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int rl = wm * WTM + i * 16 + g + 8 * h;
                    const int64_t row = m0 + rl;
                    if (row >= M) continue;
                    float* st = epi.stats + (row * num_n + tn) * 2;
                    st[0] = mx[i][h];
                    float sum = rsum[rl];
#pragma unroll
                    for (int w = 1; w < WARPS_N; ++w) sum += rsum[w * BM + rl];
                    st[1] = sum;
                }
        }
    }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class Epi, bool kBKMajor, bool VEC, class Cfg = DefaultCfg>
inline void launch_kernel(dim3 grid, const float* A, const float* B, const Shape& sh, bool vecC, const Epi& epi,
                          cudaStream_t stream) {
    constexpr int smem = smem_bytes<kBKMajor, Cfg>(), ssmem = static_smem_bytes<Epi, Cfg>();
    static_assert(smem + ssmem <= kMaxSmemPerBlock, "shared memory of one block exceeds 227 KB");
    static_assert(Cfg::MIN_BLOCKS * (smem + ssmem + 1024) <= kSmemPerSM,
                  "MIN_BLOCKS blocks per SM do not fit in shared memory");
    auto* kernel = gemm_tf32x3<Epi, kBKMajor, VEC, Cfg>;
    // every launch, not once through a function-local static: such statics are process-wide
    // (STB_GNU_UNIQUE) across libraries, so a second library would skip its own opt-in
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if constexpr (Cfg::MIN_BLOCKS > 1)
        cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             (int)cudaSharedmemCarveoutMaxShared);
    kernel<<<grid, Cfg::NT, smem, stream>>>(A, B, sh, vecC, epi);
}

// C[b] = epilogue(A[b] * op(B[b])) for b < batch, op(B) = B^T if kBKMajor (B is [N][K]) else B ([K][N]).
// splits > 1 only for atomic (linear) epilogues; C must be zeroed by the caller then.
template <class Epi, bool kBKMajor = true, class Cfg = DefaultCfg>
inline void launch(const float* A, const float* B, int64_t M, int64_t N, int64_t K, const Epi& epi,
                   cudaStream_t stream, int splits = 1, int batch = 1, int64_t sA = 0, int64_t sB = 0,
                   int64_t sC = 0) {
    if (M <= 0 || N <= 0 || batch <= 0) return;
    constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK;
    int64_t kPer = K;
    if (splits > 1) {
        kPer = ((K + splits - 1) / splits + BK - 1) / BK * BK;
        splits = (int)((K + kPer - 1) / kPer);
    }
    if (splits < 1) splits = 1;
    const Shape sh{M, N, K, kPer, splits, sA, sB, sC};
    const bool vec = (K % 4 == 0) && (kBKMajor || N % 4 == 0) && aligned16(A) && aligned16(B) &&
                     (batch == 1 || (sA % 4 == 0 && sB % 4 == 0));
    const bool vecC = (N % 2 == 0) && (reinterpret_cast<uintptr_t>(epi.C) & 7) == 0 && (batch == 1 || sC % 2 == 0);
    const dim3 grid((unsigned)(((M + BM - 1) / BM) * ((N + BN - 1) / BN)), 1, (unsigned)(batch * splits));
    if (vec) launch_kernel<Epi, kBKMajor, true, Cfg>(grid, A, B, sh, vecC, epi, stream);
    else launch_kernel<Epi, kBKMajor, false, Cfg>(grid, A, B, sh, vecC, epi, stream);
}

__device__ __forceinline__ float gelu_erf(float v) {
    return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
}

}  // namespace sg
