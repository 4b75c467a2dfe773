// Inclusive scan along the middle axis of [outer, len, inner], accumulated in double (as ATen does).
#include <cstdint>
#include <algorithm>
#include <immintrin.h>

static void scan_row(float* o, const float* x, int64_t n) {
    int64_t i = 0;
    double acc = 0.0;
#ifdef __AVX512F__
    const __m512i zero = _mm512_setzero_si512();
    const __m512i last = _mm512_set1_epi64(7);
    __m512d carry = _mm512_setzero_pd();
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        a = _mm512_add_pd(a, _mm512_castsi512_pd(_mm512_alignr_epi64(_mm512_castpd_si512(a), zero, 7)));
        b = _mm512_add_pd(b, _mm512_castsi512_pd(_mm512_alignr_epi64(_mm512_castpd_si512(b), zero, 7)));
        a = _mm512_add_pd(a, _mm512_castsi512_pd(_mm512_alignr_epi64(_mm512_castpd_si512(a), zero, 6)));
        b = _mm512_add_pd(b, _mm512_castsi512_pd(_mm512_alignr_epi64(_mm512_castpd_si512(b), zero, 6)));
        a = _mm512_add_pd(a, _mm512_castsi512_pd(_mm512_alignr_epi64(_mm512_castpd_si512(a), zero, 4)));
        b = _mm512_add_pd(b, _mm512_castsi512_pd(_mm512_alignr_epi64(_mm512_castpd_si512(b), zero, 4)));
        b = _mm512_add_pd(b, _mm512_permutexvar_pd(last, a));  // b now includes a's total
        __m512d oa = _mm512_add_pd(a, carry), ob = _mm512_add_pd(b, carry);
        carry = _mm512_add_pd(carry, _mm512_permutexvar_pd(last, b));
        _mm256_storeu_ps(o + i, _mm512_cvtpd_ps(oa));
        _mm256_storeu_ps(o + i + 8, _mm512_cvtpd_ps(ob));
    }
    acc = _mm512_cvtsd_f64(carry);
#endif
    for (; i < n; ++i) { acc += x[i]; o[i] = (float)acc; }
}

extern "C" void cumsum_mid(float* out, const float* x, int64_t outer, int64_t len, int64_t inner) {
    if (inner == 1) {
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < outer; ++r) scan_row(out + r * len, x + r * len, len);
        return;
    }
    const int64_t BI = 256, nb = (inner + BI - 1) / BI;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t o = 0; o < outer; ++o)
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t i0 = b * BI, n = std::min(BI, inner - i0);
            double acc[BI];
            for (int64_t i = 0; i < n; ++i) acc[i] = 0.0;
            for (int64_t k = 0; k < len; ++k) {
                const float* xp = x + (o * len + k) * inner + i0;
                float* op = out + (o * len + k) * inner + i0;
                #pragma omp simd
                for (int64_t i = 0; i < n; ++i) { acc[i] += (double)xp[i]; op[i] = (float)acc[i]; }
            }
        }
}
