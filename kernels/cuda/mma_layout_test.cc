// mma_layout.h against the PTX ISA's fragment tables for
// mma.m16n8k16 (.bf16 inputs, .f32 accumulators), and the tensor-core
// attention kernels' addressing simulated on the CPU: a warp's 32 lanes
// load their fragments from padded shared-memory tiles through
// AWordOffset / BWordOffset, one simulated instruction (built from the PTX
// table's formulas, written out here independently of mma_layout.h) forms
// the product, and the accumulators are passed on as the next A operand
// (CTileOfA / CFloatOfA), as the forward's S = Q K^T then O = P V and the
// backward's dS K do. Plain C++: no GPU needed, so an index slip fails here.
#include "kernels/cuda/mma_layout.h"

#include <cstdint>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace plateau::mma {
namespace {

// The PTX table, element by element (a0..a7, b0..b3, c0..c3 of one lane).
Coord PtxA(int lane, int i) {
  const int group = lane / 4, quad = lane % 4;
  const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
  const int col = quad * 2 + (i & 1) + (i >= 4 ? 8 : 0);
  return {row, col};
}
Coord PtxB(int lane, int i) {
  const int group = lane / 4, quad = lane % 4;
  return {quad * 2 + (i & 1) + (i >= 2 ? 8 : 0), group};
}
Coord PtxC(int lane, int i) {
  const int group = lane / 4, quad = lane % 4;
  return {i < 2 ? group : group + 8, quad * 2 + (i & 1)};
}

TEST(MmaLayoutTest, FragmentsAreThePtxTables) {
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {  // a_i sits in register i / 2, half i % 2
      const Coord want = PtxA(lane, i), got = AElement(lane, i / 2, i % 2);
      EXPECT_EQ(got.row, want.row) << "A lane " << lane << " a" << i;
      EXPECT_EQ(got.col, want.col) << "A lane " << lane << " a" << i;
    }
    for (int i = 0; i < 4; ++i) {
      const Coord want = PtxB(lane, i), got = BElement(lane, i / 2, i % 2);
      EXPECT_EQ(got.row, want.row) << "B lane " << lane << " b" << i;
      EXPECT_EQ(got.col, want.col) << "B lane " << lane << " b" << i;
      const Coord cw = PtxC(lane, i), cg = CElement(lane, i);
      EXPECT_EQ(cg.row, cw.row) << "C lane " << lane << " c" << i;
      EXPECT_EQ(cg.col, cw.col) << "C lane " << lane << " c" << i;
    }
  }
}

// ldmatrix.x4 as the PTX ISA describes it, written out here: lane
// 4 row + word of register `matrix` receives 32-bit word `word` of row
// `row` (elements 2 word, 2 word + 1) of that matrix, whose row address lane
// 8 matrix + row gave; with .trans, element (i, j) of the result is (j, i)
// of the matrix stored. Returns the offset of the element lane `lane`'s
// register `reg`, half h receives, given each lane's row offset.
template <typename RowOf>
int PtxLdmatrix(int lane, int reg, int h, bool trans, RowOf row_of) {
  const int row = lane / 4, col = 2 * (lane % 4) + h;  // of the result
  return trans ? row_of(8 * reg + col) + row : row_of(8 * reg + row) + col;
}

TEST(MmaLayoutTest, LdmatrixRowsGiveTheFragments) {
  for (const int ld : {72, 136}) {
    for (const auto [base0, k0] : {std::pair{0, 0}, std::pair{16, 8}, std::pair{48, 112}}) {
      for (int lane = 0; lane < 32; ++lane) {
        EXPECT_EQ(LdmatrixARow(lane, base0, k0, ld) % 8, 0) << "16-byte aligned rows";
        EXPECT_EQ(LdmatrixBRow(lane, k0, base0, ld) % 8, 0);
        EXPECT_EQ(LdmatrixBTransRow(lane, k0, base0, ld) % 8, 0);
        for (int h = 0; h < 2; ++h) {
          // One 8 x 8 matrix stored densely: the element is (row, col).
          for (const bool trans : {false, true}) {
            const Coord e = LdmatrixElement(lane, h, trans);
            EXPECT_EQ(PtxLdmatrix(lane, 0, h, trans, [](int l) { return 8 * l; }),
                      8 * e.row + e.col);
          }
          for (int reg = 0; reg < 4; ++reg) {
            // A of the 16 x 16 block at (base0, k0) of a row-major tile.
            const Coord a = AElement(lane, reg, h);
            EXPECT_EQ(PtxLdmatrix(lane, reg, h, false,
                                  [&](int l) { return LdmatrixARow(l, base0, k0, ld); }),
                      (base0 + a.row) * ld + k0 + a.col)
                << "A lane " << lane << " reg " << reg << " half " << h;
            // B of the n8 blocks at base0 and base0 + 8: n-major Y[n][k]
            // without .trans, k-major X[k][n] with it.
            const int n0 = base0 + 8 * (reg / 2);
            const Coord b = BElement(lane, reg % 2, h);
            EXPECT_EQ(PtxLdmatrix(lane, reg, h, false,
                                  [&](int l) { return LdmatrixBRow(l, k0, base0, ld); }),
                      (n0 + b.col) * ld + k0 + b.row)
                << "B lane " << lane << " reg " << reg << " half " << h;
            EXPECT_EQ(PtxLdmatrix(lane, reg, h, true,
                                  [&](int l) { return LdmatrixBTransRow(l, k0, base0, ld); }),
                      (k0 + b.row) * ld + n0 + b.col)
                << "B^T lane " << lane << " reg " << reg << " half " << h;
          }
        }
      }
    }
  }
}

TEST(MmaLayoutTest, EachFragmentCoversItsTileOnce) {
  std::set<std::pair<int, int>> a, b, c;
  for (int lane = 0; lane < 32; ++lane) {
    for (int r = 0; r < kARegs; ++r) {
      for (int h = 0; h < 2; ++h) a.insert({AElement(lane, r, h).row, AElement(lane, r, h).col});
    }
    for (int r = 0; r < kBRegs; ++r) {
      for (int h = 0; h < 2; ++h) b.insert({BElement(lane, r, h).row, BElement(lane, r, h).col});
    }
    for (int i = 0; i < kCFloats; ++i) c.insert({CElement(lane, i).row, CElement(lane, i).col});
  }
  EXPECT_EQ(a.size(), size_t{kM * kK});
  EXPECT_EQ(b.size(), size_t{kK * kN});
  EXPECT_EQ(c.size(), size_t{kM * kN});
  for (auto [row, col] : a) EXPECT_TRUE(row >= 0 && row < kM && col >= 0 && col < kK);
  for (auto [row, col] : b) EXPECT_TRUE(row >= 0 && row < kK && col >= 0 && col < kN);
  for (auto [row, col] : c) EXPECT_TRUE(row >= 0 && row < kM && col >= 0 && col < kN);
}

TEST(MmaLayoutTest, AccumulatorsPassOnAsTheNextAOperand) {
  // Register reg, half h of A is, in the same lane, float CFloatOfA of C tile
  // CTileOfA, whose columns are A's shifted by 8 per tile.
  for (int lane = 0; lane < 32; ++lane) {
    for (int reg = 0; reg < kARegs; ++reg) {
      for (int h = 0; h < 2; ++h) {
        const Coord a = AElement(lane, reg, h);
        const Coord c = CElement(lane, CFloatOfA(reg, h));
        EXPECT_EQ(a.row, c.row);
        EXPECT_EQ(a.col, c.col + kN * CTileOfA(reg));
      }
    }
  }
}

// One lane's registers, as floats (the values bf16 would hold).
struct Regs {
  float a[kARegs][2];
  float b[kBRegs][2];
};

// The instruction, from the PTX table: C[lane][i] += (A B)(row, col).
void WarpMma(std::vector<std::vector<double>>& c, const std::vector<Regs>& regs) {
  double A[kM][kK], B[kK][kN];
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i)
      A[PtxA(lane, i).row][PtxA(lane, i).col] = regs[lane].a[i / 2][i % 2];
    for (int i = 0; i < 4; ++i)
      B[PtxB(lane, i).row][PtxB(lane, i).col] = regs[lane].b[i / 2][i % 2];
  }
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const Coord at = PtxC(lane, i);
      for (int k = 0; k < kK; ++k) c[lane][i] += A[at.row][k] * B[k][at.col];
    }
  }
}

// A 32-bit word of a tile: the two values at offset and offset + 1.
void Word(const std::vector<float>& tile, int offset, float out[2]) {
  out[0] = tile[offset];
  out[1] = tile[offset + 1];
}

TEST(MmaLayoutTest, TheKernelsAddressingFormsQKThenPV) {
  // One warp's 16 query rows against a 64-key tile, head_dim 32, the shared
  // tiles padded by 8 elements per row as the kernels pad them.
  constexpr int kRows = 16, kKeys = 64, kDim = 32, kPad = 8;
  constexpr int ldq = kDim + kPad, ldk = kDim + kPad, ldvt = kKeys + kPad;
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> small(-8, 8);  // exact in float and double
  std::vector<float> q(kRows * ldq, 1e30f), k(kKeys * ldk, 1e30f), vt(kDim * ldvt, 1e30f);
  for (int r = 0; r < kRows; ++r) {
    for (int d = 0; d < kDim; ++d) q[r * ldq + d] = static_cast<float>(small(rng));
  }
  for (int j = 0; j < kKeys; ++j) {
    for (int d = 0; d < kDim; ++d) k[j * ldk + d] = static_cast<float>(small(rng));
  }
  for (int d = 0; d < kDim; ++d) {  // V transposed: vt[d][key]
    for (int j = 0; j < kKeys; ++j) vt[d * ldvt + j] = static_cast<float>(small(rng));
  }
  // S = Q K^T: kKeys / kN accumulator tiles per lane.
  constexpr int kSTiles = kKeys / kN;
  std::vector<std::vector<std::vector<double>>> s(
      kSTiles, std::vector<std::vector<double>>(32, std::vector<double>(4, 0.0)));
  for (int kk = 0; kk < kDim / kK; ++kk) {
    for (int n = 0; n < kSTiles; ++n) {
      std::vector<Regs> regs(32);
      for (int lane = 0; lane < 32; ++lane) {
        for (int r = 0; r < kARegs; ++r)
          Word(q, AWordOffset(lane, r, 0, kk * kK, ldq), regs[lane].a[r]);
        for (int r = 0; r < kBRegs; ++r) {
          Word(k, BWordOffset(lane, r, kk * kK, n * kN, ldk), regs[lane].b[r]);
        }
      }
      WarpMma(s[n], regs);
    }
  }
  for (int n = 0; n < kSTiles; ++n) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int i = 0; i < 4; ++i) {
        const Coord at = CElement(lane, i);
        double want = 0;
        for (int d = 0; d < kDim; ++d)
          want += double{q[at.row * ldq + d]} * k[(n * kN + at.col) * ldk + d];
        ASSERT_EQ(s[n][lane][i], want) << "S tile " << n << " lane " << lane << " c" << i;
      }
    }
  }
  // O = S V with S passed on as A (kKeys / kK steps), V^T n-major.
  constexpr int kOTiles = kDim / kN;
  std::vector<std::vector<std::vector<double>>> o(
      kOTiles, std::vector<std::vector<double>>(32, std::vector<double>(4, 0.0)));
  for (int kk = 0; kk < kKeys / kK; ++kk) {
    for (int n = 0; n < kOTiles; ++n) {
      std::vector<Regs> regs(32);
      for (int lane = 0; lane < 32; ++lane) {
        for (int r = 0; r < kARegs; ++r) {
          for (int h = 0; h < 2; ++h) {
            regs[lane].a[r][h] = static_cast<float>(s[2 * kk + CTileOfA(r)][lane][CFloatOfA(r, h)]);
          }
        }
        for (int r = 0; r < kBRegs; ++r) {
          Word(vt, BWordOffset(lane, r, kk * kK, n * kN, ldvt), regs[lane].b[r]);
        }
      }
      WarpMma(o[n], regs);
    }
  }
  for (int n = 0; n < kOTiles; ++n) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int i = 0; i < 4; ++i) {
        const Coord at = CElement(lane, i);
        double want = 0;
        for (int j = 0; j < kKeys; ++j) {
          double sv = 0;
          for (int d = 0; d < kDim; ++d) sv += double{q[at.row * ldq + d]} * k[j * ldk + d];
          want += sv * vt[(n * kN + at.col) * ldvt + j];
        }
        ASSERT_EQ(o[n][lane][i], want) << "O tile " << n << " lane " << lane << " c" << i;
      }
    }
  }
}

}  // namespace
}  // namespace plateau::mma
