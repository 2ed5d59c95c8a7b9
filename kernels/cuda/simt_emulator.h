// A small emulation of CUDA's execution model on the CPU, for running the
// body of a kernel that cannot run here (no GPU) as g++ code: each block's
// threads are user-level contexts (own stacks, a hand-written x86-64
// switch) switched at the collectives (__syncthreads, the warp shuffles and
// ballots, a warp-wide instruction), one block at a time. What it catches
// that a plain C++ port would not:
//   - a missing barrier: threads run in a chosen order (Schedule), as far
//     as the barriers let them, so a read of shared memory another warp has
//     not written yet (or has overwritten already) changes the results
//     between schedules;
//   - a barrier not every thread reaches (deadlock) and warp collectives
//     the lanes of a warp disagree on;
//   - uninitialised shared memory: it starts as 0xFF bytes (NaN floats and
//     bf16) in every block, static (__shared__ arrays) and dynamic, and
//     writes past the kernel's size land in a guard that is checked after
//     each block;
//   - an asynchronous copy read before it is waited for, or landing in a
//     buffer still being read: cp.async lands at the thread's wait (as late
//     as the hardware may) or at its issue (as early), as asked.
// Not modelled: memory-model subtleties inside a barrier interval (a thread
// runs until its next collective), timing, and the hardware's own
// arithmetic (the warp-wide mma below sums in double and rounds once).
//
// The shims below (the CUDA keywords, threadIdx, bf16 conversions, the
// rounding intrinsics, the launch and shared-memory spellings) are what the
// kernel sources (kernels/cuda/*.cu, cuda_attention_tc_kernels.inc) use;
// kernels/cuda/emulated/ maps <cuda_runtime.h> and friends here and runs
// launches through the emulated runtime (emulated/cuda_runtime_api.h).
//
// One grid at a time in one process (the state is global): the emulated
// runtime runs every grid under its lock; a test calling RunGrid directly
// must not run grids from two threads.
#ifndef PLATEAU_KERNELS_CUDA_SIMT_EMULATOR_H_
#define PLATEAU_KERNELS_CUDA_SIMT_EMULATOR_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __align__(x) alignas(x)

// The CUDA runtime's error codes: name, value (the real ones, as in
// driver_types.h) and cudaGetErrorString's text. One list for the enum here
// and the emulated runtime's names and texts (emulated/runtime.cc).
#define PLATEAU_CUDA_ERRORS(X) \
  X(cudaSuccess, 0, "no error") \
  X(cudaErrorInvalidValue, 1, "invalid argument") \
  X(cudaErrorMemoryAllocation, 2, "out of memory") \
  X(cudaErrorInitializationError, 3, "initialization error") \
  X(cudaErrorInvalidConfiguration, 9, "invalid configuration argument") \
  X(cudaErrorInvalidDevicePointer, 17, "invalid device pointer") \
  X(cudaErrorInvalidMemcpyDirection, 21, "invalid copy direction for memcpy") \
  X(cudaErrorInsufficientDriver, 35,                                                        \
    "CUDA driver version is insufficient for CUDA runtime version")                        \
  X(cudaErrorInvalidDeviceFunction, 98, "invalid device function") \
  X(cudaErrorNoDevice, 100, "no CUDA-capable device is detected") \
  X(cudaErrorInvalidDevice, 101, "invalid device ordinal") \
  X(cudaErrorNoKernelImageForDevice, 209,                                                   \
    "no kernel image is available for execution on the device")                            \
  X(cudaErrorECCUncorrectable, 214, "uncorrectable ECC error") \
  X(cudaErrorNvlinkUncorrectable, 220, "uncorrectable NVLink error detected during the execution") \
  X(cudaErrorInvalidResourceHandle, 400, "invalid resource handle") \
  X(cudaErrorNotReady, 600, "device not ready") \
  X(cudaErrorIllegalAddress, 700, "an illegal memory access") \
  X(cudaErrorLaunchOutOfResources, 701, "too many resources requested for launch") \
  X(cudaErrorLaunchTimeout, 702, "the launch timed out") \
  X(cudaErrorContextIsDestroyed, 709, "context is destroyed") \
  X(cudaErrorAssert, 710, "device-side assert triggered") \
  X(cudaErrorHardwareStackError, 714, "hardware stack error") \
  X(cudaErrorIllegalInstruction, 715, "an illegal instruction") \
  X(cudaErrorMisalignedAddress, 716, "misaligned address") \
  X(cudaErrorInvalidAddressSpace, 717, "operation not supported on global/shared address space") \
  X(cudaErrorInvalidPc, 718, "invalid program counter") \
  X(cudaErrorLaunchFailure, 719, "unspecified launch failure") \
  X(cudaErrorNotSupported, 801, "operation not supported") \
  X(cudaErrorUnknown, 999, "unknown error")
enum cudaError {
#define PLATEAU_CUDA_ERROR_VALUE(name, value, text) name = value,
  PLATEAU_CUDA_ERRORS(PLATEAU_CUDA_ERROR_VALUE)
#undef PLATEAU_CUDA_ERROR_VALUE
};
typedef enum cudaError cudaError_t;
typedef struct CUstream_st* cudaStream_t;

struct SimtDim3 {
  unsigned x = 0, y = 0, z = 0;
};
extern SimtDim3 threadIdx, blockIdx, blockDim, gridDim;
// A launch's grid or block shape, 1 in each dimension not given.
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

// bf16 as CUDA's cuda_bf16.h rounds it: to nearest even, NaN kept NaN.
struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;  // x in the low half
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = uint32_t{b.bits} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
// -ffp-contract=off (.bazelrc): each of these rounds on its own, as on CUDA.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
using std::max;
using std::min;

void __syncthreads();
// The barrier that also returns whether `predicate` held for any thread.
int __syncthreads_or(int predicate);
float __shfl_xor_sync(unsigned mask, float x, int lane_mask);
// Bit i: lane i's predicate (the full mask only).
unsigned __ballot_sync(unsigned mask, int predicate);

namespace plateau::simt {

// The order in which runnable threads are resumed: kInOrder (thread 0
// first: warp 0 runs ahead), kReversed (warp 3 ahead), kShuffled (a fixed
// random order).
enum class Schedule { kInOrder, kReversed, kShuffled };

// Runs `body` once per block of `grid` (x fastest), `threads` threads a
// block, with `smem_bytes` of dynamic shared memory (SharedMemory()).
// Blocks run one at a time, in the schedule's order (kShuffled: a fixed
// random order). Returns "" or what went wrong (a deadlock, divergent warp
// collectives, a write past the shared memory, static plus dynamic shared
// memory past `smem_limit` bytes when that is not negative); the first
// problem is kept.
std::string RunGrid(SimtDim3 grid, int threads, int smem_bytes, Schedule schedule,
                    const std::function<void()>& body, int smem_limit = -1);

// The running block's dynamic shared memory.
unsigned char* SharedMemory();

// A warp-wide rendezvous for a collective operation `kind` (each kind a
// distinct number): returns when all 32 lanes of the caller's warp have
// called it; a lane calling another kind at the same point is a failure.
// Between two rendezvous a collective may read what every lane left in
// WarpScratch().
void WarpRendezvous(int kind);
// 32 lanes x 8 words of per-warp scratch for the collectives.
uint32_t (*WarpScratch())[8];

// The warp-wide mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// (c += a b, fragments as the PTX ISA lays them out), each output summed in
// double and rounded once: the hardware's order differs, within the
// tolerance of the tests that use it.
void MmaM16N8K16Bf16(float c[4], const uint32_t a[4], const uint32_t b[2]);

// The warp-wide ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: lane
// 8 i + r gives the address of row r of 8 x 8 matrix i (8 elements, 16
// bytes, 16-byte aligned, inside the block's shared memory; anything else
// fails the block); register i of lane l gets matrix i's row l / 4,
// elements 2 (l % 4) and 2 (l % 4) + 1, the first in the low half, or with
// `trans` its column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1.
void LdMatrixX4(uint32_t r[4], const void* row, bool trans);

// When cp.async copies land (a GPU may land one any time between its issue
// and its thread's wait for its group), for the grids that follow:
// - kAtWait (the default): the latest. A read of the destination before the
//   wait, or by another thread before the wait and a barrier, sees the old
//   bytes (0xFF at first: NaN).
// - kAtIssue: the earliest. A copy into a buffer other warps may still be
//   reading (a refill without the barrier after their last read)
//   overwrites it under them.
// A kernel right on a GPU gives the same results under both.
enum class CopyLanding { kAtWait, kAtIssue };
void SetCopyLanding(CopyLanding landing);
// SetCopyLanding for a scope; kAtWait again at its end.
class ScopedCopyLanding {
 public:
  explicit ScopedCopyLanding(CopyLanding landing) { SetCopyLanding(landing); }
  ~ScopedCopyLanding() { SetCopyLanding(CopyLanding::kAtWait); }
  ScopedCopyLanding(const ScopedCopyLanding&) = delete;
  ScopedCopyLanding& operator=(const ScopedCopyLanding&) = delete;
};

// cp.async.cg.shared.global with a cp-size of 16 (16-byte aligned; the
// destination in the block's shared memory): the first `src_bytes` (0..16)
// bytes from `src`, the rest zero, `src` not read past them; it lands as
// SetCopyLanding says. A thread that ends with copies it never waited for
// fails the block.
void CpAsync16(void* dst, const void* src, int src_bytes);
// cp.async.commit_group: the thread's copies since the last commit are a
// group.
void CpAsyncCommit();
// cp.async.wait_group `pending`: every committed group but the newest
// `pending` lands.
void CpAsyncWait(int pending);

// Hopper's warpgroup MMA, wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16
// .bf16 (sm_90a), issued by every thread of the caller's warpgroup (threads
// 128 g .. 128 g + 127; the block a multiple of 128 threads) with the same
// descriptors and flags, else the block fails: d (32 floats a thread) =
// A B, plus d where `accumulate`; A from registers a[4] (WgmmaRs) or shared
// memory (descriptor a_desc, WgmmaSs), B from shared memory (b_desc); a
// shared operand K-major, or MN-major where *_mn_major (the .trans
// immediates). Written out here from the PTX ISA's fragment figures and its
// matrix-descriptor format and canonical layouts, apart from
// kernels/cuda/wgmma_layout.h, which the kernels use. Descriptors address
// the block's dynamic shared memory (SharedWindowAddress) in the
// no-swizzle layout with base offset 0; anything else fails the block.
// Summed in double and rounded once, as MmaM16N8K16Bf16.
//
// Asynchronous as on the GPU: the operands (A's registers and shared
// memory) are read and d written when the wgmma completes, at the wait for
// its group (the latest; the default) or at its issue (the earliest,
// SetWgmmaCompletion): a kernel that reads d or rewrites an operand before
// that wait gives different results under the two. Shared memory that a
// cp.async wrote is read only after its writing thread fenced it
// (FenceProxyAsync) once it landed (the tensor cores read through the async
// proxy) and a block barrier followed (stricter than the PTX ISA may be
// within one warpgroup; what the kernels keep); otherwise the block fails.
// So does a wgmma with no WgmmaFence since the warpgroup's start or its
// last WgmmaWait (the ISA asks for one before the first wgmma and after
// other instructions touched its registers, which a wait's results always
// are), and a warpgroup whose threads end with wgmma outstanding. Plain
// stores to shared memory are not tracked: the kernels fill the operands
// by cp.async.
void WgmmaRs(float d[32], const uint32_t a[4], uint64_t b_desc, bool b_mn_major, bool accumulate);
void WgmmaSs(float d[32], uint64_t a_desc, bool a_mn_major, uint64_t b_desc, bool b_mn_major,
             bool accumulate);
// wgmma.fence.sync.aligned (a warpgroup rendezvous here; what it orders on
// the GPU, register accesses, the emulation does not model).
void WgmmaFence();
// wgmma.commit_group.sync.aligned: the warpgroup's wgmma since the last
// commit are a group.
void WgmmaCommit();
// wgmma.wait_group.sync.aligned `pending`: every committed group but the
// newest `pending` completes.
void WgmmaWait(int pending);
// fence.proxy.async.shared::cta: this thread's landed cp.async writes become
// visible to the tensor cores.
void FenceProxyAsync();
// The address a descriptor holds for `p` in the block's dynamic shared
// memory (its offset there; 16-byte aligned), as __cvta_generic_to_shared
// on the GPU; a pointer elsewhere fails the block.
uint32_t SharedWindowAddress(const void* p);
enum class WgmmaCompletion { kAtWait, kAtIssue };
void SetWgmmaCompletion(WgmmaCompletion completion);

// A statically sized __shared__ array of the running block: `key` names the
// declaration (one per template instantiation), `bytes` its size. The first
// call in a block allocates it (0xFF bytes, with a guard checked after the
// block, as the dynamic shared memory); every thread of the block gets the
// same memory.
unsigned char* StaticShared(const void* key, size_t bytes);

// Called by a launch (PLATEAU_KERNEL_LAUNCH): the emulated runtime
// (kernels/cuda/emulated/runtime.cc) checks the configuration as CUDA does
// and puts `body` (one thread's run of the kernel, with its arguments
// bound) on `stream`, to run on RunGrid when the stream runs. Returns the
// launch's error, which cudaGetLastError also reports.
// `name` is the kernel as the launch spells it, for messages.
cudaError_t LaunchKernel(const void* kernel, const char* name, dim3 grid, dim3 block,
                         size_t smem_bytes, cudaStream_t stream, std::function<void()> body);

// `kernel<<<grid, block, smem, stream>>>(args...)` for the emulation: the
// arguments are copied at the launch, as CUDA copies them.
template <typename... Params>
class Launcher {
 public:
  Launcher(void (*kernel)(Params...), const char* name, dim3 grid, dim3 block, size_t smem,
           cudaStream_t stream)
      : kernel_(kernel), name_(name), grid_(grid), block_(block), smem_(smem), stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "a kernel's every argument");
    // Implicit conversions only, as a kernel call's.
    std::tuple<std::decay_t<Params>...> bound(Convert<Params>(std::forward<Args>(args))...);
    void (*kernel)(Params...) = kernel_;
    LaunchKernel(reinterpret_cast<const void*>(kernel_), name_, grid_, block_, smem_, stream_,
                 [kernel, bound] { std::apply(kernel, bound); });
  }

 private:
  template <typename P, typename A>
  static P Convert(A&& a) {
    return std::forward<A>(a);
  }

  void (*kernel_)(Params...);
  const char* name_;
  dim3 grid_, block_;
  size_t smem_;
  cudaStream_t stream_;
};

template <typename... Params>
Launcher<Params...> MakeLauncher(void (*kernel)(Params...), const char* name, dim3 grid,
                                 dim3 block, size_t smem, cudaStream_t stream) {
  return Launcher<Params...>(kernel, name, grid, block, smem, stream);
}

}  // namespace plateau::simt

// The kernel sources' spellings of a launch and of shared memory
// (kernels/cuda/cuda_device_utils.cuh gives nvcc's): the same text compiles
// for the GPU and for this emulation.
//   PLATEAU_KERNEL_LAUNCH(grid, block, smem, stream, Kernel<T>)(args...);
//   PLATEAU_SHARED_ARRAY(float, name, count);   // __shared__ float name[count]
//   PLATEAU_DYNAMIC_SHARED(float, name);        // extern __shared__ float name[]
#define PLATEAU_KERNEL_LAUNCH(grid, block, smem, stream, ...) \
  ::plateau::simt::MakeLauncher(&__VA_ARGS__, #__VA_ARGS__, grid, block, smem, stream)
#define PLATEAU_SHARED_ARRAY(type, name, count)                               \
  static const char plateau_shared_key_##name = 0;                           \
  type* const name = reinterpret_cast<type*>(                                \
      ::plateau::simt::StaticShared(&plateau_shared_key_##name, sizeof(type) * (count)))
#define PLATEAU_DYNAMIC_SHARED(type, name) \
  type* const name = reinterpret_cast<type*>(::plateau::simt::SharedMemory())

#endif  // PLATEAU_KERNELS_CUDA_SIMT_EMULATOR_H_
