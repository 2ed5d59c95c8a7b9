// cp.async (sm_80+: global to shared memory without a trip through
// registers) as device functions, for nvcc and for the SIMT emulation
// (simt_emulator.h, included first there, lands the copies at their wait
// or their issue): the same kernel text compiles for both.
#ifndef PLATEAU_KERNELS_CUDA_CP_ASYNC_H_
#define PLATEAU_KERNELS_CUDA_CP_ASYNC_H_

#include <cstdint>

namespace plateau::cuda_async {

#if defined(__CUDACC__)
// 16 bytes global -> shared, the first src_bytes from src, the rest zero
// (src not read past them). "memory" clobbers: the compiler must not move
// shared-memory accesses across these.
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(src_bytes)
               : "memory");
}
// The thread's copies since the last commit become a group.
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Every committed group but the newest kPending has landed (this thread's).
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
#else
inline void CpAsync16(void* dst, const void* src, int src_bytes) {
  ::plateau::simt::CpAsync16(dst, src, src_bytes);
}
inline void CpAsyncCommit() { ::plateau::simt::CpAsyncCommit(); }
template <int kPending>
void CpAsyncWait() {
  ::plateau::simt::CpAsyncWait(kPending);
}
#endif

}  // namespace plateau::cuda_async

#endif  // PLATEAU_KERNELS_CUDA_CP_ASYNC_H_
