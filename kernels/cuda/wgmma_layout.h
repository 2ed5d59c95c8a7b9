// Hopper's warpgroup matrix multiply (wgmma.mma_async, sm_90a) for bf16
// operands and fp32 accumulators, shape m64n64k16: which thread holds which
// element, and how shared memory holds the operands it reads there. The
// device code and the SIMT emulation (simt_emulator.h: the emulation decodes
// descriptors and addresses elements by its own reading of the PTX ISA, not
// through this file) and a host test all include it; host and device.
//
// One warpgroup (4 consecutive warps, the first a multiple of 4) issues each
// wgmma together: D[64 x 64] (+)= A[64 x 16] B[16 x 64].
//
// Registers (the PTX ISA's wgmma fragment figures): warp w of the group owns
// rows 16 w .. 16 w + 15 of A and D, laid out within the warp as
// mma.sync.m16n8k16's (mma_layout.h): A's 4 registers as mma's A; D's 32
// floats as 8 of mma's m16n8 accumulator tiles side by side (float r is
// element r % 4 of the tile for columns 8 (r / 4) ..).
//
// Shared memory: only the no-swizzle ("interleave") canonical layouts.
// Elements come in core matrices of 8 rows of 16 bytes (8 bf16), each core
// matrix 128 contiguous bytes. An operand is K-major when its 8 elements of
// a core-matrix row run along K (A[m][k] row-major; B as B^T[n][k]), MN-major
// when they run along M or N (B[k][n] row-major: V of P V). The descriptor
// gives two strides between core matrices: the leading byte offset (LBO)
// between neighbours along K, the stride byte offset (SBO) between
// neighbours along M or N, in both majors. The tiles here store the core
// matrices M/N-fastest: a tile of R rows (M or N) and K columns puts core
// matrix (r / 8, k / 8) at (k / 8) (R / 8) 128 + (r / 8) 128 bytes, so SBO =
// 128 and LBO = 16 R, and k-step s (16 columns: core matrices 2s, 2s + 1)
// starts 2 s LBO bytes in.
#ifndef PLATEAU_KERNELS_CUDA_WGMMA_LAYOUT_H_
#define PLATEAU_KERNELS_CUDA_WGMMA_LAYOUT_H_

#include <cstdint>

#include "kernels/cuda/mma_layout.h"

#if defined(__CUDACC__)
#define PLATEAU_WGMMA_HD __host__ __device__ __forceinline__
#else
#define PLATEAU_WGMMA_HD inline
#endif

namespace plateau::wgmma {

inline constexpr int kM = 64, kN = 64, kK = 16;
inline constexpr int kThreads = 128;                 // one warpgroup
inline constexpr int kARegs = 4;                     // A from registers: 4 x 2 bf16
inline constexpr int kDFloats = kM * kN / kThreads;  // 32

// The element (row, column) of D that float r of thread t (0..127) holds.
PLATEAU_WGMMA_HD constexpr mma::Coord DElement(int t, int r) {
  const mma::Coord c = mma::CElement(t % 32, r % 4);
  return {16 * (t / 32) + c.row, 8 * (r / 4) + c.col};
}
// The element (row, k) of A that half h of register r of thread t holds.
PLATEAU_WGMMA_HD constexpr mma::Coord AElement(int t, int r, int h) {
  const mma::Coord c = mma::AElement(t % 32, r, h);
  return {16 * (t / 32) + c.row, c.col};
}

// Byte offset of element (mn, k) in a no-swizzle tile of `rows` rows (M or
// N) as above, K-major or MN-major.
PLATEAU_WGMMA_HD constexpr uint32_t KMajorOffset(int mn, int k, int rows) {
  return (k / 8) * (rows / 8) * 128 + (mn / 8) * 128 + (mn % 8) * 16 + (k % 8) * 2;
}
PLATEAU_WGMMA_HD constexpr uint32_t MnMajorOffset(int mn, int k, int rows) {
  return (k / 8) * (rows / 8) * 128 + (mn / 8) * 128 + (k % 8) * 16 + (mn % 8) * 2;
}

// The shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format")
// of a no-swizzle operand whose k-step starts at shared-memory address
// `address` (16-byte aligned), core matrices `lbo` bytes apart along K and
// `sbo` along M/N: bits 0-13 address / 16, 16-29 LBO / 16, 32-45 SBO / 16,
// base offset 0 (bits 49-51) and layout type 0, no swizzle (bits 62-63).
PLATEAU_WGMMA_HD constexpr uint64_t Descriptor(uint32_t address, uint32_t lbo, uint32_t sbo) {
  return uint64_t{(address >> 4) & 0x3fffu} | uint64_t{(lbo >> 4) & 0x3fffu} << 16 |
         uint64_t{(sbo >> 4) & 0x3fffu} << 32;
}
// The descriptor of k-step s of a tile of `rows` rows laid out as above.
PLATEAU_WGMMA_HD constexpr uint64_t TileDescriptor(uint32_t tile_address, int rows, int s) {
  return Descriptor(tile_address + 2 * s * 16 * rows, 16 * rows, 128);
}
// `desc` with its start `bytes` (a multiple of 16) further on: Descriptor(a
// + bytes, lbo, sbo) for desc = Descriptor(a, lbo, sbo), while a + bytes is a
// shared-memory address (below 2^18: the field's 14 bits of address / 16),
// so the sum never carries out of the field. One 32-bit add of a constant
// where the kernels' loops would otherwise rebuild every descriptor from
// its address (shift, mask, or: ~10 instructions a wgmma in the machine
// code).
PLATEAU_WGMMA_HD constexpr uint64_t Advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xffffffff00000000ull) | uint32_t(uint32_t(desc) + (bytes >> 4));
}

}  // namespace plateau::wgmma

#undef PLATEAU_WGMMA_HD

#endif  // PLATEAU_KERNELS_CUDA_WGMMA_LAYOUT_H_
