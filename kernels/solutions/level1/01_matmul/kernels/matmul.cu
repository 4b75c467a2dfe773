// C = A @ B (row-major fp32) with fp32 accuracy: the wgmma 3xTF32 GEMM of wgmma.cuh, B split (and
// transposed to K-major) into the workspace `ws` first.
#include "wgmma.cuh"

// ws: wg::workspace_bytes(M, N, K, 1, A, 0) bytes of device memory (model_new.py sizes it)
extern "C" void matmul(float* C, const float* A, const float* B, float* ws, int64_t M, int64_t N, int64_t K,
                       cudaStream_t stream) {
    wg::Plain e;
    e.C = C;
    wg::launch<wg::Plain, false>(A, B, M, N, K, e, stream, ws);
}
