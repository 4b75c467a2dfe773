// Stride-1, zero-padded NCHW conv2d with a fused per-output-channel epilogue, as an implicit GEMM on the
// tensor cores with fp32 accuracy ("3xTF32", the scheme of benchmarks/sgemm.cuh):
//   y (Co x pixels) = epi(W (Co x K, K = Ci*KH*KW, the weight's own row-major layout) @ im2col(x) (K x pixels))
// where the pixel (GEMM N) dimension runs over (image, oh, ow) across the whole batch.
//
// Each fp32 operand v is split into big = tf32(v) and small = v - big cut to tf32; each k8 step computes
// a_small*b_big + a_big*b_small + a_big*b_big with mma.sync.m16n8k8 tf32 into a zeroed temporary,
// then adds it to the fp32 accumulators (the tensor cores' own accumulation truncates).
//
// 128 (co) x 128 (pixels) x 32 (k) block tile, 8 warps (2 x 4, 64x32 each), 3-stage cp.async pipeline.
// A (weights): [BM][APITCH] K-contiguous tile, 16-byte cp.async when K % 4 == 0 and w is 16-byte aligned.
// B (im2col):  [BK][BNPITCH] pixel-contiguous tile gathered with 4-byte cp.async (src-size 0 zero-fills
// what is out of range). Each thread owns 4 fixed pixel columns (lane + 32q, decoded once) and the rows
// warp + 8i of every k tile; the row's (ci, kh, kw) is warp-uniform and advanced incrementally (no
// divisions in the main loop). PAD: each tap is bounds-checked against the image (the padding and columns
// past the last pixel read as 0). Without PAD every tap of a valid pixel is inside the image, so the only
// check is k < K; columns past the last pixel gather pixel 0's (finite, discarded) data.
// Epilogue: y[img][co][pix] = epi.apply(acc, epi.row(co)), row(co) evaluated once per output row a
// thread owns. Epi: typename Row; __device__ Row row(int co) const;
//                   __device__ float apply(float acc, const Row&) const.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>
#include <math.h>

namespace cv {

constexpr int BM = 128, BN = 128, BK = 32, NT = 256, STAGES = 3;
constexpr int APITCH = BK + 4;    // A tile [BM][APITCH]
constexpr int BNPITCH = BN + 8;   // B tile [BK][BNPITCH]
constexpr int STAGE_FLOATS = BM * APITCH + BK * BNPITCH;
constexpr int SMEM_BYTES = STAGES * STAGE_FLOATS * 4;
static_assert(NT == 256 && BN == 128 && BK == 32, "the B loader's mapping assumes 8 warps, BN 128, BK 32");

struct ConvParams {
    int64_t total;        // B * OH * OW: the GEMM's N
    int64_t P;            // OH * OW
    int64_t CHW, HW;      // Ci*H*W, H*W
    int64_t K;            // Ci * KH * KW
    int W, CO, KH, KW, KHW, OW;
    int num_m;            // ceil(CO / BM)
    // k steps of 8 (between a thread's rows in a tile) and 32 (between tiles) as
    // step = a * KHW + b * KW + c with b < KH, c < KW
    int a8, b8, c8, a32, b32, c32;
    // PAD only, and last: the fields above keep the 8-byte pairing the unpadded kernel was tuned with
    // (moving them reschedules its main loop)
    int H, ph, pw;
};

// big = x rounded to tf32 (to nearest, ties away: cvt.rna's result for finite x, by an integer add and
// mask; sm_90 emulates cvt.rna.tf32 with ~4 instructions), small = x - big cut to tf32 (~2^-21 relative
// per product instead of rounding's ~2^-22; a NaN operand still reaches the result through small)
__device__ __forceinline__ void split(float x, uint32_t& big, uint32_t& small) {
    big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big)) & 0xffffe000u;
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

// One [BM][BK] tile of the weights (row stride K) into smem [BM][APITCH] (sgemm's K-major loader).
template <bool VEC>
__device__ __forceinline__ void load_a(float* s, const float* Wt, int64_t m0, int64_t M, int64_t k0, int64_t K,
                                       int tid) {
    if constexpr (VEC) {
#pragma unroll
        for (int i = 0; i < (BM * BK / 4) / NT; ++i) {
            const int c = tid + i * NT, r = c >> 3, kc = (c & 7) * 4;
            const bool ok = m0 + r < M && k0 + kc < K;   // K % 4 == 0 on this path
            cp_async<16>(s + r * APITCH + kc, ok ? Wt + (m0 + r) * K + k0 + kc : Wt, ok);
        }
    } else {
#pragma unroll 4
        for (int i = 0; i < (BM * BK) / NT; ++i) {
            const int c = tid + i * NT, r = c >> 5, kc = c & 31;
            const bool ok = m0 + r < M && k0 + kc < K;
            cp_async<4>(s + r * APITCH + kc, ok ? Wt + (m0 + r) * K + k0 + kc : Wt, ok);
        }
    }
}

// (ci, kh, kw) += step, step = a * KHW + b * KW + c with b < KH, c < KW: at most one carry each
__device__ __forceinline__ void k_advance(int& ci, int& kh, int& kw, int a, int b, int c, int KH, int KW) {
    kw += c;
    kh += b;
    ci += a;
    if (kw >= KW) { kw -= KW; ++kh; }
    if (kh >= KH) { kh -= KH; ++ci; }
}

template <class Epi, bool VEC, bool PAD>
__global__ void __launch_bounds__(NT, 1)
conv_tf32x3(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w,
            const ConvParams p, const bool vecOut, const Epi epi) {
    extern __shared__ __align__(16) float smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;   // warp tile origin: (wm * 64, wn * 32)

    // co tiles fastest: blocks sharing a pixel tile run together (the input is read from DRAM once)
    const int64_t bid = blockIdx.x;
    const int tm = (int)(bid % p.num_m);
    const int64_t tn = bid / p.num_m;
    const int64_t m0 = (int64_t)tm * BM, n0 = tn * BN;
    const int64_t K = p.K;
    const int ntiles = (int)((K + BK - 1) / BK);

    // ---- this thread's 4 im2col columns: pixels n0 + lane + 32q
    const int ph = PAD ? p.ph : 0, pw = PAD ? p.pw : 0;
    int ih0[4], iw0[4];   // top-left input coordinate of the pixel's receptive field
    int64_t poff[4];      // img*Ci*H*W + ih0*W + iw0 (the element offset of channel 0, tap (0, 0)); 0 past the end
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int64_t pg = n0 + lane + 32 * q;
        if (pg < p.total) {
            const int64_t img = pg / p.P, pix = pg - img * p.P;
            const int oh = (int)(pix / p.OW), ow = (int)(pix - (int64_t)oh * p.OW);
            ih0[q] = oh - ph;
            iw0[q] = ow - pw;
            poff[q] = img * p.CHW + (int64_t)ih0[q] * p.W + iw0[q];
        } else {
            ih0[q] = -(1 << 29);   // fails every bounds check
            iw0[q] = 0;
            poff[q] = 0;
        }
    }
    // (ci, kh, kw) of k = t*BK + warp, this thread's first row of the next tile to load
    int kci = warp / p.KHW, kkh, kkw;
    {
        const int r = warp - kci * p.KHW;
        kkh = r / p.KW;
        kkw = r - kkh * p.KW;
    }
    int64_t kcur = warp;

    auto load_b = [&](float* s) {
        int ci = kci, kh = kkh, kw = kkw;
        int64_t k = kcur;
#pragma unroll
        for (int i = 0; i < BK / 8; ++i) {
            const bool kok = k < K;   // warp-uniform
            const int64_t roff = (int64_t)ci * p.HW + (int64_t)kh * p.W + kw;
            float* srow = s + (warp + 8 * i) * BNPITCH + lane;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                bool ok = kok;
                if constexpr (PAD) {
                    const int ih = ih0[q] + kh, iw = iw0[q] + kw;
                    ok = ok && (unsigned)ih < (unsigned)p.H && (unsigned)iw < (unsigned)p.W;
                }
                cp_async<4>(srow + 32 * q, ok ? x + (poff[q] + roff) : x, ok);
            }
            k_advance(ci, kh, kw, p.a8, p.b8, p.c8, p.KH, p.KW);
            k += 8;
        }
        k_advance(kci, kkh, kkw, p.a32, p.b32, p.c32, p.KH, p.KW);
        kcur += BK;
    };
    // tiles are loaded strictly in order t = 0, 1, 2, ... (the B loader's k state advances by BK per call)
    auto load_stage = [&](int stage, int t) {
        float* s = smem + stage * STAGE_FLOATS;
        load_a<VEC>(s, w, m0, p.CO, (int64_t)t * BK, K, tid);
        load_b(s + BM * APITCH);
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

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

        const float* As = smem + (t % STAGES) * STAGE_FLOATS;
        const float* Bs = As + BM * APITCH;
#pragma unroll 1   // unrolled, the fragments of all four k8 steps stay live and spill
        for (int kk = 0; kk < BK; kk += 8) {
            uint32_t bb[4][2], bs[4][2];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int n = wn * 32 + j * 8 + g;
                split(Bs[(kk + tig) * BNPITCH + n], bb[j][0], bs[j][0]);
                split(Bs[(kk + tig + 4) * BNPITCH + n], bb[j][1], bs[j][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float* ar = As + (wm * 64 + i * 16 + g) * APITCH + kk + tig;
                const float a[4] = {ar[0], ar[8 * APITCH], ar[4], ar[8 * APITCH + 4]};
                uint32_t ab[4], as[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) split(a[r], ab[r], as[r]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
                    float tmp[4];
                    mma(tmp, as, bb[j][0], bb[j][1], zero);
                    mma(tmp, ab, bs[j][0], bs[j][1], tmp);
                    mma(tmp, ab, bb[j][0], bb[j][1], tmp);
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[i][j][r] += tmp[r];
                }
            }
        }
    }
    cp_wait<0>();

    // ---- epilogue: fragment (i, j, r) is co m0 + wm*64 + i*16 + g + 8*(r/2),
    //      pixel n0 + wn*32 + j*8 + 2*tig + r%2 -> y[img][co][pix]
    int64_t coff[4][2];   // img*CO*P + pix
    bool cok[4][2];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int64_t pg = n0 + wn * 32 + j * 8 + 2 * tig + e;
            cok[j][e] = pg < p.total;
            const int64_t img = cok[j][e] ? pg / p.P : 0;
            coff[j][e] = img * p.CO * p.P + (pg - img * p.P);
        }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t co = m0 + wm * 64 + i * 16 + g + 8 * h;
            if (co >= p.CO) continue;
            const typename Epi::Row rw = epi.row((int)co);
            float* orow = y + co * p.P;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float v0 = epi.apply(acc[i][j][2 * h], rw), v1 = epi.apply(acc[i][j][2 * h + 1], rw);
                // vecOut: P even and y 8-byte aligned, so an even pixel pair lies in one image
                if (vecOut && cok[j][1]) {
                    *reinterpret_cast<float2*>(orow + coff[j][0]) = make_float2(v0, v1);
                } else {
                    if (cok[j][0]) orow[coff[j][0]] = v0;
                    if (cok[j][1]) orow[coff[j][1]] = v1;
                }
            }
        }
}

inline void k_decompose(int step, int KHW, int KW, int& a, int& b, int& c) {
    a = step / KHW;
    const int r = step % KHW;
    b = r / KW;
    c = r % KW;
}

template <bool PAD, class Epi>
inline void launch_impl(float* y, const float* x, const float* w, int64_t Bn, int64_t Ci, int64_t H, int64_t W,
                        int64_t Co, int64_t KH, int64_t KW, int64_t ph, int64_t pw, const Epi& epi,
                        cudaStream_t stream) {
    const int64_t OH = H + 2 * ph - KH + 1, OW = W + 2 * pw - KW + 1;
    if (Bn <= 0 || Co <= 0 || OH <= 0 || OW <= 0 || Ci < 0 || KH <= 0 || KW <= 0) return;

    ConvParams p;
    p.P = OH * OW;
    p.total = Bn * p.P;
    p.HW = H * W;
    p.CHW = Ci * p.HW;
    p.K = Ci * KH * KW;
    p.H = (int)H;
    p.W = (int)W;
    p.CO = (int)Co;
    p.KH = (int)KH;
    p.KW = (int)KW;
    p.KHW = (int)(KH * KW);
    p.OW = (int)OW;
    p.ph = (int)ph;
    p.pw = (int)pw;
    p.num_m = (int)((Co + BM - 1) / BM);
    k_decompose(8, p.KHW, p.KW, p.a8, p.b8, p.c8);
    k_decompose(BK, p.KHW, p.KW, p.a32, p.b32, p.c32);

    const int64_t num_n = (p.total + BN - 1) / BN;
    const dim3 grid((unsigned)(num_n * p.num_m));
    const bool vec = p.K % 4 == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0;
    const bool vecOut = p.P % 2 == 0 && (reinterpret_cast<uintptr_t>(y) & 7) == 0;
    auto* kernel = vec ? conv_tf32x3<Epi, true, PAD> : conv_tf32x3<Epi, false, PAD>;
    // every launch, not once through a function-local static: such statics are process-wide
    // (STB_GNU_UNIQUE) across libraries, so a second library would skip its own opt-in
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    kernel<<<grid, NT, SMEM_BYTES, stream>>>(y, x, w, p, vecOut, epi);
}

// y[Bn][Co][H+2ph-KH+1][W+2pw-KW+1] = epi(conv2d(x[Bn][Ci][H][W], w[Co][Ci][KH][KW], zero padding ph, pw)),
// all on `stream`
template <class Epi>
inline void launch(float* y, const float* x, const float* w, int64_t Bn, int64_t Ci, int64_t H, int64_t W,
                   int64_t Co, int64_t KH, int64_t KW, int64_t ph, int64_t pw, const Epi& epi,
                   cudaStream_t stream) {
    launch_impl<true>(y, x, w, Bn, Ci, H, W, Co, KH, KW, ph, pw, epi, stream);
}

// the same without padding: y[Bn][Co][H-KH+1][W-KW+1], through the kernel without the taps' bounds checks
template <class Epi>
inline void launch(float* y, const float* x, const float* w, int64_t Bn, int64_t Ci, int64_t H, int64_t W,
                   int64_t Co, int64_t KH, int64_t KW, const Epi& epi, cudaStream_t stream) {
    launch_impl<false>(y, x, w, Bn, Ci, H, W, Co, KH, KW, 0, 0, epi, stream);
}

}  // namespace cv
