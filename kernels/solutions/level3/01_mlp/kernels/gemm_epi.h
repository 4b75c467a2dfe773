#pragma once
#include <cstdint>

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_GELU = 2 };
enum { BIAS_NONE = 0, BIAS_COL = 1, BIAS_ROW = 2 };

// Applied once per output element: act(alpha * acc + bias) + res.
struct Epilogue {
    float alpha = 1.f;
    const float* bias = nullptr;
    int bias_mode = BIAS_NONE;
    int act = ACT_NONE;
    const float* res = nullptr;
    int64_t ldr = 0;
};

// C[M,N] = epilogue(A[M,K] @ B'), where B' = B^T with B stored [N,K] (b_trans) or B stored [K,N].
// All matrices row-major with leading dimensions lda/ldb/ldc. gemm_serial runs on the calling
// thread; gemm splits the output into tiles over the OpenMP threads.
void gemm_serial(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                 int64_t ldb, bool b_trans, float* C, int64_t ldc, const Epilogue& e);
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, bool b_trans, float* C, int64_t ldc, const Epilogue& e);
