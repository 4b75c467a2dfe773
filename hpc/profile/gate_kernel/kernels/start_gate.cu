// The start gate of the CUDA timing protocol (hpc/profile/timing.py).
//
// Before each timed call the harness launches this kernel on the timing stream: it fills every
// SM (all thread slots) and spins until the host opens the gate, which it does once the call has
// returned, or until a timeout. The timed call's launches therefore queue up behind it, so the
// host-side launch path is outside the timed interval, and nothing the call put on another stream
// can run before the start event, because no SM has room for it.
#include <cuda_runtime.h>

#include <atomic>

namespace {

__device__ unsigned gate_open_token;   // relayed from block 0 (the one reading host memory) to the rest

unsigned* host_flag = nullptr;         // mapped pinned memory: the host writes, block 0 reads
unsigned* device_view = nullptr;
int blocks = 0;

constexpr int kThreads = 1024;

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(kThreads) gate(const volatile unsigned* flag, unsigned token,
                                                  unsigned long long timeout_ns) {
  if (threadIdx.x == 0) {
    volatile unsigned* relay = &gate_open_token;
    const unsigned long long t0 = now_ns();
    if (blockIdx.x == 0) {
      while (*flag != token && now_ns() - t0 < timeout_ns) __nanosleep(256);
      *relay = token;
      __threadfence();
    } else {
      while (*relay != token && now_ns() - t0 < timeout_ns) __nanosleep(128);
    }
  }
  __syncthreads();
}

}  // namespace

// Allocates the host flag and sizes the grid to every thread slot of the device; 0 or a cudaError_t.
extern "C" int hpc_start_gate_init() {
  if (host_flag) return 0;
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (!err) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (!err) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gate, kThreads, 0);
  if (!err) err = cudaHostAlloc(reinterpret_cast<void**>(&host_flag), sizeof(unsigned), cudaHostAllocMapped);
  if (!err) err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_view), host_flag, 0);
  if (err) return static_cast<int>(err);
  *host_flag = 0;
  blocks = sms * per_sm;
  return 0;
}

// Closes the gate on `stream` until hpc_start_gate_open(token) or `timeout_ns`; 0 or a cudaError_t.
extern "C" int hpc_start_gate_close(unsigned token, unsigned long long timeout_ns, void* stream) {
  gate<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(device_view, token, timeout_ns);
  return static_cast<int>(cudaGetLastError());
}

extern "C" void hpc_start_gate_open(unsigned token) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  *reinterpret_cast<volatile unsigned*>(host_flag) = token;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

extern "C" int hpc_start_gate_blocks() { return blocks; }
