// fp32 batched SGEMM C[b] = A[b] @ B[b] (row-major, batch on grid.z), CUDA cores only (no TF32): 128x128x8 block tile, 256 threads,
// 8x8 outputs per thread (split 4+4 rows/cols so smem float4 reads are conflict-free), register
// prefetch + double-buffered shared memory, one __syncthreads per k-tile. Each output is one
// sequential fmaf chain over k = 0..K-1 (the same order a plain cuBLAS-style kernel uses).
#include <cstdint>
#include <cuda_runtime.h>

namespace {
constexpr int BM = 128, BN = 128, BK = 8, NT = 256, APAD = 4, GROUP_M = 8;

template <bool FULL>
__global__ void __launch_bounds__(NT, 2)
sgemm_kernel(float* __restrict__ C, const float* __restrict__ A, const float* __restrict__ B,
             int M, int N, int K, int64_t sA, int64_t sB, int64_t sC) {
    __shared__ __align__(16) float As[2][BK][BM + APAD];
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x;
    A += (int64_t)blockIdx.z * sA;
    B += (int64_t)blockIdx.z * sB;
    C += (int64_t)blockIdx.z * sC;

    // grouped tile order (GROUP_M row tiles walk the column tiles together) for L2 reuse
    const int num_n = gridDim.x, num_m = gridDim.y;
    const int pid = blockIdx.y * num_n + blockIdx.x;
    const int width = GROUP_M * num_n;
    const int first_m = (pid / width) * GROUP_M;
    const int gsize = min(num_m - first_m, GROUP_M);
    const int tm = first_m + (pid % width) % gsize;
    const int tn = (pid % width) / gsize;
    const int m0 = tm * BM, n0 = tn * BN;

    const int a_row = tid >> 1, a_col = (tid & 1) * 4;   // A tile: 128 rows x 8 k
    const int b_row = tid >> 5, b_col = (tid & 31) * 4;  // B tile: 8 k x 128 cols
    const float* Ap = A + (int64_t)(m0 + a_row) * K + a_col;
    const float* Bp = B + (int64_t)b_row * N + n0 + b_col;
    const bool a_mok = m0 + a_row < M;

    float4 ra, rb;
    auto load = [&](int k0) {
        if (FULL) {
            ra = __ldg(reinterpret_cast<const float4*>(Ap + k0));
            rb = __ldg(reinterpret_cast<const float4*>(Bp + (int64_t)k0 * N));
        } else {
            const int gk = k0 + a_col;
            ra.x = (a_mok && gk + 0 < K) ? Ap[k0 + 0] : 0.f;
            ra.y = (a_mok && gk + 1 < K) ? Ap[k0 + 1] : 0.f;
            ra.z = (a_mok && gk + 2 < K) ? Ap[k0 + 2] : 0.f;
            ra.w = (a_mok && gk + 3 < K) ? Ap[k0 + 3] : 0.f;
            const bool kok = k0 + b_row < K;
            const int gn = n0 + b_col;
            const float* bp = Bp + (int64_t)k0 * N;
            rb.x = (kok && gn + 0 < N) ? bp[0] : 0.f;
            rb.y = (kok && gn + 1 < N) ? bp[1] : 0.f;
            rb.z = (kok && gn + 2 < N) ? bp[2] : 0.f;
            rb.w = (kok && gn + 3 < N) ? bp[3] : 0.f;
        }
    };
    auto store = [&](int buf) {
        As[buf][a_col + 0][a_row] = ra.x;
        As[buf][a_col + 1][a_row] = ra.y;
        As[buf][a_col + 2][a_row] = ra.z;
        As[buf][a_col + 3][a_row] = ra.w;
        *reinterpret_cast<float4*>(&Bs[buf][b_row][b_col]) = rb;
    };

    const int tx = tid & 15, ty = tid >> 4;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    load(0);
    store(0);
    __syncthreads();
    int buf = 0;
    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool has_next = k0 + BK < K;
        if (has_next) load(k0 + BK);
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[buf][kk][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[buf][kk][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[buf][kk][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[buf][kk][64 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (has_next) {
            store(buf ^ 1);
            __syncthreads();
            buf ^= 1;
        }
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = n0 + h * 64 + tx * 4;
            if (FULL) {
                *reinterpret_cast<float4*>(C + (int64_t)r * N + c) =
                    make_float4(acc[i][h * 4 + 0], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]);
            } else if (r < M) {
                float* cp = C + (int64_t)r * N;
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (c + j < N) cp[c + j] = acc[i][h * 4 + j];
            }
        }
    }
}

void launch_gemm(float* C, const float* A, const float* B, int64_t batch, int64_t M, int64_t N, int64_t K,
                 cudaStream_t stream) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    if (K <= 0) {
        cudaMemsetAsync(C, 0, (size_t)(batch * M * N) * sizeof(float), stream);
        return;
    }
    dim3 grid((unsigned)((N + BN - 1) / BN), (unsigned)((M + BM - 1) / BM), (unsigned)batch);
    const bool aligned = ((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B) |
                           reinterpret_cast<uintptr_t>(C)) & 15) == 0;
    const bool full = aligned && M % BM == 0 && N % BN == 0 && K % BK == 0;
    if (full)
        sgemm_kernel<true><<<grid, NT, 0, stream>>>(C, A, B, (int)M, (int)N, (int)K, M * K, K * N, M * N);
    else
        sgemm_kernel<false><<<grid, NT, 0, stream>>>(C, A, B, (int)M, (int)N, (int)K, M * K, K * N, M * N);
}
}  // namespace

extern "C" void bmm(float* C, const float* A, const float* B, int64_t batch, int64_t M, int64_t N, int64_t K,
                    cudaStream_t stream) {
    launch_gemm(C, A, B, batch, M, N, K, stream);
}
