// Does a CPU kernel's time depend on where malloc put its scratch? sum_dim's loop (level1/03 at CPU
// scale: x[32][1024][512] summed over the middle into double accumulators, the shipped solution's
// inner loop) over one input on huge pages, with the accumulators at each offset from a 64-byte line
// (malloc gives 16-byte alignment, so a process's scratch lands at 0, 16, 32 or 48 bytes into a line
// as its earlier allocations fell). Per offset: the median and least of R calls, each after a 128 MiB
// read that flushes the cache. Pin it to one core.
//
//   g++ -O3 -march=native -std=c++17 -fopenmp -o build/scratch_alignment benchmarks/scratch_alignment.cpp
//   taskset -c 1 build/scratch_alignment [R]
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

static double now_ms() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

// The shipped solution's loop (kernels/solutions/level1/03_sum_dim/kernels/reduce.cpp), one thread.
__attribute__((noinline)) void sum_mid(double* part, const float* x, int64_t outer, int64_t r, int64_t inner) {
    for (int64_t o = 0; o < outer; ++o) {
        double* a = part + o * inner;
        for (int64_t i = 0; i < inner; ++i) a[i] = 0.0;
        for (int64_t k = 0; k < r; ++k) {
            const float* xp = x + (o * r + k) * inner;
            #pragma omp simd
            for (int64_t i = 0; i < inner; ++i) a[i] += (double)xp[i];
        }
    }
}

static char* on_huge_pages(size_t bytes) {   // as hpc.sandbox.exchange.HostSlot: 2 MiB aligned, advised
    const size_t huge = size_t(2) << 20, span = (bytes + huge - 1) / huge * huge;
    char* raw = static_cast<char*>(mmap(nullptr, span + huge, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    char* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + huge - 1) / huge * huge);
    madvise(p, span, MADV_HUGEPAGE);
    return p;
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 9;
    const int64_t outer = 32, r = 1024, inner = 512;
    const size_t n = outer * r * inner;
    float* x = reinterpret_cast<float*>(on_huge_pages(n * sizeof(float)));
    for (size_t i = 0; i < n; ++i) x[i] = (float)(i % 97) * 0.01f;
    char* scratch = static_cast<char*>(std::aligned_alloc(4096, outer * inner * sizeof(double) + 4096));
    const size_t flush_words = (size_t(128) << 20) / sizeof(long);
    long* flush = reinterpret_cast<long*>(on_huge_pages(flush_words * sizeof(long)));
    for (size_t i = 0; i < flush_words; ++i) flush[i] = (long)i;
    printf("offset_bytes median_ms least_ms\n");
    for (int offset = 0; offset < 192; offset += 16) {
        std::vector<double> ms;
        for (int k = 0; k < reps; ++k) {
            long s = 0;
            for (size_t i = 0; i < flush_words; ++i) s += flush[i];
            volatile long sink = s;
            (void)sink;
            const double t0 = now_ms();
            sum_mid(reinterpret_cast<double*>(scratch + offset), x, outer, r, inner);
            ms.push_back(now_ms() - t0);
        }
        std::sort(ms.begin(), ms.end());
        printf("%12d %9.3f %8.3f\n", offset, ms[ms.size() / 2], ms[0]);
    }
    return 0;
}
