// Which lane of a warp holds which element of the operands of one tensor-core
// instruction, mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
// (D[16x8] = A[16x16] B[16x8] + C, bf16 inputs, fp32 accumulators), as the
// PTX ISA's "Matrix fragments for mma.m16n8k16 with floating point type"
// tables give it. The tensor-core attention kernels (cuda_attention_tc.cu)
// address shared memory through these functions alone, and
// mma_layout_test.cc (plain C++, runs everywhere) checks them against the
// table and checks the identities the kernels rely on, so a slip in an index
// shows up on a machine without a GPU. The kernels load fragments with
// ldmatrix (the Ldmatrix* functions below); the per-word offsets
// (AWordOffset, BWordOffset) say what each register must hold, and the tests
// hold the two to the same fragments.
//
// Notation: lane in [0, 32); group = lane / 4 (the PTX "groupID"), quad =
// lane % 4 ("threadID_in_group"). A and B registers are 32 bits holding two
// bf16 that are adjacent along k, the lower k in the low half ("half" 0).
#ifndef PLATEAU_KERNELS_CUDA_MMA_LAYOUT_H_
#define PLATEAU_KERNELS_CUDA_MMA_LAYOUT_H_

#if defined(__CUDACC__)
#define PLATEAU_MMA_HD __host__ __device__ __forceinline__
#else
#define PLATEAU_MMA_HD inline
#endif

namespace plateau::mma {

inline constexpr int kM = 16;  // rows of A, C, D
inline constexpr int kN = 8;   // columns of B, C, D
inline constexpr int kK = 16;  // columns of A, rows of B
inline constexpr int kARegs = 4, kBRegs = 2, kCFloats = 4;

struct Coord {
  int row, col;
};

// A (row-major operand, kM x kK): register reg (0..3), half h (0, 1).
PLATEAU_MMA_HD constexpr Coord AElement(int lane, int reg, int h) {
  return {lane / 4 + 8 * (reg % 2), 2 * (lane % 4) + 8 * (reg / 2) + h};
}
// B (column operand, kK x kN): register reg (0, 1), half h; {row = k, col = n}.
PLATEAU_MMA_HD constexpr Coord BElement(int lane, int reg, int h) {
  return {2 * (lane % 4) + 8 * reg + h, lane / 4};
}
// C and D (kM x kN fp32): float i (0..3).
PLATEAU_MMA_HD constexpr Coord CElement(int lane, int i) {
  return {lane / 4 + 8 * (i / 2), 2 * (lane % 4) + i % 2};
}

// An accumulator tile used as the next product's A operand (FlashAttention's
// P V and dS K without a trip through shared memory): the kM x kK A tile
// whose columns [0, 8) are C tile 0 and [8, 16) are C tile 1. Register reg,
// half h of a lane is that same lane's float CFloatOfA(reg, h) of C tile
// CTileOfA(reg): each lane already holds what it must pass on.
PLATEAU_MMA_HD constexpr int CTileOfA(int reg) { return reg / 2; }
PLATEAU_MMA_HD constexpr int CFloatOfA(int reg, int h) { return 2 * (reg % 2) + h; }

// Shared-memory offsets (in bf16 elements) of the 32-bit words a lane loads:
// - A from a row-major tile X[row][k] (leading dimension ld): register reg of
//   the 16 x 16 block at (row0, k0);
// - B from a tile stored n-major, Y[n][k] (B[k][n] = Y[n][k]: B^T row-major,
//   which is how K sits for Q K^T): register reg of the 16 x 8 block at
//   (k0, n0).
// Both are even (ld, k0 even), so each word is one aligned 32-bit load.
PLATEAU_MMA_HD constexpr int AWordOffset(int lane, int reg, int row0, int k0, int ld) {
  return (row0 + AElement(lane, reg, 0).row) * ld + k0 + AElement(lane, reg, 0).col;
}
PLATEAU_MMA_HD constexpr int BWordOffset(int lane, int reg, int k0, int n0, int ld) {
  return (n0 + BElement(lane, reg, 0).col) * ld + k0 + BElement(lane, reg, 0).row;
}

// ldmatrix.sync.aligned.m8n8.x4 loads four 8 x 8 bf16 matrices, one per
// register: lane 8 i + r gives the address of row r of matrix i, and
// register i of lane `lane` receives matrix i's element LdmatrixElement
// (without .trans: row lane / 4, columns 2 (lane % 4) + h; with .trans the
// transpose). The rows each lane gives, as offsets (in bf16 elements) into
// a tile of leading dimension ld, so that the four registers are exactly
// one mma operand fragment:
// - LdmatrixARow: A's four registers for the 16 x 16 block at (row0, k0) of
//   a row-major tile X[row][k] (matrices: rows +0/+8 x k +0/+8, in A's
//   register order);
// - LdmatrixBRow: B's two registers for each of the n8 blocks at n0 and
//   n0 + 8 (registers 0-1, then 2-3) of an n-major tile Y[n][k] (B[k][n] =
//   Y[n][k]: K for Q K^T), without .trans;
// - LdmatrixBTransRow: the same from a k-major tile X[k][n] (B = X as it
//   is stored: V for P V), with .trans.
// Every row is 8 consecutive elements at an offset that is a multiple of 8
// (ld, row0, k0, n0 multiples of 8): 16-byte aligned rows, as ldmatrix
// needs.
PLATEAU_MMA_HD constexpr Coord LdmatrixElement(int lane, int h, bool trans) {
  return trans ? Coord{2 * (lane % 4) + h, lane / 4} : Coord{lane / 4, 2 * (lane % 4) + h};
}
PLATEAU_MMA_HD constexpr int LdmatrixARow(int lane, int row0, int k0, int ld) {
  return (row0 + 8 * (lane / 8 % 2) + lane % 8) * ld + k0 + 8 * (lane / 16);
}
PLATEAU_MMA_HD constexpr int LdmatrixBRow(int lane, int k0, int n0, int ld) {
  return (n0 + 8 * (lane / 16) + lane % 8) * ld + k0 + 8 * (lane / 8 % 2);
}
PLATEAU_MMA_HD constexpr int LdmatrixBTransRow(int lane, int k0, int n0, int ld) {
  return (k0 + 8 * (lane / 8 % 2) + lane % 8) * ld + n0 + 8 * (lane / 16);
}

}  // namespace plateau::mma

#undef PLATEAU_MMA_HD

#endif  // PLATEAU_KERNELS_CUDA_MMA_LAYOUT_H_
