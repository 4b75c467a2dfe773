// fp32 GEMM on the tensor cores with fp32 accuracy ("3xTF32"), with a fused epilogue.
//
// Each fp32 operand x is split into big = tf32(x) and small = tf32(x - big); the product is
// a_small*b_big + a_big*b_small + a_big*b_big (the dropped a_small*b_small is ~2^-22 relative),
// by mma.sync.m16n8k8 tf32, summed into the fp32 accumulators one k8 step at a time. Plain fp32 on the CUDA cores tops out at ~67
// TFLOP/s on an H200; three tf32 products still run faster than one fp32 FMA there.
//
// 128x128x32 block tile, 8 warps (2 x 4, 64x32 each), a 3-stage cp.async pipeline, padded
// shared-memory rows (fragment loads are bank-conflict-free), grouped tile order for L2 reuse.
// A is [M][K] row-major; B is [N][K] (kBKMajor, as nn.Linear.weight) or [K][N].
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <math.h>

namespace sg {

constexpr int BM = 128, BN = 128, BK = 32, NT = 256, STAGES = 3, GROUP_M = 8;
constexpr int APITCH = BK + 4;    // A tile [BM][APITCH]; also B tile [BN][APITCH] when B is [N][K]
constexpr int BNPITCH = BN + 8;   // B tile [BK][BNPITCH] when B is [K][N]

template <bool kBKMajor>
__host__ __device__ constexpr int stage_floats() { return BM * APITCH + (kBKMajor ? BN * APITCH : BK * BNPITCH); }
template <bool kBKMajor>
__host__ __device__ constexpr int smem_bytes() { return STAGES * stage_floats<kBKMajor>() * 4; }

// Epilogue contract (Epi):
//   static constexpr bool kRowSS;    acc *= row_scale(sum of squares of the A row over all K)
//   static constexpr bool kGain;     B[n][k] is multiplied by gain[k] (member `gain`)
//   static constexpr bool kRowStats; write per-(row, 128-column tile) softmax partials (max, sumexp)
//                                    to stats[M][ceil(N/128)][2]
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
__device__ __forceinline__ void split(float x, uint32_t& big, uint32_t& small) {
    big = tf32(x);
    small = tf32(x - __uint_as_float(big));
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

// One [rows][BK] tile of a K-contiguous matrix X (row stride K) into smem [rows][APITCH].
template <bool VEC>
__device__ __forceinline__ void load_kmajor(float* s, const float* X, int64_t r0, int64_t rows_total,
                                            int64_t k0, int64_t kend, int64_t K, int tid) {
    if constexpr (VEC) {
#pragma unroll
        for (int i = 0; i < (BM * BK / 4) / NT; ++i) {
            const int c = tid + i * NT, r = c >> 3, kc = (c & 7) * 4;
            const bool ok = r0 + r < rows_total && k0 + kc < kend;   // kend % 4 == 0 on this path
            cp_async<16>(s + r * APITCH + kc, ok ? X + (r0 + r) * K + k0 + kc : X, ok);
        }
    } else {
#pragma unroll 4
        for (int i = 0; i < (BM * BK) / NT; ++i) {
            const int c = tid + i * NT, r = c >> 5, kc = c & 31;
            const bool ok = r0 + r < rows_total && k0 + kc < kend;
            cp_async<4>(s + r * APITCH + kc, ok ? X + (r0 + r) * K + k0 + kc : X, ok);
        }
    }
}

// One [BK][BN] tile of an N-contiguous B ([K][N], row stride N) into smem [BK][BNPITCH].
template <bool VEC>
__device__ __forceinline__ void load_nmajor(float* s, const float* B, int64_t n0, int64_t N, int64_t k0,
                                            int64_t kend, int tid) {
    if constexpr (VEC) {
#pragma unroll
        for (int i = 0; i < (BK * BN / 4) / NT; ++i) {
            const int c = tid + i * NT, k = c >> 5, nc = (c & 31) * 4;
            const bool ok = k0 + k < kend && n0 + nc < N;            // N % 4 == 0 on this path
            cp_async<16>(s + k * BNPITCH + nc, ok ? B + (k0 + k) * N + n0 + nc : B, ok);
        }
    } else {
#pragma unroll 4
        for (int i = 0; i < (BK * BN) / NT; ++i) {
            const int c = tid + i * NT, k = c >> 7, n = c & 127;
            const bool ok = k0 + k < kend && n0 + n < N;
            cp_async<4>(s + k * BNPITCH + n, ok ? B + (k0 + k) * N + n0 + n : B, ok);
        }
    }
}

template <class Epi, bool kBKMajor, bool VEC>
__global__ void __launch_bounds__(NT, 1)
gemm_tf32x3(const float* __restrict__ A, const float* __restrict__ B, Shape sh, bool vecC, Epi epi) {
    extern __shared__ __align__(16) float smem[];
    __shared__ float red[Epi::kRowStats ? 2 * 4 * BM : 1];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;   // warp tile origin: (wm * 64, wn * 32)

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
        float* s = smem + stage * stage_floats<kBKMajor>();
        const int64_t k0 = kbeg + (int64_t)t * BK;
        load_kmajor<VEC>(s, A, m0, M, k0, kend, K, tid);
        if constexpr (kBKMajor) load_kmajor<VEC>(s + BM * APITCH, B, n0, N, k0, kend, K, tid);
        else load_nmajor<VEC>(s + BM * APITCH, B, n0, N, k0, kend, tid);
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;
    float ss[4][2] = {};

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

        const float* As = smem + (t % STAGES) * stage_floats<kBKMajor>();
        const float* Bs = As + BM * APITCH;
#pragma unroll 1   // unrolled, the fragments of all four k8 steps stay live and spill
        for (int kk = 0; kk < BK; kk += 8) {
            uint32_t bb[4][2], bs[4][2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int n = wn * 32 + j * 8 + g;
                float b0, b1;
                if constexpr (kBKMajor) {
                    b0 = Bs[n * APITCH + kk + tig];
                    b1 = Bs[n * APITCH + kk + tig + 4];
                } else {
                    b0 = Bs[(kk + tig) * BNPITCH + n];
                    b1 = Bs[(kk + tig + 4) * BNPITCH + n];
                }
                if constexpr (Epi::kGain) {
                    const int64_t k = kbeg + (int64_t)t * BK + kk + tig;
                    b0 *= k < kend ? __ldg(epi.gain + k) : 0.f;
                    b1 *= k + 4 < kend ? __ldg(epi.gain + k + 4) : 0.f;
                }
                split(b0, bb[j][0], bs[j][0]);
                split(b1, bb[j][1], bs[j][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float* ar = As + (wm * 64 + i * 16 + g) * APITCH + kk + tig;
                const float a[4] = {ar[0], ar[8 * APITCH], ar[4], ar[8 * APITCH + 4]};
                if constexpr (Epi::kRowSS) {
                    ss[i][0] = fmaf(a[0], a[0], fmaf(a[2], a[2], ss[i][0]));
                    ss[i][1] = fmaf(a[1], a[1], fmaf(a[3], a[3], ss[i][1]));
                }
                uint32_t ab[4], as[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) split(a[r], ab[r], as[r]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // the three products of one k8 step, then a round-to-nearest fp32 add: the
                    // tensor cores' own accumulation truncates, which over K = 4096 drifts by 1e-2
                    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
                    float t[4];
                    mma(t, as, bb[j][0], bb[j][1], zero);
                    mma(t, ab, bs[j][0], bs[j][1], t);
                    mma(t, ab, bb[j][0], bb[j][1], t);
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[i][j][r] += t[r];
                }
            }
        }
    }
    cp_wait<0>();

    // ---- epilogue: fragment (i, j, r) is row wm*64 + i*16 + g + 8*(r/2), column wn*32 + j*8 + 2*tig + r%2
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t row = m0 + wm * 64 + i * 16 + g + 8 * h;
            float rs = 1.f;
            if constexpr (Epi::kRowSS) {
                float v = ss[i][h];
                v += __shfl_xor_sync(0xffffffffu, v, 1);
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                rs = epi.row_scale(v);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int64_t col = n0 + wn * 32 + j * 8 + 2 * tig;
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
        // warp, then the 4 warps (wn) sharing the row through shared memory
        float* rmax = red;
        float* rsum = red + 4 * BM;
        float mx[4][2];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float m = -INFINITY;
#pragma unroll
                for (int j = 0; j < 4; ++j) m = fmaxf(m, fmaxf(acc[i][j][2 * h], acc[i][j][2 * h + 1]));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                if (tig == 0) rmax[wn * BM + wm * 64 + i * 16 + g + 8 * h] = m;
            }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int rl = wm * 64 + i * 16 + g + 8 * h;
                const float m = fmaxf(fmaxf(rmax[rl], rmax[BM + rl]), fmaxf(rmax[2 * BM + rl], rmax[3 * BM + rl]));
                mx[i][h] = m;
                float s = 0.f;
                if (m != -INFINITY) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) s += __expf(acc[i][j][2 * h] - m) + __expf(acc[i][j][2 * h + 1] - m);
                }
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                if (tig == 0) rsum[wn * BM + rl] = s;
            }
        __syncthreads();
        if (wn == 0 && tig == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int rl = wm * 64 + i * 16 + g + 8 * h;
                    const int64_t row = m0 + rl;
                    if (row >= M) continue;
                    float* st = epi.stats + (row * num_n + tn) * 2;
                    st[0] = mx[i][h];
                    st[1] = rsum[rl] + rsum[BM + rl] + rsum[2 * BM + rl] + rsum[3 * BM + rl];
                }
        }
    }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class Epi, bool kBKMajor, bool VEC>
inline void launch_kernel(dim3 grid, const float* A, const float* B, const Shape& sh, bool vecC, const Epi& epi,
                          cudaStream_t stream) {
    auto* kernel = gemm_tf32x3<Epi, kBKMajor, VEC>;
    // every launch, not once through a function-local static: such statics are process-wide
    // (STB_GNU_UNIQUE) across libraries, so a second library would skip its own opt-in
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<kBKMajor>());
    kernel<<<grid, NT, smem_bytes<kBKMajor>(), stream>>>(A, B, sh, vecC, epi);
}

// C[b] = epilogue(A[b] * op(B[b])) for b < batch, op(B) = B^T if kBKMajor (B is [N][K]) else B ([K][N]).
// splits > 1 only for atomic (linear) epilogues; C must be zeroed by the caller then.
template <class Epi, bool kBKMajor = true>
inline void launch(const float* A, const float* B, int64_t M, int64_t N, int64_t K, const Epi& epi,
                   cudaStream_t stream, int splits = 1, int batch = 1, int64_t sA = 0, int64_t sB = 0,
                   int64_t sC = 0) {
    if (M <= 0 || N <= 0 || batch <= 0) return;
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
    if (vec) launch_kernel<Epi, kBKMajor, true>(grid, A, B, sh, vecC, epi, stream);
    else launch_kernel<Epi, kBKMajor, false>(grid, A, B, sh, vecC, epi, stream);
}

__device__ __forceinline__ float gelu_erf(float v) {
    return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
}

}  // namespace sg
