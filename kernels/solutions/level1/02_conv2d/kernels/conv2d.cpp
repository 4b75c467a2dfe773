// Direct stride-1 convolution, NCHW. Tile: 8 output channels x 2 output rows x 16 output columns
// (16 zmm accumulators); the input is copied once into a zero-padded buffer and the weights are
// repacked as [co/8][ci][kh][kw][8] so the 8 channel weights of a tap are contiguous broadcasts.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <immintrin.h>

// Persistent aligned scratch (fresh allocations would page-fault on every call).
static float* scratch(int slot, int64_t n) {
    static float* buf[2] = {};
    static int64_t cap[2] = {};
    if (cap[slot] < n) {
        std::free(buf[slot]);
        buf[slot] = static_cast<float*>(std::aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
        cap[slot] = n;
    }
    return buf[slot];
}

extern "C" void conv2d(float* out, const float* x, const float* w, const float* bias,
                       int64_t N, int64_t C, int64_t H, int64_t W, int64_t CO, int64_t KH, int64_t KW,
                       int64_t ph, int64_t pw) {
    const int64_t OH = H + 2 * ph - KH + 1, OW = W + 2 * pw - KW + 1;
    const int64_t Hp = H + 2 * ph, Wp = W + 2 * pw;
    constexpr int64_t CB = 8;
    const int64_t ncb = (CO + CB - 1) / CB;
    float* xp = scratch(0, N * C * Hp * Wp);
    float* wp = scratch(1, ncb * C * KH * KW * CB);
    #pragma omp parallel
    {
        #pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < N * C; ++p) {
            float* d = xp + p * Hp * Wp;
            const float* s = x + p * H * W;
            std::memset(d, 0, ph * Wp * sizeof(float));
            std::memset(d + (ph + H) * Wp, 0, ph * Wp * sizeof(float));
            for (int64_t i = 0; i < H; ++i) {
                float* r = d + (ph + i) * Wp;
                for (int64_t j = 0; j < pw; ++j) { r[j] = 0.f; r[pw + W + j] = 0.f; }
                std::memcpy(r + pw, s + i * W, W * sizeof(float));
            }
        }
        #pragma omp for schedule(static)
        for (int64_t cb = 0; cb < ncb; ++cb)
            for (int64_t ci = 0; ci < C; ++ci)
                for (int64_t t = 0; t < KH * KW; ++t)
                    for (int64_t c = 0; c < CB; ++c) {
                        const int64_t co = cb * CB + c;
                        wp[((cb * C + ci) * KH * KW + t) * CB + c] = co < CO ? w[(co * C + ci) * KH * KW + t] : 0.f;
                    }
        const int64_t nrp = (OH + 1) / 2;
        #pragma omp for collapse(3) schedule(static)
        for (int64_t n = 0; n < N; ++n)
            for (int64_t cb = 0; cb < ncb; ++cb)
                for (int64_t rp = 0; rp < nrp; ++rp) {
                    const int64_t oh = rp * 2;
                    const bool two = oh + 1 < OH;
                    const int64_t nco = std::min(CB, CO - cb * CB);
                    for (int64_t ow0 = 0; ow0 < OW; ow0 += 16) {
                        const int64_t nw = std::min<int64_t>(16, OW - ow0);
#ifdef __AVX512F__
                        const __mmask16 m = (__mmask16)((1u << nw) - 1);
                        __m512 a0[CB], a1[CB];
#pragma GCC unroll 8
                        for (int64_t c = 0; c < CB; ++c) {
                            a0[c] = _mm512_set1_ps(c < nco ? bias[cb * CB + c] : 0.f);
                            a1[c] = a0[c];
                        }
                        for (int64_t ci = 0; ci < C; ++ci) {
                            const float* xr = xp + ((n * C + ci) * Hp + oh) * Wp + ow0;
                            const float* wr = wp + (cb * C + ci) * KH * KW * CB;
                            for (int64_t kh = 0; kh < KH; ++kh)
                                for (int64_t kw = 0; kw < KW; ++kw) {
                                    const __m512 x0 = _mm512_maskz_loadu_ps(m, xr + kh * Wp + kw);
                                    const __m512 x1 = _mm512_maskz_loadu_ps(two ? m : 0, xr + (kh + 1) * Wp + kw);
                                    const float* wt = wr + (kh * KW + kw) * CB;
#pragma GCC unroll 8
                                    for (int64_t c = 0; c < CB; ++c) {
                                        const __m512 wv = _mm512_set1_ps(wt[c]);
                                        a0[c] = _mm512_fmadd_ps(wv, x0, a0[c]);
                                        a1[c] = _mm512_fmadd_ps(wv, x1, a1[c]);
                                    }
                                }
                        }
#pragma GCC unroll 8
                        for (int64_t c = 0; c < CB; ++c) {  // constant trip count keeps a0/a1 in registers
                            if (c >= nco) break;
                            float* o = out + ((n * CO + cb * CB + c) * OH + oh) * OW + ow0;
                            _mm512_mask_storeu_ps(o, m, a0[c]);
                            if (two) _mm512_mask_storeu_ps(o + OW, m, a1[c]);
                        }
#else
                        for (int64_t c = 0; c < nco; ++c)
                            for (int64_t r = 0; r < (two ? 2 : 1); ++r)
                                for (int64_t j = 0; j < nw; ++j) {
                                    float s = bias[cb * CB + c];
                                    for (int64_t ci = 0; ci < C; ++ci)
                                        for (int64_t kh = 0; kh < KH; ++kh)
                                            for (int64_t kw = 0; kw < KW; ++kw)
                                                s += wp[((cb * C + ci) * KH * KW + kh * KW + kw) * CB + c] *
                                                     xp[((n * C + ci) * Hp + oh + r + kh) * Wp + ow0 + j + kw];
                                    out[((n * CO + cb * CB + c) * OH + oh + r) * OW + ow0 + j] = s;
                                }
#endif
                    }
                }
    }
}
