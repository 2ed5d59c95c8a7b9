// The tensor-core attention kernels' own source
// (cuda_attention_tc_kernels.inc, what nvcc compiles) run on the CPU by the
// SIMT emulation (simt_emulator.h: 128 threads a block, switched at
// __syncthreads, the quad shuffles and the warp-wide mma), against their
// CPU twin (kernels/model/attention_tc.h), with no GPU:
// - every output within 2^-6 of the magnitude it sums (the twin test's
//   tolerance: the two sum in different orders, so a probability or dS can
//   round to the neighbouring bf16 value on one side);
// - the same bits whichever warp runs ahead (three schedules): a missing
//   barrier lets one warp read a tile another has not finished or has
//   already replaced, and changes them;
// - no deadlock, no divergent warp collective, no write past the shared
//   memory the launcher asks for, and nothing read uninitialised (shared
//   memory starts as NaN).
// The emulated mma is the PTX ISA's m16n8k16 table, written out in
// simt_emulator.cc independently of mma_layout.h, summed in double and
// rounded once (the hardware's order differs: within the tolerance). What this cannot see:
// the hardware's own behaviour (timing, the memory model within a barrier
// interval, the real instruction); cuda_attention_tc_twin_test checks the
// kernels on a GPU.
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
#include "kernels/cuda/cuda_attention_tc.h"
#include "kernels/cuda/mma_layout.h"

namespace plateau::cuda_model_ops {
namespace {

#include "kernels/cuda/cuda_attention_tc_kernels.inc"

// Inside this namespace Bf16 is the kernels' (CUDA's) type; the test's data
// is kernels/bf16.h's, the same 16 bits.
using HostBf16 = ::plateau::Bf16;
static_assert(sizeof(HostBf16) == sizeof(__nv_bfloat16), "the same 16 bits");

AttentionDims Dims(const AttentionShape& s) {
  return {s.batch,    s.q_len,  s.kv_len,  s.heads, s.kv_heads,
          s.head_dim, s.q_pos0, s.kv_pos0, s.scale};
}
const __nv_bfloat16* Nv(const HostBf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
__nv_bfloat16* Nv(HostBf16* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
unsigned Tiles(int64_t n) { return static_cast<unsigned>((n + kTile - 1) / kTile); }

// The launchers' grids and shared memory, on the emulation.
template <int D>
std::string Forward(const AttentionShape& s, const HostBf16* q, const HostBf16* k,
                    const HostBf16* v, float* m, float* l, float* acc, simt::Schedule schedule) {
  const AttentionDims d = Dims(s);
  return simt::RunGrid(
      {Tiles(s.q_len), static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch)}, kTcThreads,
      TcSmem<D>::kForward, schedule,
      [&] { AttentionForwardTcKernel<D>(d, Nv(q), Nv(k), Nv(v), m, l, acc); });
}
template <int D>
std::string Backward(const AttentionShape& s, const HostBf16* q, const HostBf16* k,
                     const HostBf16* v, const HostBf16* dout, const float* lse, const float* delta,
                     HostBf16* dq, float* dk, float* dv, simt::Schedule schedule) {
  const AttentionDims d = Dims(s);
  std::string e = simt::RunGrid(
      {Tiles(s.q_len), static_cast<unsigned>(s.heads), static_cast<unsigned>(s.batch)}, kTcThreads,
      TcSmem<D>::kDq, schedule,
      [&] { AttentionDqTcKernel<D>(d, Nv(q), Nv(k), Nv(v), Nv(dout), lse, delta, Nv(dq)); });
  if (!e.empty()) return e;
  return simt::RunGrid(
      {Tiles(s.kv_len), static_cast<unsigned>(s.kv_heads), static_cast<unsigned>(s.batch)},
      kTcThreads, TcSmem<D>::kDkv, schedule,
      [&] { AttentionDkvTcKernel<D>(d, Nv(q), Nv(k), Nv(v), Nv(dout), lse, delta, dk, dv); });
}

// Init, the forward over the blocks, Finalize and Delta on the host
// (attention.h: the same functions both sides use), the backward over the
// blocks given `ref`'s lse and delta (the twin's), so both differentiate
// the same state. `emulated` false: the twin.
AttnTcOut RunPairs(const AttnTcData& d, bool emulated, simt::Schedule schedule,
                   const AttnTcOut* ref) {
  const AttentionShape& s0 = d.shapes[0];
  const bool d64 = s0.head_dim == 64;
  AttnTcOut r;
  r.m.resize(d.rows);
  r.l.resize(d.rows);
  r.o.resize(d.q_size);
  AttentionInitState(s0, r.m.data(), r.l.data(), r.o.data());
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    const HostBf16 *q = d.q.data(), *k = d.k[j].data(), *v = d.v[j].data();
    if (!emulated) {
      TensorCoreAttentionForward(d.shapes[j], q, k, v, r.m.data(), r.l.data(), r.o.data());
      continue;
    }
    const std::string e =
        d64 ? Forward<64>(d.shapes[j], q, k, v, r.m.data(), r.l.data(), r.o.data(), schedule)
            : Forward<128>(d.shapes[j], q, k, v, r.m.data(), r.l.data(), r.o.data(), schedule);
    EXPECT_EQ(e, "") << "forward, block " << j;
  }
  r.lse.resize(d.rows);
  AttentionFinalize(s0, r.m.data(), r.l.data(), r.o.data(), r.lse.data());
  r.delta.resize(d.rows);
  const std::vector<float> dout = Loaded(d.dout);
  AttentionDelta(s0, r.o.data(), dout.data(), r.delta.data());
  const float* lse = ref != nullptr ? ref->lse.data() : r.lse.data();
  const float* delta = ref != nullptr ? ref->delta.data() : r.delta.data();
  std::vector<HostBf16> dq = d.dq0;
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    std::vector<float> dk = d.dk0[j], dv = d.dv0[j];
    const HostBf16 *q = d.q.data(), *k = d.k[j].data(), *v = d.v[j].data(), *dob = d.dout.data();
    if (emulated) {
      const std::string e = d64 ? Backward<64>(d.shapes[j], q, k, v, dob, lse, delta, dq.data(),
                                               dk.data(), dv.data(), schedule)
                                : Backward<128>(d.shapes[j], q, k, v, dob, lse, delta, dq.data(),
                                                dk.data(), dv.data(), schedule);
      EXPECT_EQ(e, "") << "backward, block " << j;
    } else {
      std::vector<float> work(std::max<int64_t>(AttentionWorkspaceFloats(d.shapes[j]), 1));
      TensorCoreAttentionBackward(d.shapes[j], q, k, v, dob, lse, delta, dq.data(), dk.data(),
                                  dv.data(), work.data());
    }
    r.dk.push_back(dk);
    r.dv.push_back(dv);
  }
  r.dq_bits = dq;
  r.dq = Loaded(dq);
  return r;
}

::testing::AssertionResult SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "the results differ between schedules";
}

class EmulatedAttentionTcTest : public ::testing::TestWithParam<AttnTcCase> {};

TEST_P(EmulatedAttentionTcTest, KernelsMatchTheTwinWhicheverWarpRunsAhead) {
  const AttnTcData d = MakeAttnTcData(GetParam(), 2100);
  const AttnTcOut twin = RunPairs(d, /*emulated=*/false, simt::Schedule::kInOrder, nullptr);
  const AttnTcOut kernel = RunPairs(d, /*emulated=*/true, simt::Schedule::kInOrder, &twin);
  ExpectNearTwin(kernel, twin, d, ExactAttention(d));

  for (simt::Schedule other : {simt::Schedule::kReversed, simt::Schedule::kShuffled}) {
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
                             AttnTcCase{"offsets_d128", 1, 100, 70, 2, 1, 128, 10, {60, 0}}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace plateau::cuda_model_ops
