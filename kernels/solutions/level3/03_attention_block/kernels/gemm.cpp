// Blocked SGEMM: packed A (MR-row panels) and B (NR-column panels), 8x32 AVX-512 micro-kernel,
// fused bias / activation / residual epilogue on the last K block.
#include "gemm_epi.h"
#include "vmath16.h"
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <omp.h>

namespace {
constexpr int64_t MR = 12, NR = 32, KC = 256, MC = 144, NC = 512;

struct Buffers {
    float* a = (float*)std::aligned_alloc(64, MC * KC * sizeof(float));
    float* b = (float*)std::aligned_alloc(64, NC * KC * sizeof(float));
    ~Buffers() { std::free(a); std::free(b); }
};
thread_local Buffers buf;

// dst[k * ldd + r] = src[r * lds + k] for r < rows, k < kc (a transposed copy of a row block),
// lanes r in [rows, width) are zero-filled.
void pack_t(const float* src, int64_t lds, int64_t rows, int64_t kc, float* dst, int64_t ldd, int64_t width) {
#ifdef __AVX512F__
    const __mmask16 store_mask = (__mmask16)((1u << width) - 1);
    for (int64_t k0 = 0; k0 < kc; k0 += 16) {
        int64_t kn = std::min<int64_t>(16, kc - k0);
        const __mmask16 load_mask = (__mmask16)((1u << kn) - 1);
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i)
            r[i] = i < rows ? _mm512_maskz_loadu_ps(load_mask, src + i * lds + k0) : _mm512_setzero_ps();
        for (int i = 0; i < 16; i += 2) {
            t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4) {
            r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
            r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
            r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
            r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        for (int h = 0; h < 16; h += 8)
            for (int i = 0; i < 4; ++i) {
                t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
                t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
            }
        for (int i = 0; i < 8; ++i) {
            r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
            r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        }
        for (int k = 0; k < kn; ++k) _mm512_mask_storeu_ps(dst + (k0 + k) * ldd, store_mask, r[k]);
    }
#else
    for (int64_t k = 0; k < kc; ++k)
        for (int64_t r = 0; r < width; ++r) dst[k * ldd + r] = r < rows ? src[r * lds + k] : 0.f;
#endif
}

void pack_a(const float* A, int64_t lda, int64_t mc, int64_t kc, float* Ap) {
    for (int64_t i0 = 0; i0 < mc; i0 += MR, Ap += MR * kc)
        pack_t(A + i0 * lda, lda, std::min(MR, mc - i0), kc, Ap, MR, MR);
}

void pack_b(const float* B, int64_t ldb, bool trans, int64_t nc, int64_t kc, float* Bp) {
    for (int64_t j0 = 0; j0 < nc; j0 += NR, Bp += NR * kc) {
        int64_t nr = std::min(NR, nc - j0);
        if (trans) {
            for (int64_t h = 0; h < NR; h += 16)
                pack_t(B + (j0 + h) * ldb, ldb, std::max<int64_t>(0, std::min<int64_t>(16, nr - h)), kc,
                       Bp + h, NR, 16);
        } else {
            for (int64_t k = 0; k < kc; ++k) {
                const float* b = B + k * ldb + j0;
                std::memcpy(Bp + k * NR, b, nr * sizeof(float));
                if (nr < NR) std::memset(Bp + k * NR + nr, 0, (NR - nr) * sizeof(float));
            }
        }
    }
}

inline void ukernel(int64_t kc, const float* __restrict A, const float* __restrict B, float* __restrict T) {
    v16 c[MR][2] = {};
    for (int64_t k = 0; k < kc; ++k, A += MR, B += NR) {
        v16 b0 = vload(B), b1 = vload(B + 16);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            v16 a = vbcast(A[i]);
            c[i][0] = vfma(a, b0, c[i][0]);
            c[i][1] = vfma(a, b1, c[i][1]);
        }
    }
    for (int i = 0; i < MR; ++i) { vstore(T + i * NR, c[i][0]); vstore(T + i * NR + 16, c[i][1]); }
}

inline v16 finish(v16 v, const Epilogue& e, int64_t m, int64_t n) {
    v = v * e.alpha;
    if (e.bias_mode == BIAS_COL) v += vload(e.bias + n);
    else if (e.bias_mode == BIAS_ROW) v += e.bias[m];
    if (e.act == ACT_RELU) v = vmax(v, v16{});
    else if (e.act == ACT_GELU) v = vgelu(v);
    if (e.res) v += vload(e.res + m * e.ldr + n);
    return v;
}

inline float finish(float v, const Epilogue& e, int64_t m, int64_t n) {
    v = v * e.alpha;
    if (e.bias_mode == BIAS_COL) v += e.bias[n];
    else if (e.bias_mode == BIAS_ROW) v += e.bias[m];
    if (e.act == ACT_RELU) v = v > 0.f ? v : 0.f;
    else if (e.act == ACT_GELU) v = sgelu(v);
    if (e.res) v += e.res[m * e.ldr + n];
    return v;
}

// Writes an MR x NR accumulator tile T into C at (m, n); first/last: position in the K loop.
void store_tile(const float* T, float* C, int64_t ldc, int64_t m, int64_t n, int64_t mr, int64_t nr,
                bool first, bool last, const Epilogue& e) {
    for (int64_t i = 0; i < mr; ++i) {
        const float* t = T + i * NR;
        float* c = C + (m + i) * ldc + n;
        if (nr == NR) {
            for (int h = 0; h < 2; ++h) {
                v16 v = vload(t + 16 * h);
                if (!first) v += vload(c + 16 * h);
                if (last) v = finish(v, e, m + i, n + 16 * h);
                vstore(c + 16 * h, v);
            }
        } else {
            for (int64_t j = 0; j < nr; ++j) {
                float v = t[j];
                if (!first) v += c[j];
                c[j] = last ? finish(v, e, m + i, n + j) : v;
            }
        }
    }
}

inline int64_t balanced(int64_t total, int64_t cap) {
    int64_t parts = (total + cap - 1) / cap;
    return (total + parts - 1) / parts;
}
}  // namespace

void gemm_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, bool b_trans, float* C, int64_t ldc, const Epilogue& e) {
    alignas(64) float T[MR * NR];
    const int64_t kcb = balanced(K, KC), mcb = (balanced(M, MC) + MR - 1) / MR * MR;
    for (int64_t n0 = 0; n0 < N; n0 += NC) {
        int64_t nc = std::min(NC, N - n0);
        for (int64_t k0 = 0; k0 < K; k0 += kcb) {
            int64_t kc = std::min(kcb, K - k0);
            bool first = k0 == 0, last = k0 + kc >= K;
            pack_b(b_trans ? B + n0 * ldb + k0 : B + k0 * ldb + n0, ldb, b_trans, nc, kc, buf.b);
            for (int64_t m0 = 0; m0 < M; m0 += mcb) {
                int64_t mc = std::min(mcb, M - m0);
                pack_a(A + m0 * lda + k0, lda, mc, kc, buf.a);
                for (int64_t j = 0; j < nc; j += NR)
                    for (int64_t i = 0; i < mc; i += MR) {
                        ukernel(kc, buf.a + i * kc, buf.b + j * kc, T);
                        store_tile(T, C, ldc, m0 + i, n0 + j, std::min(MR, mc - i), std::min(NR, nc - j),
                                   first, last, e);
                    }
            }
        }
    }
}

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, bool b_trans, float* C, int64_t ldc, const Epilogue& e) {
    const int64_t nt = omp_get_max_threads();
    // Tiles: full N blocks split until there are 2 per thread, then rows split for the rest;
    // each tile keeps its packed B block across its row blocks.
    int64_t tn = NC, gm = 1;
    auto gn = [&] { return (N + tn - 1) / tn; };
    while (gn() < 2 * nt && tn > 2 * NR) tn /= 2;
    if (gn() < 2 * nt) gm = std::min((M + MR - 1) / MR, (2 * nt + gn() - 1) / gn());
    const int64_t tm = ((M + gm - 1) / gm + MR - 1) / MR * MR;
    gm = (M + tm - 1) / tm;
    const int64_t count = gm * gn();
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
    for (int64_t t = 0; t < count; ++t) {
        int64_t m0 = (t / gn()) * tm, n0 = (t % gn()) * tn;
        Epilogue s = e;
        if (s.bias_mode == BIAS_COL) s.bias += n0;
        if (s.bias_mode == BIAS_ROW) s.bias += m0;
        if (s.res) s.res += m0 * s.ldr + n0;
        gemm_serial(std::min(tm, M - m0), std::min(tn, N - n0), K, A + m0 * lda, lda,
                    b_trans ? B + n0 * ldb : B + n0, ldb, b_trans, C + m0 * ldc + n0, ldc, s);
    }
}

// out[M,N] = act(x[M,K] @ w[N,K]^T + b)
extern "C" void linear(float* out, const float* x, const float* w, const float* b,
                       int64_t M, int64_t K, int64_t N, int64_t act) {
    Epilogue e;
    e.bias = b; e.bias_mode = BIAS_COL; e.act = (int)act;
    gemm(M, N, K, x, K, w, K, true, out, N, e);
}
