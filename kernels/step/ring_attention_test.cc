// Ring attention on the working precision (ring_attention.h) over P Gloo
// ranks: RingAttentionT<Bf16> on bf16 q, K/V and dO against
// RingAttentionT<float> on the same (bf16-representable) values. The
// forward keeps its whole state fp32, so o and lse are the fp32 ring's
// bits, and so is delta; the travelling dK/dV accumulators and the dq
// accumulator are fp32, so dkv and dq are the fp32 ring's rounded once
// (dq once in all, not once per hop: a per-hop rounding is P roundings of
// a sum). Repeated runs give the same bits.
#include "kernels/step/ring_attention.h"

#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/communicator.h"
#include "kernels/model/attention.h"
#include "kernels/model/model_kernels.h"
#include "kernels/testing/bf16_testing.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

// One rank's device buffers, allocated from its backend and kept alive.
class Device {
 public:
  Device(Backend& be, Stream& s) : be_(be), s_(s) {}
  template <typename T>
  T* Alloc(int64_t n) {
    auto b = be_.device().Allocate(LiveSet::kActivations, n * sizeof(T));
    EXPECT_TRUE(b.ok()) << b.status();
    bufs_.push_back(std::move(*b));
    return bufs_.back().as<T>();
  }
  template <typename T>
  T* Upload(const std::vector<T>& v) {
    T* d = Alloc<T>(static_cast<int64_t>(v.size()));
    EXPECT_TRUE(be_.Copy(s_, d, v.data(), v.size() * sizeof(T)).ok());
    return d;
  }
  template <typename T>
  std::vector<T> Download(const T* d, int64_t n) {
    std::vector<T> v(n);
    EXPECT_TRUE(be_.Copy(s_, v.data(), d, n * sizeof(T)).ok());
    EXPECT_TRUE(s_.Synchronize().ok());
    return v;
  }

 private:
  Backend& be_;
  Stream& s_;
  std::vector<Buffer> bufs_;
};

void CheckRing(int P) {
  const int64_t B = 2, Ns = 8, nh = 4, kvh = 2, d = 8;
  const int64_t N = B * Ns, nq = N * nh * d, n = N * kvh * d, rows_h = N * nh;
  auto q_of = [&](int r) { return Representable(nq, 100 + r); };
  auto kv_of = [&](int r) { return Representable(2 * n, 200 + r); };
  auto do_of = [&](int r) { return Representable(nq, 300 + r); };
  absl::Status st = RunLocalWorld(P, 64 << 20, FreshStoreDir("ring_bf16"), [&](int r, Backend& be,
                                                                              Communicator& world) {
    auto kernels = ModelKernels::Create(be);
    auto compute = be.CreateStream("compute");
    auto comm = be.CreateStream("comm");
    auto ev1 = be.CreateEvent();
    auto ev2 = be.CreateEvent();
    EXPECT_TRUE(kernels.ok() && compute.ok() && comm.ok() && ev1.ok() && ev2.ok());
    if (!kernels.ok() || !compute.ok() || !comm.ok() || !ev1.ok() || !ev2.ok()) {
      return absl::InternalError("setup");
    }
    Stream& cs = **compute;
    Device dev(be, cs);
    const AttentionShape shape{B, Ns, Ns, nh, kvh, d, r * Ns, 0, 1.0f / std::sqrt(float(d))};
    const std::vector<float> q = q_of(r), kv = kv_of(r), dO = do_of(r);
    const int64_t wf = AttentionWorkspaceFloats(shape);
    RingAttentionT<float> f32{be, **kernels, world, cs, **comm, **ev1, **ev2, shape, N};
    RingAttentionT<Bf16> b16{be, **kernels, world, cs, **comm, **ev1, **ev2, shape, N};

    // fp32.
    float *o_f = dev.Alloc<float>(nq), *lse_f = dev.Alloc<float>(rows_h);
    float *delta_f = dev.Alloc<float>(rows_h), *dq_f = dev.Alloc<float>(nq);
    float* dkv_f = dev.Alloc<float>(2 * n);
    {
      const float *dq_in = dev.Upload(q), *dkv_in = dev.Upload(kv), *ddo = dev.Upload(dO);
      float* ml = dev.Alloc<float>(2 * rows_h);
      float* work = dev.Alloc<float>(wf);
      EXPECT_TRUE(f32.Forward(dq_in, dkv_in, ml, o_f, lse_f, dev.Alloc<float>(4 * n), work).ok());
      EXPECT_TRUE(kernels.value()->AttentionDelta(cs, shape, o_f, ddo, delta_f).ok());
      void* trav = dev.Alloc<char>(2 * RingAttentionT<float>::TravellerBytes(n));
      EXPECT_TRUE(f32.Backward(dq_in, dkv_in, ddo, lse_f, delta_f, dq_f, dkv_f, trav, work, nullptr).ok());
    }
    // bf16, twice.
    const Bf16 *qb = dev.Upload(Rounded(q)), *kvb = dev.Upload(Rounded(kv)), *dob = dev.Upload(Rounded(dO));
    std::vector<Bf16> dq_runs[2], dkv_runs[2];
    std::vector<float> o_b, lse_b, delta_b;
    for (int run = 0; run < 2; ++run) {
      float *o = dev.Alloc<float>(nq), *lse = dev.Alloc<float>(rows_h), *delta = dev.Alloc<float>(rows_h);
      Bf16 *dq = dev.Alloc<Bf16>(nq), *dkv = dev.Alloc<Bf16>(2 * n);
      float* ml = dev.Alloc<float>(2 * rows_h);
      float* work = dev.Alloc<float>(wf);
      EXPECT_TRUE(b16.Forward(qb, kvb, ml, o, lse, dev.Alloc<Bf16>(4 * n), work).ok());
      EXPECT_TRUE(kernels.value()->AttentionDeltaBf16(cs, shape, o, dob, delta).ok());
      void* trav = dev.Alloc<char>(2 * RingAttentionT<Bf16>::TravellerBytes(n));
      if (run == 0) {
        // Refused before any exchange (so on every rank alike): bf16 without
        // its fp32 accumulator, fp32 with one.
        const absl::Status none = b16.Backward(qb, kvb, dob, lse, delta, dq, dkv, trav, work, nullptr);
        EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument) << none;
        EXPECT_NE(none.message().find("dq_acc"), std::string::npos) << none;
        const absl::Status extra = f32.Backward(dev.Upload(q), dev.Upload(kv), dev.Upload(dO), lse_f, delta_f, dq_f,
                                                dkv_f, trav, work, dev.Alloc<float>(nq));
        EXPECT_EQ(extra.code(), absl::StatusCode::kInvalidArgument) << extra;
      }
      // The accumulator poisoned: the ring must fill it before the first hop.
      float* dq_acc = dev.Upload(std::vector<float>(nq, std::nanf("")));
      EXPECT_TRUE(b16.Backward(qb, kvb, dob, lse, delta, dq, dkv, trav, work, dq_acc).ok());
      dq_runs[run] = dev.Download(dq, nq);
      dkv_runs[run] = dev.Download(dkv, 2 * n);
      if (run == 0) {
        o_b = dev.Download(o, nq);
        lse_b = dev.Download(lse, rows_h);
        delta_b = dev.Download(delta, rows_h);
      }
    }
    EXPECT_TRUE((*comm)->Synchronize().ok());
    const std::vector<float> o32 = dev.Download(o_f, nq), lse32 = dev.Download(lse_f, rows_h);
    const std::vector<float> delta32 = dev.Download(delta_f, rows_h);
    EXPECT_EQ(o_b, o32) << "rank " << r;
    EXPECT_EQ(lse_b, lse32) << "rank " << r;
    EXPECT_EQ(delta_b, delta32) << "rank " << r;
    EXPECT_EQ(Bits(dkv_runs[0]), Bits(Rounded(dev.Download(dkv_f, 2 * n)))) << "rank " << r;
    const std::vector<float> dq32 = dev.Download(dq_f, nq);
    EXPECT_EQ(Bits(dq_runs[0]), Bits(Rounded(dq32))) << "rank " << r;
    // For the record: what a rounding per hop (the ring before it summed dq
    // in fp32) costs against the fp32 ring's dq, reproduced on the host from
    // the fp32 block function in the ring's order.
    std::vector<float> per_hop(nq, 0.0f), dk(n), dv(n), hwork(wf);
    for (int step = 0; step < P; ++step) {
      const int src = (r - step + P) % P;
      const std::vector<float> kvs = kv_of(src);
      AttentionShape s = shape;
      s.kv_pos0 = src * Ns;
      AttentionBackwardBlock(s, q.data(), kvs.data(), kvs.data() + n, dO.data(), lse32.data(), delta32.data(),
                             per_hop.data(), dk.data(), dv.data(), hwork.data());
      for (float& x : per_hop) x = Bf16ToFloat(FloatToBf16(x));
    }
    double err_once = 0, err_hop = 0, mag = 0;
    for (int64_t i = 0; i < nq; ++i) {
      err_once += std::abs(double{Bf16ToFloat(dq_runs[0][i])} - dq32[i]);
      err_hop += std::abs(double{per_hop[i]} - dq32[i]);
      mag += std::abs(double{dq32[i]});
    }
    if (r == P - 1) {
      std::printf("P = %d, rank %d: sum |dq - fp32 dq| / sum |fp32 dq| = %.3g rounded once, %.3g rounded per hop\n", P,
                  r, err_once / mag, err_hop / mag);
    }
    EXPECT_EQ(Bits(dq_runs[1]), Bits(dq_runs[0])) << "run to run, rank " << r;
    EXPECT_EQ(Bits(dkv_runs[1]), Bits(dkv_runs[0])) << "run to run, rank " << r;
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
}

TEST(RingAttentionBf16Test, OneRank) { CheckRing(1); }
TEST(RingAttentionBf16Test, TwoRanks) { CheckRing(2); }
TEST(RingAttentionBf16Test, ThreeRanks) { CheckRing(3); }
TEST(RingAttentionBf16Test, EightRanks) { CheckRing(8); }

}  // namespace
}  // namespace plateau
