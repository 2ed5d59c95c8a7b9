// The three optimizer placements on their own, at P = 1 and 2 rank threads
// (Gloo over loopback, CPU backend), on a dense shard and owned weights whose
// sizes no bucket divides:
// - each against a double-precision torch.optim.AdamW reference over two
//   steps (clipping and weight decay on and off), to fp32 rounding;
// - OffloadStreamAdamW bitwise DeviceAdamW for buckets of 1 value up to
//   larger than a group, with 1, 2 and 3 staging slots; the CPU-offload
//   baseline bitwise too (on the CPU backend it runs the same fp32 kernel);
// - a state saved under one placement and loaded into another gives the
//   same next step;
// - measured device and host optimizer peaks equal the plan;
// - bf16 mixed (issue 17): the same three with fp32 masters (dense and
//   owned) stepped by bf16 gradients and bf16 working copies rn(master):
//   each against the reference on the loaded gradients, the stream and the
//   CPU-offload baseline bitwise the device placement (masters, moments
//   and working bits), a state moving between placements, the plan's
//   bytes;
// - bad options name the spec field.
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer/cpu_offload_adamw.h"
#include "kernels/optimizer/device_adamw.h"
#include "kernels/optimizer/offload_stream_adamw.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/status_macros.h"
#include "kernels/testing/bf16_testing.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

using ::testing::HasSubstr;
using Kind = OptimizerPlacementOptions::Kind;

constexpr int64_t kS = 1001, kX = 517;  // the dense shard, the owned weights

std::vector<float> Random(int64_t n, uint32_t seed, float scale, bool positive = false) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(positive ? 0.0f : -1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = scale * u(rng);
  return v;
}

// One rank's inputs: its initial state (non-zero moments, as after a few
// steps), owned weights, and gradients for two steps.
struct RankInputs {
  OptimizerShardState state;
  std::vector<float> owned;
  std::vector<float> dense_grad[2], owned_grad[2];
};

RankInputs Inputs(int rank) {
  RankInputs in;
  const uint32_t s = 100 * rank;
  in.state.dense_master = Random(kS, s + 1, 1.0f);
  in.state.dense_m = Random(kS, s + 2, 0.01f);
  in.state.dense_v = Random(kS, s + 3, 1e-4f, true);
  in.state.owned_m = Random(kX, s + 4, 0.01f);
  in.state.owned_v = Random(kX, s + 5, 1e-4f, true);
  in.owned = Random(kX, s + 6, 1.0f);
  for (int k = 0; k < 2; ++k) {
    in.dense_grad[k] = Random(kS, s + 7 + k, 0.1f);
    in.owned_grad[k] = Random(kX, s + 9 + k, 0.1f);
  }
  return in;
}

struct Placement {
  Kind kind = Kind::kDevice;
  int64_t bucket = 0, slots = 2;
  std::string Name() const {
    if (kind == Kind::kDevice) return "device";
    if (kind == Kind::kCpuOffload) return "cpu-offload";
    return absl::StrCat("stream(bucket ", bucket, ", slots ", slots, ")");
  }
};

// What a rank ends with: the state, its owned weights, the working weights.
struct RankResult {
  OptimizerShardState state;
  std::vector<float> owned, working;
  MemoryStats device, host;
};

// W: float (fp32), or Bf16 (bf16 mixed: the placements' bf16 instantiations).
template <typename W>
absl::StatusOr<std::unique_ptr<OptimizerUpdate>> Make(const Placement& p, const OptimizerConfig& c,
                                                      const OptimizerParamsT<W>& params, Backend& be,
                                                      Communicator& world, Stream& s) {
  switch (p.kind) {
    case Kind::kDevice:
      return DeviceAdamWT<W>::Create(c, params, be, world, s);
    case Kind::kCpuOffload:
      return CpuOffloadAdamWT<W>::Create(c, params, be, world, s, /*threads=*/3);
    case Kind::kOffloadStream: {
      OptimizerPlacementOptions o;
      o.kind = Kind::kOffloadStream;
      o.bucket_params = p.bucket;
      o.staging_slots = p.slots;
      return OffloadStreamAdamWT<W>::Create(c, o, params, be, world, s);
    }
  }
  return absl::InternalError("placement");
}

// Loads each rank's inputs (or `resume`, a state saved earlier) into
// `first`, runs `steps` updates (gradients of step k) with `second` taking
// over after the first when given (Save -> Load), and returns every rank's
// result.
std::vector<RankResult> RunUpdates(int P, const OptimizerConfig& config, const std::vector<float>& clips,
                            const Placement& first, const Placement* second = nullptr) {
  std::vector<RankResult> out(P);
  const absl::Status st = RunLocalWorld(P, 16 << 20, FreshStoreDir("opt"), [&](int r, Backend& be,
                                                                                Communicator& world) {
    const RankInputs in = Inputs(r);
    const int64_t f = sizeof(float);
    PLATEAU_ASSIGN_OR_RETURN(Buffer working, be.device().Allocate(LiveSet::kWeights, kS * P * f));
    PLATEAU_ASSIGN_OR_RETURN(Buffer owned, be.device().Allocate(LiveSet::kWeights, kX * f));
    PLATEAU_ASSIGN_OR_RETURN(Buffer dgrad, be.device().Allocate(LiveSet::kGrads, kS * f));
    PLATEAU_ASSIGN_OR_RETURN(Buffer ograd, be.device().Allocate(LiveSet::kGrads, kX * f));
    PLATEAU_ASSIGN_OR_RETURN(auto stream, be.CreateStream("opt"));
    PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, owned.data(), in.owned.data(), kX * f));
    OptimizerParams params{working.as<float>(), owned.as<float>(), dgrad.as<float>(), ograd.as<float>(), kS, kX};
    be.device().tracker().ResetPeaks();
    be.host().tracker().ResetPeaks();
    PLATEAU_ASSIGN_OR_RETURN(auto opt, Make(first, config, params, be, world, *stream));
    PLATEAU_RETURN_IF_ERROR(opt->Load(in.state));
    for (size_t k = 0; k < clips.size(); ++k) {
      if (k == 1 && second != nullptr) {
        PLATEAU_ASSIGN_OR_RETURN(OptimizerShardState saved, opt->Save());
        opt.reset();
        PLATEAU_ASSIGN_OR_RETURN(opt, Make(*second, config, params, be, world, *stream));
        PLATEAU_RETURN_IF_ERROR(opt->Load(saved));
      }
      PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, dgrad.data(), in.dense_grad[k].data(), kS * f));
      PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, ograd.data(), in.owned_grad[k].data(), kX * f));
      PLATEAU_RETURN_IF_ERROR(opt->Update(clips[k], /*step=*/static_cast<int64_t>(k) + 4));
    }
    RankResult& res = out[r];
    PLATEAU_ASSIGN_OR_RETURN(res.state, opt->Save());
    res.owned.resize(kX);
    res.working.resize(kS * P);
    PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, res.owned.data(), owned.data(), kX * f));
    PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, res.working.data(), working.data(), kS * P * f));
    res.device = be.device().tracker().Snapshot();
    res.host = be.host().tracker().Snapshot();
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// torch.optim.AdamW in double from the same inputs.
void ReferenceStep(double* p, double g, double* m, double* v, const OptimizerConfig& c, int64_t step,
                   double clip) {
  g *= clip;
  *p *= 1.0 - static_cast<double>(c.lr) * c.weight_decay;
  *m = c.beta1 * *m + (1.0 - c.beta1) * g;
  *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
  const double bc1 = 1.0 - std::pow(static_cast<double>(c.beta1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(c.beta2), step);
  *p -= (c.lr / bc1) * *m / (std::sqrt(*v) / std::sqrt(bc2) + c.eps);
}

void ExpectMatchesReference(const std::vector<RankResult>& got, int P, const OptimizerConfig& c,
                            const std::vector<float>& clips, const std::string& what) {
  for (int r = 0; r < P; ++r) {
    const RankInputs in = Inputs(r);
    for (bool owned : {false, true}) {
      const int64_t n = owned ? kX : kS;
      double max_err = 0, scale = 0;
      for (int64_t i = 0; i < n; ++i) {
        double p = owned ? in.owned[i] : in.state.dense_master[i];
        double m = owned ? in.state.owned_m[i] : in.state.dense_m[i];
        double v = owned ? in.state.owned_v[i] : in.state.dense_v[i];
        for (size_t k = 0; k < clips.size(); ++k) {
          ReferenceStep(&p, owned ? in.owned_grad[k][i] : in.dense_grad[k][i], &m, &v, c,
                        static_cast<int64_t>(k) + 4, clips[k]);
        }
        const double got_p = owned ? got[r].owned[i] : got[r].state.dense_master[i];
        max_err = std::max(max_err, std::abs(got_p - p));
        scale = std::max(scale, std::abs(p));
        const double got_m = owned ? got[r].state.owned_m[i] : got[r].state.dense_m[i];
        const double got_v = owned ? got[r].state.owned_v[i] : got[r].state.dense_v[i];
        ASSERT_NEAR(got_m, m, 1e-6 * (std::abs(m) + 1e-3)) << what << " rank " << r << " m[" << i << "]";
        ASSERT_NEAR(got_v, v, 1e-5 * v + 1e-12) << what << " rank " << r << " v[" << i << "]";
      }
      EXPECT_LE(max_err, 1e-6 * scale) << what << " rank " << r << (owned ? " owned" : " dense");
    }
  }
  // The working weights: every rank's master, all-gathered on every rank.
  for (int r = 0; r < P; ++r) {
    for (int q = 0; q < P; ++q) {
      const std::vector<float> slice(got[r].working.begin() + q * kS, got[r].working.begin() + (q + 1) * kS);
      EXPECT_EQ(slice, got[q].state.dense_master) << what << ": rank " << r << "'s working copy of rank " << q;
    }
  }
}

void ExpectSameBits(const std::vector<RankResult>& a, const std::vector<RankResult>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].state.dense_master, b[r].state.dense_master) << what << " rank " << r;
    EXPECT_EQ(a[r].state.dense_m, b[r].state.dense_m) << what << " rank " << r;
    EXPECT_EQ(a[r].state.dense_v, b[r].state.dense_v) << what << " rank " << r;
    EXPECT_EQ(a[r].state.owned_m, b[r].state.owned_m) << what << " rank " << r;
    EXPECT_EQ(a[r].state.owned_v, b[r].state.owned_v) << what << " rank " << r;
    EXPECT_EQ(a[r].owned, b[r].owned) << what << " rank " << r;
    EXPECT_EQ(a[r].working, b[r].working) << what << " rank " << r;
  }
}

class Placements : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(Placements, EachMatchesTheReferenceAndTheStreamIsBitwiseTheDevice) {
  const auto [P, clip_on, decay_on] = GetParam();
  OptimizerConfig c;
  c.lr = 1e-2f;
  c.weight_decay = decay_on ? 0.1f : 0.0f;
  const std::vector<float> clips = clip_on ? std::vector<float>{0.37f, 0.81f} : std::vector<float>{1.0f, 1.0f};
  const std::vector<RankResult> device = RunUpdates(P, c, clips, {Kind::kDevice});
  ExpectMatchesReference(device, P, c, clips, "device");
  const std::vector<RankResult> cpu = RunUpdates(P, c, clips, {Kind::kCpuOffload});
  ExpectMatchesReference(cpu, P, c, clips, "cpu-offload");
  ExpectSameBits(cpu, device, "cpu-offload vs device");
  for (int64_t bucket : {int64_t{1}, int64_t{64}, int64_t{333}, int64_t{1000}, int64_t{100'000'000}}) {
    for (int64_t slots : {1, 2, 3}) {
      if (bucket == 1 && slots != 2) continue;  // 1,518 buckets: once is enough
      const Placement p{Kind::kOffloadStream, bucket, slots};
      const std::vector<RankResult> got = RunUpdates(P, c, clips, p);
      ExpectSameBits(got, device, p.Name());
      const OptimizerBytes plan = OffloadStreamAdamWBytes(kS, kX, bucket, slots);
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(got[r].device.peak_of(LiveSet::kOptimizer), plan.device) << p.Name();
        EXPECT_EQ(got[r].host.peak_of(LiveSet::kOptimizer), plan.host) << p.Name();
      }
    }
  }
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(device[r].device.peak_of(LiveSet::kOptimizer), DeviceAdamWBytes(kS, kX));
    EXPECT_EQ(device[r].host.peak_of(LiveSet::kOptimizer), 0);
    EXPECT_EQ(cpu[r].device.peak_of(LiveSet::kOptimizer), 0);
    EXPECT_EQ(cpu[r].host.peak_of(LiveSet::kOptimizer), CpuOffloadAdamWBytes(kS, kX).host);
  }
}

INSTANTIATE_TEST_SUITE_P(RanksClipDecay, Placements,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Bool(), ::testing::Bool()));

// A checkpoint taken under one placement resumes under another: the next
// step is bitwise the one that never switched.
TEST(OptimizerTest, StateMovesBetweenPlacements) {
  OptimizerConfig c;
  c.weight_decay = 0.05f;
  const std::vector<float> clips = {0.5f, 1.0f};
  const Placement device{Kind::kDevice}, stream{Kind::kOffloadStream, 300, 2}, cpu{Kind::kCpuOffload};
  const std::vector<RankResult> stay = RunUpdates(2, c, clips, device);
  ExpectSameBits(RunUpdates(2, c, clips, device, &stream), stay, "device -> stream");
  ExpectSameBits(RunUpdates(2, c, clips, stream, &device), stay, "stream -> device");
  ExpectSameBits(RunUpdates(2, c, clips, stream, &cpu), stay, "stream -> cpu-offload");
  ExpectSameBits(RunUpdates(2, c, clips, cpu, &stream), stay, "cpu-offload -> stream");
}

// --- bf16 mixed precision (issue 17) ---------------------------------------
// The step's bf16 buffers: working dense weights [S * P], owned weights [X]
// and both gradients in bf16; the masters (dense and owned) and moments fp32
// in the optimizer. The inputs are RankInputs' with the owned weights as
// their fp32 master and the gradients rounded to bf16 (what the step's
// reduce-scatter leaves).
struct Bf16Result {
  OptimizerShardState state;
  std::vector<uint16_t> owned, working;  // bf16 bits
  MemoryStats device, host;
};

OptimizerShardState Bf16InitialState(const RankInputs& in) {
  OptimizerShardState st = in.state;
  st.owned_master = in.owned;
  return st;
}

std::vector<Bf16Result> RunUpdatesBf16(int P, const OptimizerConfig& config, const std::vector<float>& clips,
                                       const Placement& first, const Placement* second = nullptr) {
  std::vector<Bf16Result> out(P);
  const absl::Status st = RunLocalWorld(P, 16 << 20, FreshStoreDir("opt-bf16"), [&](int r, Backend& be,
                                                                                     Communicator& world) {
    const RankInputs in = Inputs(r);
    const int64_t h = sizeof(Bf16);
    PLATEAU_ASSIGN_OR_RETURN(Buffer working, be.device().Allocate(LiveSet::kWeights, kS * P * h));
    PLATEAU_ASSIGN_OR_RETURN(Buffer owned, be.device().Allocate(LiveSet::kWeights, kX * h));
    PLATEAU_ASSIGN_OR_RETURN(Buffer dgrad, be.device().Allocate(LiveSet::kGrads, kS * h));
    PLATEAU_ASSIGN_OR_RETURN(Buffer ograd, be.device().Allocate(LiveSet::kGrads, kX * h));
    PLATEAU_ASSIGN_OR_RETURN(auto stream, be.CreateStream("opt"));
    // NaN bits in the working buffers: every element must be written.
    const std::vector<Bf16> nan_s(kS * P, Bf16{0x7fff}), nan_x(kX, Bf16{0x7fff});
    PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, working.data(), nan_s.data(), kS * P * h));
    PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, owned.data(), nan_x.data(), kX * h));
    OptimizerParamsT<Bf16> params{working.as<Bf16>(), owned.as<Bf16>(), dgrad.as<Bf16>(), ograd.as<Bf16>(), kS, kX};
    be.device().tracker().ResetPeaks();
    be.host().tracker().ResetPeaks();
    // What Load alone writes: this rank's dense region of the working
    // copy and the owned weights, rn(master) of the loaded state (the
    // Updates below rewrite both, so a fault of Load's own would hide).
    const auto expect_loaded = [&](const OptimizerShardState& loaded, const char* when) -> absl::Status {
      std::vector<Bf16> o(kX), w(kS * P);
      PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, o.data(), owned.data(), kX * h));
      PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, w.data(), working.data(), kS * P * h));
      const std::vector<uint16_t> all = Bits(w);
      const std::vector<uint16_t> own_region(all.begin() + r * kS, all.begin() + (r + 1) * kS);
      if (Bits(o) != RoundedBits(loaded.owned_master) || own_region != RoundedBits(loaded.dense_master)) {
        return absl::InternalError(absl::StrCat("rank ", r, " ", when, ": the working copies are not rn(master)"));
      }
      return absl::OkStatus();
    };
    PLATEAU_ASSIGN_OR_RETURN(auto opt, Make(first, config, params, be, world, *stream));
    PLATEAU_RETURN_IF_ERROR(opt->Load(Bf16InitialState(in)));
    PLATEAU_RETURN_IF_ERROR(expect_loaded(Bf16InitialState(in), "after the first Load"));
    for (size_t k = 0; k < clips.size(); ++k) {
      if (k == 1 && second != nullptr) {
        PLATEAU_ASSIGN_OR_RETURN(OptimizerShardState saved, opt->Save());
        opt.reset();
        PLATEAU_ASSIGN_OR_RETURN(opt, Make(*second, config, params, be, world, *stream));
        PLATEAU_RETURN_IF_ERROR(opt->Load(saved));
        PLATEAU_RETURN_IF_ERROR(expect_loaded(saved, "after the Load in the second placement"));
      }
      const std::vector<Bf16> dg = Rounded(in.dense_grad[k]), og = Rounded(in.owned_grad[k]);
      PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, dgrad.data(), dg.data(), kS * h));
      PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, ograd.data(), og.data(), kX * h));
      PLATEAU_RETURN_IF_ERROR(opt->Update(clips[k], /*step=*/static_cast<int64_t>(k) + 4));
    }
    Bf16Result& res = out[r];
    PLATEAU_ASSIGN_OR_RETURN(res.state, opt->Save());
    std::vector<Bf16> o(kX), w(kS * P);
    PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, o.data(), owned.data(), kX * h));
    PLATEAU_RETURN_IF_ERROR(be.Copy(*stream, w.data(), working.data(), kS * P * h));
    res.owned = Bits(o);
    res.working = Bits(w);
    res.device = be.device().tracker().Snapshot();
    res.host = be.host().tracker().Snapshot();
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// The fp32 masters against the double reference on the loaded bf16
// gradients (fp32 rounding: the masters never leave fp32), and the working
// copies are the masters rounded once: every rank's dense region on every
// rank, and the owned weights.
void ExpectBf16MatchesReference(const std::vector<Bf16Result>& got, int P, const OptimizerConfig& c,
                                const std::vector<float>& clips, const std::string& what) {
  for (int r = 0; r < P; ++r) {
    const RankInputs in = Inputs(r);
    for (bool owned : {false, true}) {
      const int64_t n = owned ? kX : kS;
      double max_err = 0, scale = 0;
      for (int64_t i = 0; i < n; ++i) {
        double p = owned ? in.owned[i] : in.state.dense_master[i];
        double m = owned ? in.state.owned_m[i] : in.state.dense_m[i];
        double v = owned ? in.state.owned_v[i] : in.state.dense_v[i];
        for (size_t k = 0; k < clips.size(); ++k) {
          ReferenceStep(&p, RoundToBf16(owned ? in.owned_grad[k][i] : in.dense_grad[k][i]), &m, &v, c,
                        static_cast<int64_t>(k) + 4, clips[k]);
        }
        const double got_p = owned ? got[r].state.owned_master[i] : got[r].state.dense_master[i];
        max_err = std::max(max_err, std::abs(got_p - p));
        scale = std::max(scale, std::abs(p));
        const double got_m = owned ? got[r].state.owned_m[i] : got[r].state.dense_m[i];
        const double got_v = owned ? got[r].state.owned_v[i] : got[r].state.dense_v[i];
        ASSERT_NEAR(got_m, m, 1e-6 * (std::abs(m) + 1e-3)) << what << " rank " << r << " m[" << i << "]";
        ASSERT_NEAR(got_v, v, 1e-5 * v + 1e-12) << what << " rank " << r << " v[" << i << "]";
      }
      EXPECT_LE(max_err, 1e-6 * scale) << what << " rank " << r << (owned ? " owned" : " dense");
    }
    EXPECT_EQ(got[r].owned, RoundedBits(got[r].state.owned_master)) << what << " rank " << r << " owned";
    for (int q = 0; q < P; ++q) {
      const std::vector<uint16_t> slice(got[r].working.begin() + q * kS, got[r].working.begin() + (q + 1) * kS);
      EXPECT_EQ(slice, RoundedBits(got[q].state.dense_master)) << what << ": rank " << r << "'s copy of rank " << q;
    }
  }
}

void ExpectSameBits(const std::vector<Bf16Result>& a, const std::vector<Bf16Result>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].state.dense_master, b[r].state.dense_master) << what << " rank " << r;
    EXPECT_EQ(a[r].state.owned_master, b[r].state.owned_master) << what << " rank " << r;
    EXPECT_EQ(a[r].state.dense_m, b[r].state.dense_m) << what << " rank " << r;
    EXPECT_EQ(a[r].state.dense_v, b[r].state.dense_v) << what << " rank " << r;
    EXPECT_EQ(a[r].state.owned_m, b[r].state.owned_m) << what << " rank " << r;
    EXPECT_EQ(a[r].state.owned_v, b[r].state.owned_v) << what << " rank " << r;
    EXPECT_EQ(a[r].owned, b[r].owned) << what << " rank " << r;
    EXPECT_EQ(a[r].working, b[r].working) << what << " rank " << r;
  }
}

class PlacementsBf16 : public ::testing::TestWithParam<std::tuple<int, bool>> {};

// Every placement steps the fp32 masters as the reference does, and the
// streamed and CPU-offload placements are bitwise the device one (on the
// CPU backend all three run cpu::AdamW on the exactly loaded gradients and
// round the same masters); each within its plan for bf16.
TEST_P(PlacementsBf16, EachMatchesTheReferenceAndIsBitwiseTheDevice) {
  const auto [P, clip_on] = GetParam();
  OptimizerConfig c;
  c.lr = 1e-2f;
  c.weight_decay = 0.1f;
  const std::vector<float> clips = clip_on ? std::vector<float>{0.37f, 0.81f} : std::vector<float>{1.0f, 1.0f};
  const std::vector<Bf16Result> device = RunUpdatesBf16(P, c, clips, {Kind::kDevice});
  ExpectBf16MatchesReference(device, P, c, clips, "device");
  const std::vector<Bf16Result> cpu = RunUpdatesBf16(P, c, clips, {Kind::kCpuOffload});
  ExpectBf16MatchesReference(cpu, P, c, clips, "cpu-offload");
  ExpectSameBits(cpu, device, "bf16 cpu-offload vs device");
  // The streamed placement over the fp32 test's buckets and slots: bitwise
  // the device one, its optimizer peaks the bf16 plan's on both sides (one
  // setting, bits only, was checked before).
  for (int64_t bucket : {int64_t{1}, int64_t{64}, int64_t{333}, int64_t{1000}, int64_t{100'000'000}}) {
    for (int64_t slots : {1, 2, 3}) {
      if (bucket == 1 && slots != 2) continue;  // 1,518 buckets: once is enough
      const Placement stream{Kind::kOffloadStream, bucket, slots};
      const std::vector<Bf16Result> got = RunUpdatesBf16(P, c, clips, stream);
      ExpectSameBits(got, device, "bf16 " + stream.Name());
      const OptimizerBytes plan = OffloadStreamAdamWBytes(kS, kX, bucket, slots, kBf16MixedElements);
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(got[r].device.peak_of(LiveSet::kOptimizer), plan.device) << "bf16 " << stream.Name();
        EXPECT_EQ(got[r].host.peak_of(LiveSet::kOptimizer), plan.host) << "bf16 " << stream.Name();
      }
    }
  }
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(device[r].device.peak_of(LiveSet::kOptimizer), DeviceAdamWBytes(kS, kX, kBf16MixedElements));
    EXPECT_EQ(device[r].host.peak_of(LiveSet::kOptimizer), 0);
    EXPECT_EQ(cpu[r].device.peak_of(LiveSet::kOptimizer), 0);
    EXPECT_EQ(cpu[r].host.peak_of(LiveSet::kOptimizer), CpuOffloadAdamWBytes(kS, kX, kBf16MixedElements).host);
    // 3 fp32 values and 1 bf16 per parameter: less than fp32's 4 x 4.
    EXPECT_EQ(cpu[r].host.peak_of(LiveSet::kOptimizer), 14 * (kS + kX));
  }
}

INSTANTIATE_TEST_SUITE_P(RanksClip, PlacementsBf16, ::testing::Combine(::testing::Values(1, 2), ::testing::Bool()));

// A bf16 state (with the owned weights' master) taken under one placement
// resumes under another: the next step is bitwise the one that never switched.
TEST(OptimizerTest, Bf16StateMovesBetweenPlacements) {
  OptimizerConfig c;
  c.weight_decay = 0.05f;
  const std::vector<float> clips = {0.5f, 1.0f};
  const Placement device{Kind::kDevice}, stream{Kind::kOffloadStream, 300, 2}, cpu{Kind::kCpuOffload};
  const std::vector<Bf16Result> stay = RunUpdatesBf16(2, c, clips, device);
  ExpectSameBits(RunUpdatesBf16(2, c, clips, device, &cpu), stay, "device -> cpu-offload");
  ExpectSameBits(RunUpdatesBf16(2, c, clips, cpu, &device), stay, "cpu-offload -> device");
  ExpectSameBits(RunUpdatesBf16(2, c, clips, stream, &cpu), stay, "stream -> cpu-offload");
  ExpectSameBits(RunUpdatesBf16(2, c, clips, cpu, &stream), stay, "cpu-offload -> stream");
}

// Under bf16 the owned weights' master is part of the state: a state
// without it (an fp32 one) is refused naming it, by every placement.
TEST(OptimizerTest, ABf16StateWithoutTheOwnedMasterIsRefused) {
  const absl::Status st = RunLocalWorld(1, 16 << 20, FreshStoreDir("opt-bf16-bad"), [&](int, Backend& be,
                                                                                         Communicator& world) {
    PLATEAU_ASSIGN_OR_RETURN(Buffer w, be.device().Allocate(LiveSet::kWeights, (2 * kS + 2 * kX) * 2));
    Bf16* base = w.as<Bf16>();
    OptimizerParamsT<Bf16> params{base, base + kS, base + kS + kX, base + 2 * kS + kX, kS, kX};
    PLATEAU_ASSIGN_OR_RETURN(auto stream, be.CreateStream("opt"));
    for (const Placement& p : {Placement{Kind::kDevice}, Placement{Kind::kCpuOffload},
                               Placement{Kind::kOffloadStream, 100, 2}}) {
      PLATEAU_ASSIGN_OR_RETURN(auto opt, Make(p, OptimizerConfig{}, params, be, world, *stream));
      const absl::Status s = opt->Load(Inputs(0).state);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << p.Name();
      EXPECT_THAT(std::string(s.message()), HasSubstr("the owned weights' master has 0 values, expected 517"))
          << p.Name();
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(OptimizerTest, BadOptionsNameTheSpecField) {
  EXPECT_THAT(std::string(ValidateOffloadStream(0, 2).message()),
              HasSubstr("schedule.offload_stream_adamw.bucket_params"));
  EXPECT_THAT(std::string(ValidateOffloadStream(10, 4).message()),
              HasSubstr("schedule.offload_stream_adamw.staging_slots: expected 1, 2 or 3, got 4"));
  EXPECT_THAT(std::string(ValidateOffloadStream(10, 0).message()), HasSubstr("staging_slots"));
  EXPECT_TRUE(ValidateOffloadStream(1, 1).ok());
  // Buckets: never across the two groups, the last one short.
  const OffloadStreamBuckets b(10, 4, 4);
  ASSERT_EQ(b.size(), 4);
  EXPECT_FALSE(b[1].owned);
  EXPECT_EQ(b[1].offset, 4);
  EXPECT_EQ(b[1].numel, 4);
  EXPECT_FALSE(b[2].owned);
  EXPECT_EQ(b[2].offset, 8);
  EXPECT_EQ(b[2].numel, 2);
  EXPECT_TRUE(b[3].owned);
  EXPECT_EQ(b[3].offset, 0);
  EXPECT_EQ(b[3].numel, 4);
  const OffloadStreamBuckets no_owned(5, 0, 2);  // no owned experts: the dense group only
  ASSERT_EQ(no_owned.size(), 3);
  EXPECT_EQ(no_owned[2].numel, 1);
  EXPECT_EQ(OffloadStreamBucket(10, 4, 100'000'000), 10) << "no slot larger than the larger group";
}

TEST(OptimizerTest, AWrongSizedStateIsRefusedNamingIt) {
  const absl::Status st = RunLocalWorld(1, 16 << 20, FreshStoreDir("opt-bad"), [&](int, Backend& be,
                                                                                    Communicator& world) {
    PLATEAU_ASSIGN_OR_RETURN(Buffer w, be.device().Allocate(LiveSet::kWeights, (2 * kS + 2 * kX) * 4));
    float* base = w.as<float>();
    OptimizerParams params{base, base + kS, base + kS + kX, base + 2 * kS + kX, kS, kX};
    PLATEAU_ASSIGN_OR_RETURN(auto stream, be.CreateStream("opt"));
    for (const Placement& p : {Placement{Kind::kDevice}, Placement{Kind::kCpuOffload},
                               Placement{Kind::kOffloadStream, 100, 2}}) {
      PLATEAU_ASSIGN_OR_RETURN(auto opt, Make(p, OptimizerConfig{}, params, be, world, *stream));
      OptimizerShardState st = Inputs(0).state;
      st.owned_v.resize(3);
      const absl::Status s = opt->Load(st);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << p.Name();
      EXPECT_THAT(std::string(s.message()), HasSubstr("the owned weights' v has 3 values, expected 517"))
          << p.Name();
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace plateau
