// The warpgroup MMA instructions (sm_90a) as device functions, for nvcc and
// for the SIMT emulation (simt_emulator.h, included first there): the same
// kernel text compiles for both. Shapes and layouts: wgmma_layout.h.
//
// Each is issued by all 128 threads of a warpgroup. The order a kernel
// keeps (the PTX ISA's rules): operands in shared memory that cp.async
// wrote are fenced for the async proxy by their writers (FenceProxyAsync,
// after the copies landed) and then made every thread's by a barrier;
// WgmmaFence before the first wgmma that reads registers other
// instructions wrote (the accumulators, A); WgmmaCommit after a batch;
// WgmmaWait<n> before d is read or an operand's registers or shared memory
// are rewritten.
#ifndef PLATEAU_KERNELS_CUDA_WGMMA_INSTRUCTIONS_H_
#define PLATEAU_KERNELS_CUDA_WGMMA_INSTRUCTIONS_H_

#include <cstdint>

namespace plateau::wgmma {

#if defined(__CUDACC__)
// d (+)= A B, m64n64k16, bf16 operands, fp32 d. A from registers (4 per
// thread, mma.sync's A layout per warp); B's descriptor; kBMnMajor: B is
// MN-major (.trans 1); accumulate: d is added to (scale-d 1) or replaced.
template <bool kBMnMajor>
__device__ __forceinline__ void MmaRs(float d[32], const uint32_t a[4], uint64_t b_desc,
                                      bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(accumulate ? 1 : 0),
        "n"(kBMnMajor ? 1 : 0)
      : "memory");
}
// The same with A from shared memory (its descriptor; kAMnMajor: .trans).
template <bool kAMnMajor, bool kBMnMajor>
__device__ __forceinline__ void MmaSs(float d[32], uint64_t a_desc, uint64_t b_desc,
                                      bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a_desc), "l"(b_desc), "r"(accumulate ? 1 : 0), "n"(kAMnMajor ? 1 : 0),
        "n"(kBMnMajor ? 1 : 0)
      : "memory");
}
__device__ __forceinline__ void Fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void Commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void Wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Ties x to this point for the compiler (CUTLASS's warpgroup_fence_operand):
// an instruction that writes x cannot sink below it, a read of x cannot
// rise above it, and x's register is not reused before it. Before Fence on
// a wgmma's accumulators and A registers, after Wait on the same.
__device__ __forceinline__ void FenceOperand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void FenceOperand(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
#else
template <bool kBMnMajor>
inline void MmaRs(float d[32], const uint32_t a[4], uint64_t b_desc, bool accumulate) {
  ::plateau::simt::WgmmaRs(d, a, b_desc, kBMnMajor, accumulate);
}
template <bool kAMnMajor, bool kBMnMajor>
inline void MmaSs(float d[32], uint64_t a_desc, uint64_t b_desc, bool accumulate) {
  ::plateau::simt::WgmmaSs(d, a_desc, kAMnMajor, b_desc, kBMnMajor, accumulate);
}
inline void Fence() { ::plateau::simt::WgmmaFence(); }
inline void Commit() { ::plateau::simt::WgmmaCommit(); }
template <int kPending>
void Wait() {
  ::plateau::simt::WgmmaWait(kPending);
}
inline void FenceProxyAsync() { ::plateau::simt::FenceProxyAsync(); }
inline uint32_t SharedAddress(const void* p) { return ::plateau::simt::SharedWindowAddress(p); }
inline void FenceOperand(float&) {}  // the emulation's compiler knows nothing of wgmma
inline void FenceOperand(uint32_t&) {}
#endif
template <typename T, int kN>
__device__ __forceinline__ void FenceOperands(T (&x)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) FenceOperand(x[i]);
}
template <typename T, int kN, int kM>
__device__ __forceinline__ void FenceOperands(T (&x)[kN][kM]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) FenceOperands(x[i]);
}

}  // namespace plateau::wgmma

#endif  // PLATEAU_KERNELS_CUDA_WGMMA_INSTRUCTIONS_H_
