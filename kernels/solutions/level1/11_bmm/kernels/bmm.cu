// C[b] = A[b] @ B[b] (row-major fp32) with fp32 accuracy: the wgmma 3xTF32 GEMM of wgmma.cuh, batch on
// grid.y, each B[b] split (and transposed to K-major) into the workspace `ws` first.
#include "wgmma.cuh"

// ws: wg::workspace_bytes(M, N, K, batch, A, M * K) bytes of device memory (model_new.py sizes it)
extern "C" void bmm(float* C, const float* A, const float* B, float* ws, int64_t batch, int64_t M, int64_t N,
                    int64_t K, cudaStream_t stream) {
    wg::Plain e;
    e.C = C;
    wg::launch<wg::Plain, false>(A, B, M, N, K, e, stream, ws, (int)batch, M * K, K * N, M * N);
}
