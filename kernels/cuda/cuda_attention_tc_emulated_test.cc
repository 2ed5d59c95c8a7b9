// The tensor-core attention kernels' own source
// (cuda_attention_tc_kernels.inc, what nvcc compiles) run on the CPU by the
// SIMT emulation (simt_emulator.h: 128 threads a block, switched at
// __syncthreads, the quad shuffles and the warp-wide mma and ldmatrix),
// against their CPU twin (kernels/model/attention_tc.h), with no GPU:
// - every output within 2^-6 of the magnitude it sums (the twin test's
//   tolerance: the two sum in different orders, so a probability or dS can
//   round to the neighbouring bf16 value on one side);
// - the same bits whichever warp runs ahead (three schedules), single- or
//   double-buffered, and with cp.async copies landing at their wait (the
//   latest) or at their issue (the earliest): a missing barrier or wait
//   lets one warp read a tile that has not arrived or has already been
//   replaced, and changes them;
// - no deadlock, no divergent warp collective, no write past the shared
//   memory the launcher asks for, and nothing read uninitialised (shared
//   memory starts as NaN).
// The emulated mma is the PTX ISA's m16n8k16 table, written out in
// simt_emulator.cc independently of mma_layout.h, summed in double and
// rounded once (the hardware's order differs: within the tolerance); its
// ldmatrix is the PTX ISA's description, written out there too. What this
// cannot see: the hardware's own behaviour (timing, the memory model within
// a barrier interval, the real instructions); cuda_attention_tc_twin_test
// checks the kernels on a GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/model/attention.h"
#include "kernels/model/attention_tc.h"
#include "kernels/testing/attention_tc_testing.h"
// After the host headers: the emulation defines CUDA's keywords.
#include "kernels/cuda/simt_emulator.h"
// Then the kernels' headers, which use it.
#include "kernels/cuda/cp_async.h"
#include "kernels/cuda/cuda_attention_tc.h"
#include "kernels/cuda/mma_layout.h"
#include "kernels/cuda/wgmma_instructions.h"
#include "kernels/cuda/wgmma_layout.h"

namespace plateau::cuda_model_ops {
namespace {

#include "kernels/cuda/cuda_attention_tc_kernels.inc"
#include "kernels/cuda/cuda_attention_wgmma_kernels.inc"

// Inside this namespace Bf16 is the kernels' (CUDA's) type; the test's data
// is kernels/bf16.h's, the same 16 bits.
using HostBf16 = ::plateau::Bf16;
static_assert(sizeof(HostBf16) == sizeof(__nv_bfloat16), "the same 16 bits");
// cuda_attention_tc.h mirrors the twin's constants (nvcc does not see
// attention_tc.h): the tiles fix where p rounds, the base changes its value.
static_assert(kAttentionTcTileRows == ::plateau::kAttentionTcTile &&
                  kAttentionTcLog2e == ::plateau::kAttentionTcLog2e &&
                  kAttentionTcLn2 == ::plateau::kAttentionTcLn2,
              "the kernels' tile and base-2 constants are the twin's");

AttentionDims Dims(const AttentionShape& s) {
  return {s.batch,    s.q_len,  s.kv_len,  s.heads, s.kv_heads,
          s.head_dim, s.q_pos0, s.kv_pos0, s.scale};
}
const __nv_bfloat16* Nv(const HostBf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
__nv_bfloat16* Nv(HostBf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
unsigned Tiles(int64_t n) { return static_cast<unsigned>((n + kTile - 1) / kTile); }

// The launchers' grids and shared memory, on the emulation, with kStages
// buffers of the streamed tiles.
template <int D, int kStages>
std::string Forward(const AttentionShape& s, const HostBf16* q, const HostBf16* k,
                    const HostBf16* v, float* m, float* l, float* acc, simt::Schedule schedule) {
  const AttentionDims d = Dims(s);
  return simt::RunGrid(
      {Tiles(s.q_len), static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch)}, kTcThreads,
      TcSmem<D, kStages>::kForward, schedule,
      [&] { AttentionForwardTcKernel<D, kStages>(d, Nv(q), Nv(k), Nv(v), m, l, acc); });
}
template <int D, int kStages>
std::string ForwardWg(const AttentionShape& s, const HostBf16* q, const HostBf16* k,
                      const HostBf16* v, float* m, float* l, float* acc, simt::Schedule schedule) {
  const AttentionDims d = Dims(s);
  return simt::RunGrid(
      {Tiles(s.q_len), static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch)}, kTcThreads,
      WgSmem<D, kStages>::kForward, schedule,
      [&] { AttentionForwardWgKernel<D, kStages>(d, Nv(q), Nv(k), Nv(v), m, l, acc); });
}
// With `wgmma`, the dQ and dK/dV kernels on wgmma
// (cuda_attention_wgmma_kernels.inc).
template <int D, int kStages>
std::string Backward(const AttentionShape& s, const HostBf16* q, const HostBf16* k, const HostBf16* v,
                     const HostBf16* dout, const float* lse, const float* delta, float* dq, float* dk, float* dv,
                     simt::Schedule schedule, bool wgmma) {
  const AttentionDims d = Dims(s);
  const SimtDim3 qgrid = {Tiles(s.q_len), static_cast<unsigned>(s.heads),
                          static_cast<unsigned>(s.batch)};
  const auto dq_wgmma = [&] { AttentionDqWgKernel<D, kStages>(d, Nv(q), Nv(k), Nv(v), Nv(dout), lse, delta, dq); };
  const auto dq_mma = [&] { AttentionDqTcKernel<D, kStages>(d, Nv(q), Nv(k), Nv(v), Nv(dout), lse, delta, dq); };
  std::string e =
      wgmma ? simt::RunGrid(qgrid, kTcThreads, WgDqSmem<D, kStages>::kDq, schedule, dq_wgmma)
            : simt::RunGrid(qgrid, kTcThreads, TcSmem<D, kStages>::kDq, schedule, dq_mma);
  if (!e.empty()) return e;
  const SimtDim3 kgrid = {Tiles(s.kv_len), static_cast<unsigned>(s.kv_heads),
                          static_cast<unsigned>(s.batch)};
  const auto dkv_wgmma = [&] {
    AttentionDkvWgKernel<D, kStages>(d, Nv(q), Nv(k), Nv(v), Nv(dout), lse, delta, dk, dv);
  };
  const auto dkv_mma = [&] {
    AttentionDkvTcKernel<D, kStages>(d, Nv(q), Nv(k), Nv(v), Nv(dout), lse, delta, dk, dv);
  };
  return wgmma ? simt::RunGrid(kgrid, kTcThreads, WgDkvSmem<D, kStages>::kDkv, schedule, dkv_wgmma)
               : simt::RunGrid(kgrid, kTcThreads, TcSmem<D, kStages>::kDkv, schedule, dkv_mma);
}

// `x` followed by `pad` NaNs: the kernels read no element past an input
// (a tile's rows past the sequence are zero-filled, not read), and one
// read there would carry NaN into the outputs.
std::vector<HostBf16> NanTailed(const std::vector<HostBf16>& x, int64_t pad) {
  std::vector<HostBf16> out = x;
  out.resize(x.size() + pad, HostBf16{0x7fc0});
  return out;
}

// Which kernels RunPairs runs, and how.
struct Emulation {
  int stages;
  simt::Schedule schedule;
  simt::CopyLanding landing = simt::CopyLanding::kAtWait;
  bool wgmma = false;  // all three kernels on wgmma (cuda_attention_wgmma_kernels.inc)
  simt::WgmmaCompletion completion = simt::WgmmaCompletion::kAtWait;
};

// Init, the forward over the blocks, Finalize and Delta on the host
// (attention.h: the same functions both sides use), the backward over the
// blocks given `ref`'s lse and delta (the twin's), so both differentiate
// the same state. `emulated` false: the twin.
AttnTcOut RunPairs(const AttnTcData& d, bool emulated, Emulation run, const AttnTcOut* ref) {
  const AttentionShape& s0 = d.shapes[0];
  const bool d64 = s0.head_dim == 64;
  const simt::ScopedCopyLanding landing(run.landing);
  AttnTcOut r;
  r.m.resize(d.rows);
  r.l.resize(d.rows);
  r.o.resize(d.q_size);
  AttentionInitState(s0, r.m.data(), r.l.data(), r.o.data());
  // The inputs the kernels see, each followed by a tile of NaN rows.
  const int64_t q_pad = kTile * s0.heads * s0.head_dim, kv_pad = kTile * s0.kv_heads * s0.head_dim;
  const std::vector<HostBf16> gq = NanTailed(d.q, q_pad), gdout = NanTailed(d.dout, q_pad);
  std::vector<std::vector<HostBf16>> gk, gv;
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    gk.push_back(NanTailed(d.k[j], kv_pad));
    gv.push_back(NanTailed(d.v[j], kv_pad));
  }
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    const HostBf16 *q = d.q.data(), *k = d.k[j].data(), *v = d.v[j].data();
    if (emulated) q = gq.data(), k = gk[j].data(), v = gv[j].data();
    if (!emulated) {
      TensorCoreAttentionForward(d.shapes[j], q, k, v, r.m.data(), r.l.data(), r.o.data());
      continue;
    }
    float *m = r.m.data(), *l = r.l.data(), *o = r.o.data();
    const simt::Schedule at = run.schedule;
    auto forward = d64 ? (run.stages == 1 ? Forward<64, 1> : Forward<64, 2>)
                       : (run.stages == 1 ? Forward<128, 1> : Forward<128, 2>);
    if (run.wgmma) {
      forward = d64 ? (run.stages == 1 ? ForwardWg<64, 1> : ForwardWg<64, 2>)
                    : (run.stages == 1 ? ForwardWg<128, 1> : ForwardWg<128, 2>);
    }
    simt::SetWgmmaCompletion(run.completion);
    const std::string e = forward(d.shapes[j], q, k, v, m, l, o, at);
    simt::SetWgmmaCompletion(simt::WgmmaCompletion::kAtWait);
    EXPECT_EQ(e, "") << "forward, block " << j;
  }
  r.lse.resize(d.rows);
  AttentionFinalize(s0, r.m.data(), r.l.data(), r.o.data(), r.lse.data());
  r.delta.resize(d.rows);
  const std::vector<float> dout = Loaded(d.dout);
  AttentionDelta(s0, r.o.data(), dout.data(), r.delta.data());
  const float* lse = ref != nullptr ? ref->lse.data() : r.lse.data();
  const float* delta = ref != nullptr ? ref->delta.data() : r.delta.data();
  std::vector<float> dq = Loaded(d.dq0);
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    std::vector<float> dk = d.dk0[j], dv = d.dv0[j];
    const HostBf16 *q = d.q.data(), *k = d.k[j].data(), *v = d.v[j].data(), *dob = d.dout.data();
    if (emulated) {
      q = gq.data(), k = gk[j].data(), v = gv[j].data(), dob = gdout.data();
      auto backward = d64 ? (run.stages == 1 ? Backward<64, 1> : Backward<64, 2>)
                          : (run.stages == 1 ? Backward<128, 1> : Backward<128, 2>);
      simt::SetWgmmaCompletion(run.completion);
      const std::string e = backward(d.shapes[j], q, k, v, dob, lse, delta, dq.data(), dk.data(),
                                     dv.data(), run.schedule, run.wgmma);
      simt::SetWgmmaCompletion(simt::WgmmaCompletion::kAtWait);
      EXPECT_EQ(e, "") << "backward, block " << j;
    } else {
      std::vector<float> work(std::max<int64_t>(AttentionWorkspaceFloats(d.shapes[j]), 1));
      TensorCoreAttentionBackward(d.shapes[j], q, k, v, dob, lse, delta, dq.data(), dk.data(),
                                  dv.data(), work.data());
    }
    r.dk.push_back(dk);
    r.dv.push_back(dv);
  }
  r.dq = dq;
  return r;
}

::testing::AssertionResult SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "the results differ";
}

class EmulatedAttentionTcTest : public ::testing::TestWithParam<AttnTcCase> {};

TEST_P(EmulatedAttentionTcTest, KernelsMatchTheTwinWhicheverWarpRunsAhead) {
  const AttnTcData d = MakeAttnTcData(GetParam(), 2100);
  const AttnTcOut twin = RunPairs(d, /*emulated=*/false, {1, simt::Schedule::kInOrder}, nullptr);
  const AttnTcOut kernel = RunPairs(d, /*emulated=*/true, {1, simt::Schedule::kInOrder}, &twin);
  ExpectNearTwin(kernel, twin, d, ExactAttention(d));

  // The same bits whichever warp runs ahead, double-buffered, and with the
  // copies landing as early as a GPU may (a buffer refilled before every
  // warp is done reading it) as well as as late.
  constexpr simt::CopyLanding kEarly = simt::CopyLanding::kAtIssue;
  for (Emulation other :
       {Emulation{1, simt::Schedule::kReversed}, Emulation{1, simt::Schedule::kShuffled},
        Emulation{2, simt::Schedule::kInOrder}, Emulation{2, simt::Schedule::kShuffled},
        Emulation{1, simt::Schedule::kReversed, kEarly},
        Emulation{2, simt::Schedule::kReversed, kEarly},
        Emulation{2, simt::Schedule::kShuffled, kEarly},
        // The wgmma kernels: the emulation sums each 16-deep k-step in
        // double and rounds once, as its mma.sync, in the same order, so the
        // same bits as the mma.sync kernels, with the results landing at the
        // wait or at the issue.
        Emulation{1, simt::Schedule::kInOrder, simt::CopyLanding::kAtWait, true},
        Emulation{2, simt::Schedule::kShuffled, simt::CopyLanding::kAtWait, true},
        Emulation{2, simt::Schedule::kReversed, kEarly, true, simt::WgmmaCompletion::kAtIssue},
        Emulation{1, simt::Schedule::kShuffled, kEarly, true, simt::WgmmaCompletion::kAtIssue}}) {
    SCOPED_TRACE(::testing::Message()
                 << other.stages << " stage(s), schedule " << static_cast<int>(other.schedule)
                 << (other.landing == kEarly ? ", copies landing at issue" : "")
                 << (other.wgmma ? ", on wgmma" : "")
                 << (other.completion == simt::WgmmaCompletion::kAtIssue ? " completing at issue"
                                                                         : ""));
    const AttnTcOut again = RunPairs(d, /*emulated=*/true, other, &twin);
    EXPECT_TRUE(SameBits(again.m, kernel.m));
    EXPECT_TRUE(SameBits(again.l, kernel.l));
    EXPECT_TRUE(SameBits(again.o, kernel.o));
    EXPECT_TRUE(SameBits(again.dq, kernel.dq));
    for (size_t j = 0; j < d.shapes.size(); ++j) {
      EXPECT_TRUE(SameBits(again.dk[j], kernel.dk[j]));
      EXPECT_TRUE(SameBits(again.dv[j], kernel.dv[j]));
    }
  }
}

// The emulation catches what it is for: a kernel that skips a barrier is
// told apart (a deadlock here: only some threads reach it).
TEST(SimtEmulatorTest, ABarrierNotEveryThreadReachesIsADeadlock) {
  const std::string e = simt::RunGrid({1, 1, 1}, 64, 16, simt::Schedule::kInOrder, [] {
    if (threadIdx.x < 32) __syncthreads();
  });
  EXPECT_NE(e.find("deadlock"), std::string::npos) << e;
  const std::string past = simt::RunGrid({1, 1, 1}, 32, 16, simt::Schedule::kInOrder,
                                         [] { simt::SharedMemory()[16 + threadIdx.x] = 0; });
  EXPECT_NE(past.find("past the block's shared memory"), std::string::npos) << past;
  EXPECT_EQ(simt::RunGrid({2, 1, 1}, 64, 16, simt::Schedule::kShuffled, [] { __syncthreads(); }),
            "");
}

// ldmatrix through mma_layout.h's rows hands each lane the fragment the
// per-word loads of the PTX fragment tables (AWordOffset, BWordOffset) give:
// A and n-major B without .trans, k-major B (V for P V) with it. The
// emulated ldmatrix is written from the PTX ISA apart from mma_layout.h.
TEST(SimtEmulatorTest, LdmatrixGivesTheFragmentsOfTheTables) {
  constexpr int kLd = 72, kRows = 32;
  int mismatches = 0, checked = 0;
  const std::string e =
      simt::RunGrid({1, 1, 1}, 32, kRows * kLd * 2, simt::Schedule::kShuffled, [&] {
        auto* tile = reinterpret_cast<Bf16*>(simt::SharedMemory());
        for (int i = threadIdx.x; i < kRows * kLd; i += 32) tile[i].bits = static_cast<uint16_t>(i);
        __syncthreads();
        const int lane = threadIdx.x % 32;
        auto word = [&](int offset) {  // two elements, the lower offset low
          return uint32_t{tile[offset].bits} | uint32_t{tile[offset + 1].bits} << 16;
        };
        auto expect = [&](uint32_t got, uint32_t want) {
          ++checked;
          if (got != want) ++mismatches;
        };
        uint32_t a[4], b[4], bt[4];
        LoadA(tile, 16, 8, kLd, a);
        LoadB2(tile, 8, 16, kLd, b);
        LoadB2Trans(tile, 16, 8, kLd, bt);
        for (int r = 0; r < 4; ++r) {
          expect(a[r], word(mma::AWordOffset(lane, r, 16, 8, kLd)));
          expect(b[r], word(mma::BWordOffset(lane, r % 2, 8, 16 + 8 * (r / 2), kLd)));
          // k-major X[k][n]: B[k][n] is X's element (k, n) itself.
          uint32_t want = 0;
          for (int h = 0; h < 2; ++h) {
            const mma::Coord at = mma::BElement(lane, r % 2, h);
            want |= uint32_t{tile[(16 + at.row) * kLd + 8 + 8 * (r / 2) + at.col].bits} << (16 * h);
          }
          expect(bt[r], want);
        }
      });
  EXPECT_EQ(e, "");
  EXPECT_EQ(checked, 32 * 4 * 3);
  EXPECT_EQ(mismatches, 0);
}

TEST(SimtEmulatorTest, LdmatrixTakesAlignedRowsOfSharedMemoryOnly) {
  static Bf16 global[64];
  const std::string misaligned = simt::RunGrid({1, 1, 1}, 32, 1024, simt::Schedule::kInOrder, [] {
    uint32_t r[4];
    const auto* tile = reinterpret_cast<const Bf16*>(simt::SharedMemory());
    LdMatrixX4(r, tile + 8 * (threadIdx.x % 32) + (threadIdx.x == 5 ? 1 : 0));
  });
  EXPECT_NE(misaligned.find("ldmatrix: lane 5's row is not 16 aligned bytes"), std::string::npos)
      << misaligned;
  const std::string outside = simt::RunGrid({1, 1, 1}, 32, 1024, simt::Schedule::kInOrder, [] {
    uint32_t r[4];
    LdMatrixX4Trans(r, global);
  });
  EXPECT_NE(outside.find("of the block's shared memory"), std::string::npos) << outside;
}

// A copy lands at its thread's wait for its group, not before: what a
// kernel reading too early would see is the old bytes; src-size zero-fills.
TEST(SimtEmulatorTest, CpAsyncLandsAtTheWaitForItsGroup) {
  alignas(16) static uint8_t src[32];
  for (int i = 0; i < 32; ++i) src[i] = static_cast<uint8_t>(i + 1);
  std::vector<int> seen;
  const std::string e = simt::RunGrid({1, 1, 1}, 32, 64, simt::Schedule::kInOrder, [&] {
    if (threadIdx.x != 0) return;
    auto* dst = reinterpret_cast<Bf16*>(simt::SharedMemory());
    const auto* from = reinterpret_cast<const Bf16*>(src);
    const uint8_t* bytes = simt::SharedMemory();
    CpAsync16(dst, from, 16);
    CpAsyncCommit();
    CpAsync16(dst + 8, from + 8, 4);  // 4 bytes, then 12 zeros
    CpAsyncCommit();
    seen.push_back(bytes[0]);  // 0xFF: nothing landed
    CpAsyncWait<1>();          // the first group only
    seen.push_back(bytes[0]);
    seen.push_back(bytes[16]);
    CpAsyncWait<0>();
    seen.push_back(bytes[16]);
    seen.push_back(bytes[19]);
    seen.push_back(bytes[20]);
  });
  EXPECT_EQ(e, "");
  EXPECT_EQ(seen, (std::vector<int>{0xFF, 1, 0xFF, 17, 20, 0}));

  // Landing at issue: the bytes are there at once, and the wait (which
  // still counts) does not land them again over a later store.
  std::vector<int> early;
  std::string at_issue;
  {
    const simt::ScopedCopyLanding landing(simt::CopyLanding::kAtIssue);
    at_issue = simt::RunGrid({1, 1, 1}, 32, 64, simt::Schedule::kInOrder, [&] {
      if (threadIdx.x != 0) return;
      CpAsync16(reinterpret_cast<Bf16*>(simt::SharedMemory()), reinterpret_cast<const Bf16*>(src),
                16);
      early.push_back(simt::SharedMemory()[0]);
      simt::SharedMemory()[0] = 0x42;
      CpAsyncCommit();
      CpAsyncWait<0>();
      early.push_back(simt::SharedMemory()[0]);
    });
  }
  EXPECT_EQ(at_issue, "");
  EXPECT_EQ(early, (std::vector<int>{1, 0x42}));

  const std::string never = simt::RunGrid({1, 1, 1}, 32, 64, simt::Schedule::kInOrder, [] {
    CpAsync16(reinterpret_cast<Bf16*>(simt::SharedMemory()), reinterpret_cast<const Bf16*>(src),
              16);
    CpAsyncCommit();
  });
  EXPECT_NE(never.find("cp.async copies it never waited for"), std::string::npos) << never;
  const std::string misaligned = simt::RunGrid({1, 1, 1}, 32, 64, simt::Schedule::kInOrder, [] {
    CpAsync16(reinterpret_cast<Bf16*>(simt::SharedMemory() + 8), reinterpret_cast<const Bf16*>(src),
              16);
  });
  EXPECT_NE(misaligned.find("not 16-byte aligned"), std::string::npos) << misaligned;
}

// Tiles are 64 rows and 64 keys. Small shapes: each block of threads is
// emulated, so a case costs seconds.
INSTANTIATE_TEST_SUITE_P(Shapes, EmulatedAttentionTcTest,
                         ::testing::Values(
                             // GQA 2, head_dim 64: 150 keys (three tiles, the last partial),
                             // queries past the first tile, a block wholly after the queries.
                             AttnTcCase{"gqa2_d64_tiles", 1, 70, 150, 4, 2, 64, 150, {150, 0, 300}},
                             // GQA 1, batch 2, head_dim 64: the own block, then the earlier one.
                             AttnTcCase{"gqa1_d64_ring", 2, 37, 37, 2, 2, 64, 37, {37, 0}},
                             // GQA 4, head_dim 128, more keys than queries from position 0.
                             AttnTcCase{"gqa4_d128", 1, 33, 80, 4, 1, 128, 0, {0}},
                             // head_dim 128, queries before the keys of the first block, offsets
                             // off the tile edges.
                             AttnTcCase{"offsets_d128", 1, 100, 70, 2, 1, 128, 10, {60, 0}},
                             // head_dim 128, three key tiles per query tile (six
                             // dK/dV steps): every double-buffered kernel refills a buffer.
                             AttnTcCase{"tiles_d128", 1, 140, 140, 2, 1, 128, 0, {0}}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace plateau::cuda_model_ops
