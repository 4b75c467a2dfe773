// fp32 GEMM with fp32 accuracy ("3xTF32") on Hopper warpgroup MMA (wgmma, sm_90a), with a fused epilogue.
//
// Each fp32 operand x is split into big = tf32(x) and small = tf32(x - big); the product is
// a_small*b_big + a_big*b_small + a_big*b_big (the dropped a_small*b_small is ~2^-22 relative).
//
// Design (4096^3 on an H200: benchmarks/wgmma_check.cu checks and times it):
//   * pre-pass (prep_b): B is split once into big / small halves, written K-major (transposed when B is
//     [K][N]) into a workspace ws[batch][2][N][Kp], Kp = K rounded up to 32, zero padded; tf32 wgmma
//     needs both shared-memory operands K-major. When A cannot be read by the tensor copy engine
//     (K % 4 != 0, or a pointer / batch stride not 16-byte aligned) A is first copied, zero padded to Kp
//     columns, into the workspace too (prep_a).
//   * GEMM: 128 x 128 x 32 block tile, 3 warpgroups: warpgroup 0 is the producer (one thread issues the
//     TMA loads: cp.async.bulk.tensor, 128B-swizzled, into a STAGES-deep mbarrier ring of 48 KB
//     stages: raw A [128][32], B big [128][32], B small [128][32]); warpgroups 1 and 2 each own 64 rows.
//     A consumer reads its A slice from shared memory into registers (the m16n8k8-like tf32 fragment
//     layout of wgmma's register A operand), splits it there, and issues, per 32-wide K tile, 12
//     wgmma.m64n128k8 (A_small*B_big, A_big*B_small, A_big*B_big, 4 k8 steps each) with A from registers
//     and B from shared memory through 128B-swizzle matrix descriptors.
//   * accuracy: the tensor cores' own accumulation truncates; over K = 4096 that drifts past 1e-4
//     (sgemm.cuh found the same for mma.sync), so (kTileAcc) each K tile's 12 products go into a fresh
//     temporary (scale-d = 0 on the first) that is added to the fp32 accumulators with ordinary FADDs.
//   * epilogue: epi.apply(acc, row, col) then a direct store from the accumulator registers; optionally
//     (Epi::kRowSS) acc scaled first by epi.row_scale(sum of squares of the A row over all K), summed from
//     the A fragments the consumers load anyway, and (Epi::kRowStats) per (row, 128-column tile) softmax
//     partials (max, sum of exp(v - max)) of the stored values v written to epi.stats[M][ceil(N/128)][2]
//     (batch 1): sgemm.cuh's epilogue contract for those two flags.
// Measured on an H200 (benchmarks/wgmma_check.cu, 3 runs, SM clock ~1980 MHz): 4096^3 in 1.18-1.21 ms
// (113-116 TFLOP/s, pre-pass of ~0.06 ms included) for either B layout, vs 2.32-2.40 ms for sgemm.cuh in the
// same runs; max error ~1.5e-6 (normalized). Cfg options that did not clearly beat DefaultCfg there: KT = 2
// (1.06-1.29 ms, noisy), ping-pong issue order (1.17-1.30 ms), 2-CTA clusters with B multicast (1.40-1.55 ms);
// accumulating straight into the accumulators (kTileAcc = false) is ~5-8% faster but fails 1e-4 at K = 4096.
// Out-of-range rows / columns / K are zero filled by the copy engine (and the pre-pass); any M, N, K.
//
// API (close to sg::launch of benchmarks/sgemm.cuh, the mma.sync 3xTF32 kernel the solutions used before):
//   size_t wg::workspace_bytes(M, N, K, batch, A, sA)                 device workspace the launch needs
//   wg::launch<Epi, kBKMajor>(A, B, M, N, K, epi, stream, ws, batch, sA, sB, sC)
// A is [M][K] row-major; B is [N][K] (kBKMajor, as nn.Linear.weight) or [K][N] (matmul, bmm).
// Epi: { float* C; __device__ float apply(float acc, int64_t row, int64_t col) const; } (wg::Plain, sg::Plain);
// optional: kRowSS with row_scale(float ss), kRowStats with float* stats (as in sgemm.cuh; its kGain and
// kAtomic are not supported here).
#pragma once
#include <cuda.h>   // CUtensorMap and the cuTensorMapEncodeTiled prototype only: no -lcuda needed
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

namespace wg {

// Epi::kRowSS / Epi::kRowStats when the epilogue declares them, else false
template <class E, class = void>
struct RowSS : std::false_type {};
template <class E>
struct RowSS<E, std::void_t<decltype(E::kRowSS)>> : std::bool_constant<E::kRowSS> {};
template <class E, class = void>
struct RowStats : std::false_type {};
template <class E>
struct RowStats<E, std::void_t<decltype(E::kRowStats)>> : std::bool_constant<E::kRowStats> {};

constexpr int BM = 128, BN = 128, BK = 32;
constexpr int NT = 384;                       // producer warpgroup + 2 consumer warpgroups
constexpr int kTileBytesA = BM * BK * 4;      // 16 KB
constexpr int kTileBytesB = BN * BK * 4;      // 16 KB (each of big and small)
constexpr int kStageBytes = kTileBytesA + 2 * kTileBytesB;
constexpr int GROUP_M = 8;

// STAGES: pipeline depth (48 KB stages).
// kTileAcc: the products of KT consecutive K tiles are summed on the tensor cores into a temporary that is
//   then added to the fp32 accumulators (true: fp32-accurate; false: straight into the accumulators, which
//   drifts past 1e-4 at K = 4096 and is kept only as a speed reference).
// KT (1 or 2): K tiles per temporary flush; with 2 the A fragments are double-buffered and each warpgroup
//   waits for its tensor-core work once per two tiles.
// CLUSTER (1 or 2): 2 = pairs of CTAs (adjacent row tiles, same column tile) in a thread-block cluster;
//   each loads one half (big / small) of the shared B tile and multicasts it to both (less L2 traffic).
// kPingPong: the two consumer warpgroups take turns issuing their tensor-core work (named barriers), so
//   that one's wait / accumulate / fragment loads overlap the other's tensor-core work instead of both
//   draining the tensor cores at the same time.
template <int STAGES_ = 4, bool kTileAcc_ = true, int KT_ = 1, int CLUSTER_ = 1, bool kPingPong_ = false>
struct Cfg {
    static constexpr int STAGES = STAGES_, KT = KT_, CLUSTER = CLUSTER_;
    static constexpr bool kTileAcc = kTileAcc_, kPingPong = kPingPong_;
    static constexpr int kSmem = STAGES * kStageBytes + 1024 /* alignment slack */ + 2 * STAGES * 8;
    static_assert(kSmem <= 227 * 1024, "too many stages");
    static_assert(KT == 1 || KT == 2, "KT is 1 or 2");
    static_assert(CLUSTER == 1 || CLUSTER == 2, "CLUSTER is 1 or 2");
};
using DefaultCfg = Cfg<4, true, 1, 1>;

// the plain product: C = A op(B)
struct Plain {
    float* C;
    __device__ float apply(float acc, int64_t, int64_t) const { return acc; }
};

struct Shape {
    int M, N, ktiles;
};

// ------------------------------------------------------------------------------------------ device helpers
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// big = round-to-nearest(-away) tf32 by integer add and mask, small = (x - big) truncated to tf32
__device__ __forceinline__ void split(float x, uint32_t& big, uint32_t& small) {
    big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big)) & 0xffffe000u;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// 3-d tiled TMA load into shared memory, completing on mbarrier `bar`
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// K-major operand, 128B swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart (SBO); LBO unused
__device__ __forceinline__ uint64_t desc_kmajor_sw128(uint32_t saddr) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

// d (64 x 128 fp32, the warpgroup's accumulator fragment) = A (regs, 64 x 8 tf32) * B (smem desc, 8 x 128)
// (+ d when scale_d)
template <int kScaleD>
__device__ __forceinline__ void wgmma_m64n128k8_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%"
        "27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%"
        "52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),
          "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
          "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
          "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),
          "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),
          "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(kScaleD));
}

// ------------------------------------------------------------------------------------------ pre-pass kernels
// B [N][K] (sB batch stride) -> ws[b][0 big | 1 small][N][Kp], four k per thread
template <bool VEC>
__global__ void prep_b_bk(const float* __restrict__ B, float* __restrict__ ws, int64_t N, int64_t K, int64_t Kp,
                          int batch, int64_t sB) {
    const int64_t kq = Kp / 4, total = (int64_t)batch * N * kq;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t b = i / (N * kq), r = i - b * (N * kq), n = r / kq, k = (r - n * kq) * 4;
        const float* src = B + b * sB + n * K + k;
        float v[4];
        if (VEC && k + 4 <= K) {
            const float4 t = __ldg(reinterpret_cast<const float4*>(src));
            v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = k + j < K ? __ldg(src + j) : 0.f;
        }
        uint32_t bg[4], sm[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) split(v[j], bg[j], sm[j]);
        float* dst = ws + (b * 2 * N + n) * Kp + k;
        *reinterpret_cast<uint4*>(dst) = make_uint4(bg[0], bg[1], bg[2], bg[3]);
        *reinterpret_cast<uint4*>(dst + N * Kp) = make_uint4(sm[0], sm[1], sm[2], sm[3]);
    }
}

// B [K][N] (sB batch stride) -> ws[b][0 big | 1 small][N][Kp]: 32 x 32 tiles through shared memory
// grid (Kp / 32, ceil(N / 32), batch), block (32, 8)
__global__ void prep_b_kn(const float* __restrict__ B, float* __restrict__ ws, int64_t N, int64_t K, int64_t Kp,
                          int64_t sB) {
    __shared__ float t[32][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t k0 = (int64_t)blockIdx.x * 32, n0 = (int64_t)blockIdx.y * 32, b = blockIdx.z;
    const float* Bb = B + b * sB;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int64_t k = k0 + ty + 8 * i, n = n0 + tx;
        t[ty + 8 * i][tx] = (k < K && n < N) ? __ldg(Bb + k * N + n) : 0.f;
    }
    __syncthreads();
    float* big = ws + b * 2 * N * Kp;
    float* small = big + N * Kp;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int64_t n = n0 + ty + 8 * i, k = k0 + tx;
        if (n >= N) continue;
        uint32_t bg, sm;
        split(t[tx][ty + 8 * i], bg, sm);
        big[n * Kp + k] = __uint_as_float(bg);
        small[n * Kp + k] = __uint_as_float(sm);
    }
}

// A [M][K] (sA batch stride) -> wsA[b][M][Kp] (zero padded), when A is not TMA-readable as it is
__global__ void prep_a(const float* __restrict__ A, float* __restrict__ wsA, int64_t M, int64_t K, int64_t Kp,
                       int batch, int64_t sA) {
    const int64_t total = (int64_t)batch * M * Kp;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t b = i / (M * Kp), r = i - b * (M * Kp), m = r / Kp, k = r - m * Kp;
        wsA[i] = k < K ? __ldg(A + b * sA + m * K + k) : 0.f;
    }
}

// ------------------------------------------------------------------------------------------ the GEMM kernel
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void named_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// arrive on the mbarrier at the same offset in CTA `rank` of the cluster
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar, uint32_t rank) {
    asm volatile(
        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
        "r"(rank)
        : "memory");
}
// 3-d tiled TMA load multicast to the CTAs of `mask` (same shared-memory offsets, their own mbarriers)
__device__ __forceinline__ void tma_load_3d_mc(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                               uint32_t bar, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], "
        "[%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
        : "memory");
}

// tmA: 3-d (k, m, batch) over A (raw fp32), box (32, 128, 1); tmB: 3-d (k, n, 2 * batch + half) over the
// workspace, box (32, 128, 2) (big then small; box (32, 128, 1) per CTA with CLUSTER == 2). 128B-swizzled.
template <class Epi, class C = DefaultCfg>
__global__ void __launch_bounds__(NT, 1)
gemm_wgmma_tf32x3(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB, Shape sh,
                  int64_t sC, bool vecC, Epi epi) {
    constexpr int STAGES = C::STAGES, KT = C::KT, CL = C::CLUSTER;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    // 1024-byte alignment for the 128B swizzle pattern (the runtime gives 16)
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + STAGES * kStageBytes);
    const uint32_t sbase = smem_u32(smem);
    const uint32_t full0 = smem_u32(bars), empty0 = smem_u32(bars + STAGES);

    const int tid = threadIdx.x, wgi = tid / 128;
    // grouped tile order: GROUP_M row tiles walk the column tiles together; with clusters, pairs of row
    // tiles (one per CTA of the cluster) take the place of row tiles
    const int num_n = (sh.N + BN - 1) / BN, num_m = (sh.M + BM - 1) / BM;
    const int num_mc = (num_m + CL - 1) / CL, gm = GROUP_M / CL;
    const int pid = blockIdx.x / CL, crank = CL > 1 ? (int)(blockIdx.x % CL) : 0, width = gm * num_n;
    const int first_m = (pid / width) * gm;
    const int gsize = min(num_mc - first_m, gm);
    const int tm = (first_m + (pid % width) % gsize) * CL + crank, tn = (pid % width) / gsize;
    const int m0 = tm * BM, n0 = tn * BN, bz = blockIdx.y;
    const int ktiles = sh.ktiles;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, 8 * CL);   // one arrive per consumer warp (of each CTA of the cluster)
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (CL > 1) cluster_sync();
    else __syncthreads();

    if (wgi == 0) {
        // ---------------- producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmA)) : "memory");
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tmB)) : "memory");
            for (int t = 0; t < ktiles; ++t) {
                const int s = t % STAGES, r = t / STAGES;
                if (r > 0) mbar_wait(empty0 + 8 * s, (r - 1) & 1);
                const uint32_t full = full0 + 8 * s, dst = sbase + s * kStageBytes;
                mbar_expect_tx(full, kStageBytes);
                tma_load_3d(dst, &tmA, t * BK, m0, bz, full);
                if constexpr (CL == 1)
                    tma_load_3d(dst + kTileBytesA, &tmB, t * BK, n0, 2 * bz, full);
                else   // this CTA's half of B (big for rank 0, small for rank 1), to both CTAs
                    tma_load_3d_mc(dst + kTileBytesA + crank * kTileBytesB, &tmB, t * BK, n0, 2 * bz + crank, full,
                                   (uint16_t)3);
            }
        }
    } else {
        // ---------------- consumers: warpgroup wgi - 1 owns rows 64 * (wgi - 1) ... + 63
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int ltid = tid - 128 * wgi, warp = ltid / 32, lane = ltid % 32, g = lane / 4, t4 = lane % 4;
        const int arow = 64 * (wgi - 1) + 16 * warp + g;   // fragment rows arow, arow + 8
        constexpr bool kSS = RowSS<Epi>::value, kStats = RowStats<Epi>::value;
        float acc[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        float ss[2] = {0.f, 0.f};   // kSS: this thread's share of rows arow and arow + 8's sums of squares
        float tmp[C::kTileAcc ? 64 : 1];
        auto release = [&](int t) {   // this warp is done with the stage of tile t
            if (lane == 0) {
                const uint32_t e = empty0 + 8 * (t % STAGES);
                mbar_arrive(e);
                if constexpr (CL > 1) mbar_arrive_remote(e, (uint32_t)(crank ^ 1));
            }
        };

        // kPingPong: named barrier 1 + w is consumer warpgroup w's turn to issue; warpgroup 1 lets
        // warpgroup 0 go first, then each hands the turn over after issuing a group of KT tiles
        const int cw = wgi - 1;
        if (C::kPingPong && cw == 1 && ktiles > 0) named_bar_arrive(1, 256);
        for (int t0 = 0; t0 < ktiles; t0 += KT) {
            uint32_t ab[KT][4][4], as[KT][4][4];
#pragma unroll
            for (int u = 0; u < KT; ++u) {
                const int t = t0 + u;
                if (t < ktiles) {
                    const int s = t % STAGES, r = t / STAGES;
                    mbar_wait(full0 + 8 * s, r & 1);
                    const uint8_t* As = smem + s * kStageBytes;
                    // A fragments: a0 (row g, k t4), a1 (g + 8, t4), a2 (g, t4 + 4), a3 (g + 8, t4 + 4) per
                    // k8 step; 128B swizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8); arow % 8 == g
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int row = arow + (i & 1) * 8, chunk = 2 * kk + (i >> 1);
                            const float x =
                                *reinterpret_cast<const float*>(As + row * 128 + ((chunk ^ g) << 4) + t4 * 4);
                            split(x, ab[u][kk][i], as[u][kk][i]);
                            if constexpr (kSS) ss[i & 1] += x * x;
                        }
                }
            }
            if constexpr (C::kPingPong) named_bar_sync(1 + cw, 256);
#pragma unroll
            for (int u = 0; u < KT; ++u) {
                const int t = t0 + u;
                if (t < ktiles) {
                    const int s = t % STAGES;
                    const uint32_t bbig = sbase + s * kStageBytes + kTileBytesA, bsmall = bbig + kTileBytesB;
                    wgmma_fence();
                    if constexpr (C::kTileAcc) {
                        if (u == 0) wgmma_m64n128k8_rs<0>(tmp, as[u][0], desc_kmajor_sw128(bbig));
                        else wgmma_m64n128k8_rs<1>(tmp, as[u][0], desc_kmajor_sw128(bbig));
#pragma unroll
                        for (int kk = 1; kk < 4; ++kk)
                            wgmma_m64n128k8_rs<1>(tmp, as[u][kk], desc_kmajor_sw128(bbig + 32 * kk));
#pragma unroll
                        for (int kk = 0; kk < 4; ++kk)
                            wgmma_m64n128k8_rs<1>(tmp, ab[u][kk], desc_kmajor_sw128(bsmall + 32 * kk));
#pragma unroll
                        for (int kk = 0; kk < 4; ++kk)
                            wgmma_m64n128k8_rs<1>(tmp, ab[u][kk], desc_kmajor_sw128(bbig + 32 * kk));
                    } else {
#pragma unroll
                        for (int kk = 0; kk < 4; ++kk)
                            wgmma_m64n128k8_rs<1>(acc, as[u][kk], desc_kmajor_sw128(bbig + 32 * kk));
#pragma unroll
                        for (int kk = 0; kk < 4; ++kk)
                            wgmma_m64n128k8_rs<1>(acc, ab[u][kk], desc_kmajor_sw128(bsmall + 32 * kk));
#pragma unroll
                        for (int kk = 0; kk < 4; ++kk)
                            wgmma_m64n128k8_rs<1>(acc, ab[u][kk], desc_kmajor_sw128(bbig + 32 * kk));
                    }
                    wgmma_commit();
                }
            }
            // hand the turn over (warpgroup 1 skips its last hand-over: warpgroup 0 is done by then)
            if (C::kPingPong && (cw == 0 || t0 + KT < ktiles)) named_bar_arrive(2 - cw, 256);
            if (KT == 2 && t0 + 1 < ktiles) {
                wgmma_wait<1>();
                release(t0);
                wgmma_wait<0>();
                release(t0 + 1);
            } else {
                wgmma_wait<0>();
                release(t0);
            }
            if constexpr (C::kTileAcc) {
#pragma unroll
                for (int i = 0; i < 64; ++i) acc[i] += tmp[i];
            }
        }

        // ---------------- epilogue: acc[4j + r] is row arow + 8 * (r / 2), column 8j + 2 * t4 + r % 2; a row's
        // 128 columns are spread over the 4 lanes of a quad (the shuffles run on every lane, rows past M too)
        const int64_t M = sh.M, N = sh.N;
        float* Cb = epi.C + (int64_t)bz * sC;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t row = m0 + arow + 8 * h;
            float scale = 1.f;
            if constexpr (kSS) {
                float q = ss[h];
                q += __shfl_xor_sync(0xffffffffu, q, 1);
                q += __shfl_xor_sync(0xffffffffu, q, 2);
                scale = epi.row_scale(q);
            }
            float v[32];
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int64_t col = n0 + 8 * j + 2 * t4 + r;
                    v[2 * j + r] = col < N ? epi.apply(acc[4 * j + 2 * h + r] * scale, row, col) : 0.f;
                }
            if constexpr (kStats) {
                float m = -INFINITY, e = 0.f;
#pragma unroll
                for (int c = 0; c < 32; ++c)
                    if (n0 + 8 * (c / 2) + 2 * t4 + c % 2 < N) m = fmaxf(m, v[c]);
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
#pragma unroll
                for (int c = 0; c < 32; ++c)
                    if (n0 + 8 * (c / 2) + 2 * t4 + c % 2 < N) e += __expf(v[c] - m);
                e += __shfl_xor_sync(0xffffffffu, e, 1);
                e += __shfl_xor_sync(0xffffffffu, e, 2);
                if (t4 == 0 && row < M) {
                    float* st = epi.stats + (row * num_n + tn) * 2;
                    st[0] = m;
                    st[1] = e;
                }
            }
            if (row >= M) continue;
            float* Crow = Cb + row * N;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const int64_t col = n0 + 8 * j + 2 * t4;
                if (vecC && col + 1 < N) {
                    *reinterpret_cast<float2*>(Crow + col) = make_float2(v[2 * j], v[2 * j + 1]);
                } else {
                    if (col < N) Crow[col] = v[2 * j];
                    if (col + 1 < N) Crow[col + 1] = v[2 * j + 1];
                }
            }
        }
    }
    // the peer CTA may still arrive on this CTA's barriers until it is done: leave together
    if constexpr (CL > 1) cluster_sync();
}

// ------------------------------------------------------------------------------------------ host side
inline int64_t padded_k(int64_t K) { return (K + BK - 1) / BK * BK; }
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
inline bool a_needs_copy(const float* A, int64_t K, int batch, int64_t sA) {
    return K % 4 != 0 || !aligned16(A) || (batch > 1 && sA % 4 != 0);
}
// bytes of device workspace launch() needs for these arguments (A, sA: whether A must be copied)
inline size_t workspace_bytes(int64_t M, int64_t N, int64_t K, int batch, const float* A = nullptr,
                              int64_t sA = 0) {
    const int64_t Kp = padded_k(K);
    size_t b = (size_t)batch * 2 * N * Kp * 4;
    if (K % 4 != 0 || (A && a_needs_copy(A, K, batch, sA))) b += (size_t)batch * M * Kp * 4;
    return b;
}

typedef CUresult (*PFN_encodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                    const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                    CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline PFN_encodeTiled encode_fn() {
    static PFN_encodeTiled fn = nullptr;   // a driver entry point: the same in every library
    if (!fn) {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess || !p) {
            std::fprintf(stderr, "wg: cuTensorMapEncodeTiled not found\n");
            std::abort();
        }
        fn = reinterpret_cast<PFN_encodeTiled>(p);
    }
    return fn;
}

// fp32 3-d tensor map: dims (d0 contiguous, d1, d2), byte strides s1, s2, box (32, 128, box2), 128B swizzle
inline CUtensorMap make_map(const void* base, uint64_t d0, uint64_t d1, uint64_t d2, uint64_t s1, uint64_t s2,
                            uint32_t box2) {
    CUtensorMap m;
    const cuuint64_t dims[3] = {d0, d1, d2};
    const cuuint64_t strides[2] = {s1, s2};
    const cuuint32_t box[3] = {(cuuint32_t)BK, 128u, box2};
    const cuuint32_t estr[3] = {1, 1, 1};
    const CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<void*>(base), dims, strides,
                                   box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "wg: cuTensorMapEncodeTiled failed (%d)\n", (int)r);
        std::abort();
    }
    return m;
}

// C[b] = epilogue(A[b] * op(B[b])) for b < batch, op(B) = B^T if kBKMajor (B is [N][K]) else B ([K][N]).
// ws: device workspace of workspace_bytes(M, N, K, batch, A, sA) bytes, 16-byte aligned; it must stay
// untouched until the kernels on `stream` are done.
template <class Epi, bool kBKMajor = true, class C = DefaultCfg>
inline void launch(const float* A, const float* B, int64_t M, int64_t N, int64_t K, const Epi& epi,
                   cudaStream_t stream, float* ws, int batch = 1, int64_t sA = 0, int64_t sB = 0, int64_t sC = 0) {
    if (M <= 0 || N <= 0 || batch <= 0) return;
    if (K < 0) K = 0;
    const int64_t Kp = padded_k(K);
    if (batch == 1) sA = sB = sC = 0;
    // ---- pre-pass: B -> big / small, K-major, zero padded to Kp
    float* wsB = ws;
    if (Kp > 0) {
        if constexpr (kBKMajor) {
            const bool vec = K % 4 == 0 && aligned16(B) && sB % 4 == 0;
            const int64_t work = (int64_t)batch * N * (Kp / 4);
            const int blocks = (int)std::min<int64_t>((work + 255) / 256, 132 * 16);
            if (vec) prep_b_bk<true><<<blocks, 256, 0, stream>>>(B, wsB, N, K, Kp, batch, sB);
            else prep_b_bk<false><<<blocks, 256, 0, stream>>>(B, wsB, N, K, Kp, batch, sB);
        } else {
            prep_b_kn<<<dim3((unsigned)(Kp / 32), (unsigned)((N + 31) / 32), (unsigned)batch), dim3(32, 8), 0,
                        stream>>>(B, wsB, N, K, Kp, sB);
        }
    }
    const float* Ause = A;
    int64_t lda = K, sAuse = sA;
    if (Kp > 0 && a_needs_copy(A, K, batch, sA)) {
        float* wsA = ws + (size_t)batch * 2 * N * Kp;
        const int64_t work = (int64_t)batch * M * Kp;
        const int blocks = (int)std::min<int64_t>((work + 255) / 256, 132 * 16);
        prep_a<<<blocks, 256, 0, stream>>>(A, wsA, M, K, Kp, batch, sA);
        Ause = wsA;
        lda = Kp;
        sAuse = M * Kp;
    }
    CUtensorMap tmA{}, tmB{};
    if (Kp > 0) {
        const uint64_t sa2 = batch > 1 ? (uint64_t)sAuse * 4 : ((uint64_t)M * lda * 4 + 15) / 16 * 16;
        tmA = make_map(Ause, (uint64_t)K, (uint64_t)M, (uint64_t)batch, (uint64_t)lda * 4, sa2, 1);
        tmB = make_map(wsB, (uint64_t)Kp, (uint64_t)N, (uint64_t)batch * 2, (uint64_t)Kp * 4,
                       (uint64_t)N * Kp * 4, C::CLUSTER == 1 ? 2 : 1);
    }
    const Shape sh{(int)M, (int)N, (int)(Kp / BK)};
    const bool vecC = N % 2 == 0 && (reinterpret_cast<uintptr_t>(epi.C) & 7) == 0 && (batch == 1 || sC % 2 == 0);
    auto* kernel = gemm_wgmma_tf32x3<Epi, C>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
    const int64_t num_mc = ((M + BM - 1) / BM + C::CLUSTER - 1) / C::CLUSTER;
    const dim3 grid((unsigned)(num_mc * C::CLUSTER * ((N + BN - 1) / BN)), (unsigned)batch, 1);
    if constexpr (C::CLUSTER == 1) {
        kernel<<<grid, NT, C::kSmem, stream>>>(tmA, tmB, sh, sC, vecC, epi);
    } else {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = dim3(NT, 1, 1);
        cfg.dynamicSmemBytes = C::kSmem;
        cfg.stream = stream;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = C::CLUSTER;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        cudaLaunchKernelEx(&cfg, kernel, tmA, tmB, sh, sC, vecC, epi);
    }
}

}  // namespace wg
