// Pre-norm transformer block on the GPU, fp32-accurate throughout:
//   layernorm            one block per row, the row held in registers (level1/06's kernel)
//   linear               wgmma.cuh's 3xTF32 GEMM with bias (+ exact GELU) fused in the epilogue (qkv, fc1)
//   linear_residual      the same GEMM with bias + residual fused (proj, fc2)
//   attention            a fused flash-attention forward (online softmax, scores never leave the SM) on the
//                        tensor cores with the 3xTF32 scheme of conv.cuh / wgmma.cuh (mma.sync m16n8k8 tf32);
//                        head dim 64. Other head dims take a plain fp32 kernel (one warp per query row).
#include "wgmma.cuh"

#include <cmath>
#include <cstdint>

namespace {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
inline bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

// ------------------------------------------------------------------------------------------------ LayerNorm
// out[r] = (x[r] - mean) * rstd * w + b over rows of `cols` floats (biased variance). One block per row, the
// row in registers (NT threads x NV float4): one read and one write per element. Scalar fallback otherwise.
template <int NT>
__device__ __forceinline__ float block_sum(float v, float* sh) {   // sh: NT / 32 floats, one array per call site
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) s += sh[w];
    return s;
}

template <int NT, int NV>
__global__ void __launch_bounds__(NT) ln_reg(float* __restrict__ out, const float* __restrict__ x,
                                             const float* __restrict__ w, const float* __restrict__ b, float eps,
                                             int64_t cols) {
    __shared__ float sh_a[NT / 32], sh_b[NT / 32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * cols;
    float* orow = out + row * cols;
    const int nv4 = (int)(cols >> 2);
    float4 v[NV];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int idx = threadIdx.x + i * NT;
        v[i] = idx < nv4 ? *reinterpret_cast<const float4*>(xr + 4 * (int64_t)idx) : make_float4(0.f, 0.f, 0.f, 0.f);
        s += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    }
    const float mean = block_sum<NT>(s, sh_a) / (float)cols;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int idx = threadIdx.x + i * NT;
        if (idx < nv4) {
            v[i].x -= mean; v[i].y -= mean; v[i].z -= mean; v[i].w -= mean;
            q += (v[i].x * v[i].x + v[i].y * v[i].y) + (v[i].z * v[i].z + v[i].w * v[i].w);
        }
    }
    const float rstd = rsqrtf(block_sum<NT>(q, sh_b) / (float)cols + eps);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int idx = threadIdx.x + i * NT;
        if (idx < nv4) {
            const float4 wv = __ldg(reinterpret_cast<const float4*>(w) + idx);
            const float4 bv = __ldg(reinterpret_cast<const float4*>(b) + idx);
            *reinterpret_cast<float4*>(orow + 4 * (int64_t)idx) =
                make_float4(v[i].x * rstd * wv.x + bv.x, v[i].y * rstd * wv.y + bv.y, v[i].z * rstd * wv.z + bv.z,
                            v[i].w * rstd * wv.w + bv.w);
        }
    }
}

constexpr int LN_FB = 256;
__global__ void __launch_bounds__(LN_FB) ln_fallback(float* __restrict__ out, const float* __restrict__ x,
                                                     const float* __restrict__ w, const float* __restrict__ b,
                                                     float eps, int64_t cols) {
    __shared__ float sh_a[LN_FB / 32], sh_b[LN_FB / 32];
    const int64_t row = blockIdx.x;
    const float* xr = x + row * cols;
    float* orow = out + row * cols;
    float s = 0.f;
    for (int64_t i = threadIdx.x; i < cols; i += LN_FB) s += xr[i];
    const float mean = block_sum<LN_FB>(s, sh_a) / (float)cols;
    float q = 0.f;
    for (int64_t i = threadIdx.x; i < cols; i += LN_FB) {
        const float d = xr[i] - mean;
        q += d * d;
    }
    const float rstd = rsqrtf(block_sum<LN_FB>(q, sh_b) / (float)cols + eps);
    for (int64_t i = threadIdx.x; i < cols; i += LN_FB) orow[i] = (xr[i] - mean) * rstd * w[i] + b[i];
}

// ------------------------------------------------------------------------------------------------ attention
// qkv: [B][T][3][H][64] (the qkv projection's rows); out: [B][T][H][64]. Block: 64 query rows of one (b, h),
// 4 warps of 16 rows each; K and V tiles of 64 keys through a 2-stage cp.async ring.
// Per warp and 64-key tile: S (16 x 64) = Q K^T and O (16 x 64) += P V, each as 8 x 8 k8 steps of
// mma.m16n8k8 tf32, three products per step (a_small*b_big + a_big*b_small + a_big*b_big, operands split
// as in conv.cuh) into a zeroed temporary then added to fp32 registers (the tensor cores' own accumulation
// truncates). Q is scaled by scale * log2(e) before it is split, so the softmax runs on exp2.
// P goes from S's accumulator fragment to PV's A fragment without a shuffle: in k step j, slot t of the
// A fragment (and row t of the B fragment) is key 8j + 2t and slot t + 4 is key 8j + 2t + 1, the two
// columns a thread already holds; V's B fragment reads the same keys.
constexpr int FA_HD = 64, FA_BQ = 64, FA_BKV = 64, FA_NT = 128;
constexpr int FA_PITCH = FA_HD + 4;                  // floats per smem row: fragment reads hit 32 banks
constexpr int FA_TILE = FA_BKV * FA_PITCH;           // floats of one K or V tile
constexpr int FA_SMEM = 4 * FA_TILE * 4;             // bytes: (K, V) x 2 stages; Q is staged in stage 1 first
static_assert(FA_BQ == 16 * (FA_NT / 32), "16 query rows per warp");

// big = x rounded to tf32 (integer add and mask), small = x - big cut to tf32 (conv.cuh's split)
__device__ __forceinline__ void split(float x, uint32_t& big, uint32_t& small) {
    big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big)) & 0xffffe000u;
}

// PTX wrappers
// d = a * b + c (m16n8k8, tf32 operands, fp32 accumulators)
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                    const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}
// 16-byte cp.async global -> shared; !valid zero-fills
__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int n>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(n));
}
// end of PTX wrappers

// rows t0 ... t0 + 63 (zero past T) of one 64-float head slice (column col0) of qkv into s[64][FA_PITCH]
__device__ __forceinline__ void fa_load_tile(float* s, const float* qkv, int64_t rowbase, int t0, int T, int64_t ld,
                                             int64_t col0, int tid) {
#pragma unroll
    for (int i = 0; i < FA_BKV * FA_HD / 4 / FA_NT; ++i) {
        const int c = tid + i * FA_NT, r = c >> 4, c4 = (c & 15) * 4;
        const bool ok = t0 + r < T;
        cp_async16(s + r * FA_PITCH + c4, qkv + (rowbase + (ok ? t0 + r : 0)) * ld + col0 + c4, ok);
    }
}

// grid (ceil(T / 64), B * H), FA_NT threads, FA_SMEM bytes of dynamic shared memory. qscale = scale * log2(e).
__global__ void __launch_bounds__(FA_NT, 2)
flash_attn64(float* __restrict__ out, const float* __restrict__ qkv, int T, int H, float qscale) {
    extern __shared__ __align__(16) float fa_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int q0 = blockIdx.x * FA_BQ, b = blockIdx.y / H, h = blockIdx.y - b * H;
    const int64_t D = (int64_t)H * FA_HD, ld = 3 * D, rowbase = (int64_t)b * T;
    const int64_t qcol = (int64_t)h * FA_HD, kcol = D + qcol, vcol = 2 * D + qcol;
    const int nkv = (T + FA_BKV - 1) / FA_BKV;

    // prologue: Q into stage 1's K slot, K / V tile 0 into stage 0
    fa_load_tile(fa_smem + 2 * FA_TILE, qkv, rowbase, q0, T, ld, qcol, tid);
    fa_load_tile(fa_smem, qkv, rowbase, 0, T, ld, kcol, tid);
    fa_load_tile(fa_smem + FA_TILE, qkv, rowbase, 0, T, ld, vcol, tid);
    cp_commit();
    cp_wait<0>();
    __syncthreads();

    // this warp's Q rows as A fragments, scaled and split: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
    uint32_t qb[8][4], qs[8][4];
    {
        const float* qr = fa_smem + 2 * FA_TILE + (warp * 16 + g) * FA_PITCH + t;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float a[4] = {qr[8 * k], qr[8 * FA_PITCH + 8 * k], qr[8 * k + 4], qr[8 * FA_PITCH + 8 * k + 4]};
#pragma unroll
            for (int r = 0; r < 4; ++r) split(a[r] * qscale, qb[k][r], qs[k][r]);
        }
    }
    __syncthreads();   // stage 1 is free for tile 1

    // O fragments: o[n][0..1] row g, columns 8n + 2t, +1; o[n][2..3] row g + 8
    float o[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) o[n][r] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;   // rows g, g + 8: running max (log2 units), sum
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};

    for (int j = 0; j < nkv; ++j) {
        if (j + 1 < nkv) {
            float* nb = fa_smem + ((j + 1) & 1) * 2 * FA_TILE;
            fa_load_tile(nb, qkv, rowbase, (j + 1) * FA_BKV, T, ld, kcol, tid);
            fa_load_tile(nb + FA_TILE, qkv, rowbase, (j + 1) * FA_BKV, T, ld, vcol, tid);
        }
        cp_commit();
        cp_wait<1>();      // tile j has landed (only tile j + 1's group may still be in flight)
        __syncthreads();
        const float* Ks = fa_smem + (j & 1) * 2 * FA_TILE;
        const float* Vs = Ks + FA_TILE;

        // ---- S = Q K^T: s[n] is keys 8n ... 8n + 7 (c0, c1: row g, keys 8n + 2t, +1; c2, c3: row g + 8)
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int r = 0; r < 4; ++r) s[n][r] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k)
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                // B fragment: b0 = K[key 8n + g][dim 8k + t], b1 = K[8n + g][8k + t + 4]
                const float* kr = Ks + (8 * n + g) * FA_PITCH + 8 * k + t;
                uint32_t bb0, bs0, bb1, bs1;
                split(kr[0], bb0, bs0);
                split(kr[4], bb1, bs1);
                float tmp[4];
                mma(tmp, qs[k], bb0, bb1, zero);
                mma(tmp, qb[k], bs0, bs1, tmp);
                mma(tmp, qb[k], bb0, bb1, tmp);
#pragma unroll
                for (int r = 0; r < 4; ++r) s[n][r] += tmp[r];
            }

        // ---- online softmax (rows g and g + 8; a row's 64 keys are spread over the 4 lanes of a quad)
        const int kv0 = j * FA_BKV;
        if (kv0 + FA_BKV > T) {
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (kv0 + 8 * n + 2 * t + e >= T) s[n][e] = s[n][2 + e] = -INFINITY;
        }
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        // key kv0 < T is in every tile, so mx is finite; the first tile's correction is exp2(-inf) = 0
        const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            s[n][0] = exp2f(s[n][0] - mx0);
            s[n][1] = exp2f(s[n][1] - mx0);
            s[n][2] = exp2f(s[n][2] - mx1);
            s[n][3] = exp2f(s[n][3] - mx1);
            ls0 += s[n][0] + s[n][1];
            ls1 += s[n][2] + s[n][3];
        }
        l0 = l0 * c0 + ls0;   // this lane's share; the quad's shares are summed at the end
        l1 = l1 * c1 + ls1;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }

        // ---- O += P V: k step kk covers keys 8kk ... 8kk + 7 (slot t: key 8kk + 2t, slot t + 4: key 8kk + 2t + 1)
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            uint32_t pb[4], ps[4];
            split(s[kk][0], pb[0], ps[0]);   // a0: row g, slot t
            split(s[kk][2], pb[1], ps[1]);   // a1: row g + 8, slot t
            split(s[kk][1], pb[2], ps[2]);   // a2: row g, slot t + 4
            split(s[kk][3], pb[3], ps[3]);   // a3: row g + 8, slot t + 4
            const float* vr = Vs + (8 * kk + 2 * t) * FA_PITCH + g;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                // B fragment: b0 = V[key 8kk + 2t][dim 8n + g], b1 = V[key 8kk + 2t + 1][dim 8n + g]
                uint32_t bb0, bs0, bb1, bs1;
                split(vr[8 * n], bb0, bs0);
                split(vr[FA_PITCH + 8 * n], bb1, bs1);
                float tmp[4];
                mma(tmp, ps, bb0, bb1, zero);
                mma(tmp, pb, bs0, bs1, tmp);
                mma(tmp, pb, bb0, bb1, tmp);
#pragma unroll
                for (int r = 0; r < 4; ++r) o[n][r] += tmp[r];
            }
        }
        __syncthreads();   // stage j & 1 is read by all before tile j + 2 overwrites it
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = 1.f / l0, i1 = 1.f / l1;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int64_t col = qcol + 8 * n + 2 * t;
        if (r0 < T) *reinterpret_cast<float2*>(out + (rowbase + r0) * D + col) = make_float2(o[n][0] * i0, o[n][1] * i0);
        if (r1 < T) *reinterpret_cast<float2*>(out + (rowbase + r1) * D + col) = make_float2(o[n][2] * i1, o[n][3] * i1);
    }
}

// Any head dim up to 256: one warp per (b, t, h) query row, fp32 on the CUDA cores, online softmax over the keys.
constexpr int AR_NT = 256, AR_MAXD = 8;   // dims per lane: hd <= 32 * AR_MAXD
__global__ void __launch_bounds__(AR_NT) attn_rows(float* __restrict__ out, const float* __restrict__ qkv, int64_t B,
                                                   int64_t T, int64_t H, int64_t hd, float scale) {
    const int64_t wid = ((int64_t)blockIdx.x * AR_NT + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (wid >= B * T * H) return;   // warp-uniform
    const int64_t h = wid % H, bt = wid / H, b = bt / T;
    const int64_t D = H * hd, ld = 3 * D;
    const float* q = qkv + bt * ld + h * hd;
    const float* kb = qkv + b * T * ld + D + h * hd;
    float qr[AR_MAXD], o[AR_MAXD];
#pragma unroll
    for (int i = 0; i < AR_MAXD; ++i) {
        const int64_t d = lane + 32 * i;
        qr[i] = d < hd ? q[d] * scale : 0.f;
        o[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int64_t k = 0; k < T; ++k) {
        const float* kr = kb + k * ld;
        const float* vr = kr + D;
        float sp = 0.f;
#pragma unroll
        for (int i = 0; i < AR_MAXD; ++i) {
            const int64_t d = lane + 32 * i;
            if (d < hd) sp += qr[i] * kr[d];
        }
        sp = warp_sum(sp);
        const float mn = fmaxf(m, sp), c = __expf(m - mn), p = __expf(sp - mn);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < AR_MAXD; ++i) {
            const int64_t d = lane + 32 * i;
            o[i] = o[i] * c + (d < hd ? p * vr[d] : 0.f);
        }
        m = mn;
    }
    const float inv = 1.f / l;
    float* orow = out + bt * D + h * hd;
#pragma unroll
    for (int i = 0; i < AR_MAXD; ++i) {
        const int64_t d = lane + 32 * i;
        if (d < hd) orow[d] = o[i] * inv;
    }
}

// ------------------------------------------------------------------------------------------------ GEMM epilogues
// wg::launch calls apply() for rows past M too (its stores skip them): the residual read is guarded.
struct EpiBias {
    float* C;
    const float* bias;
    int gelu;
    __device__ float apply(float acc, int64_t, int64_t col) const {
        const float v = acc + __ldg(bias + col);
        return gelu ? 0.5f * v * (1.f + erff(v * 0.70710678118654752f)) : v;
    }
};
struct EpiBiasResidual {
    float* C;
    const float* bias;
    const float* res;   // [M][N]
    int64_t M, N;
    __device__ float apply(float acc, int64_t row, int64_t col) const {
        return acc + __ldg(bias + col) + (row < M ? __ldg(res + row * N + col) : 0.f);
    }
};

}  // namespace

// ------------------------------------------------------------------------------------------------ entry points
extern "C" void layernorm(float* out, const float* x, const float* w, const float* b, int64_t rows, int64_t cols,
                          double eps_d, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) return;
    const float eps = (float)eps_d;
    const int64_t nv4 = cols / 4;
    if (cols % 4 == 0 && aligned(x, 16) && aligned(out, 16) && aligned(w, 16) && aligned(b, 16)) {
        if (nv4 <= 128) { ln_reg<128, 1><<<(unsigned)rows, 128, 0, stream>>>(out, x, w, b, eps, cols); return; }
        if (nv4 <= 256) { ln_reg<128, 2><<<(unsigned)rows, 128, 0, stream>>>(out, x, w, b, eps, cols); return; }
        if (nv4 <= 512) { ln_reg<128, 4><<<(unsigned)rows, 128, 0, stream>>>(out, x, w, b, eps, cols); return; }
        if (nv4 <= 1024) { ln_reg<256, 4><<<(unsigned)rows, 256, 0, stream>>>(out, x, w, b, eps, cols); return; }
        if (nv4 <= 2048) { ln_reg<512, 4><<<(unsigned)rows, 512, 0, stream>>>(out, x, w, b, eps, cols); return; }
    }
    ln_fallback<<<(unsigned)rows, LN_FB, 0, stream>>>(out, x, w, b, eps, cols);
}

// out[M][N] = act(x[M][K] w[N][K]^T + b), act 0: none, 2: GELU (erf). ws: wg::workspace_bytes(M, N, K, 1, x)
// bytes of device memory (model_new.py sizes it).
extern "C" void linear(float* out, const float* x, const float* w, const float* b, float* ws, int64_t M, int64_t K,
                       int64_t N, int64_t act, cudaStream_t stream) {
    EpiBias e;
    e.C = out; e.bias = b; e.gelu = act == 2;
    wg::launch(x, w, M, N, K, e, stream, ws);
}

// out[M][N] = x[M][K] w[N][K]^T + b + res[M][N]
extern "C" void linear_residual(float* out, const float* x, const float* w, const float* b, const float* res,
                                float* ws, int64_t M, int64_t K, int64_t N, cudaStream_t stream) {
    EpiBiasResidual e;
    e.C = out; e.bias = b; e.res = res; e.M = M; e.N = N;
    wg::launch(x, w, M, N, K, e, stream, ws);
}

// out[B][T][H * hd] = softmax(q k^T * scale) v per (b, h), q / k / v the three [B][T][H][hd] slices of
// qkv[B][T][3][H][hd]
extern "C" void attention(float* out, const float* qkv, int64_t B, int64_t T, int64_t H, int64_t hd, double scale,
                          cudaStream_t stream) {
    if (B <= 0 || T <= 0 || H <= 0 || hd <= 0) return;
    if (hd == FA_HD && aligned(qkv, 16) && aligned(out, 8) && T < (1LL << 30) && B * H <= 65535) {
        cudaFuncSetAttribute(flash_attn64, cudaFuncAttributeMaxDynamicSharedMemorySize, FA_SMEM);
        const dim3 grid((unsigned)((T + FA_BQ - 1) / FA_BQ), (unsigned)(B * H));
        flash_attn64<<<grid, FA_NT, FA_SMEM, stream>>>(out, qkv, (int)T, (int)H,
                                                       (float)(scale * 1.4426950408889634));
        return;
    }
    if (hd > 32 * AR_MAXD) {
        std::fprintf(stderr, "attention: head dim %lld > %d is not supported\n", (long long)hd, 32 * AR_MAXD);
        std::abort();
    }
    const int64_t threads = B * T * H * 32;
    attn_rows<<<(unsigned)((threads + AR_NT - 1) / AR_NT), AR_NT, 0, stream>>>(out, qkv, B, T, H, hd, (float)scale);
}
