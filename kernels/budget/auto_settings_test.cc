// The `auto` chooser against a brute force over the same candidates: on
// synthetic curves it picks the argmin of the time model among the
// combinations whose real plan (PlanMemory of the whole combination) fits,
// its choice never exceeds a cap, and when nothing fits the error names the
// cap and the live set. The model's pieces are checked against hand
// computations on curves whose numbers are easy to follow.
#include "kernels/budget/auto_settings.h"

#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/budget/budget.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/testing/tiny_model.h"

namespace plateau {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// All four schedules on, every setting with several candidates: N = 128
// tokens per rank (c: 16..128), shard 256 of V = 512 (S: 16..256), 4 layers
// (beta: 4 values), and two parameter groups of some thousands (buckets).
StepOptions AllOn() {
  StepOptions o;
  o.model = TinyModel();
  o.model.vocab_size = 512;
  o.model.layers = 4;
  o.model.seq_len = 32;
  o.layout = {2, 8};
  o.dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  o.dispatch.pipelined.balance.min_piece = 4;
  o.projection.kind = ProjectionOptions::Kind::kRingDtp;
  o.projection.row_tile = 64;
  o.checkpoints.kind = CheckpointOptions::Kind::kSco;
  o.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  return o;
}

AutoRequest Everything() { return AutoRequest{true, true, true, true}; }

// A curve with a flat rate (`flops` at every size), and the other figures.
Calibration Flat(double flops, double launch, double copy_bytes_per_s, double adamw, double collective) {
  Calibration c;
  for (int64_t rows : {1, 16, 256, 4096}) {
    c.gemm.push_back({rows, launch + 2.0 * rows * kCalibrationGemmDim * kCalibrationGemmDim / flops});
  }
  c.launch_seconds = launch;
  c.h2d_bytes_per_second = c.d2h_bytes_per_second = copy_bytes_per_s;
  c.adamw_params_per_second = adamw;
  c.collective_seconds = collective;
  return c;
}

// Synthetic machines that pull the settings in different directions.
std::vector<std::pair<const char*, Calibration>> Machines() {
  return {
      {"default cpu", DefaultCalibration(CalibrationBackend::kCpu)},
      {"default cuda", DefaultCalibration(CalibrationBackend::kCuda)},
      // Slow collectives and launches: fewer, larger chunks, strips, buckets.
      {"latency bound", Flat(1e9, 1e-3, 1e9, 1e8, 5e-3)},
      // Slow copies against fast compute: offloading is exposed.
      {"copy bound", Flat(1e12, 1e-7, 1e6, 1e10, 1e-7)},
      // Nothing costs a launch: the rate curve alone decides.
      {"no overheads", Flat(1e10, 0, 1e12, 1e12, 0)},
  };
}

struct Brute {
  bool any = false;
  std::vector<int64_t> values;
  double seconds = 0;
  int64_t device = 0, host = 0;
};

// Every combination of the candidates, each planned whole by PlanMemory.
Brute BruteForce(const StepOptions& base, const AutoRequest& req, const Calibration& cal, const FitCaps& caps) {
  std::vector<AutoSetting> axes;
  std::vector<std::vector<int64_t>> values;
  for (int i = 0; i < kNumAutoSettings; ++i) {
    if (!req.has(static_cast<AutoSetting>(i))) continue;
    axes.push_back(static_cast<AutoSetting>(i));
    values.push_back(AutoCandidates(base, axes.back()));
  }
  Brute best;
  std::vector<size_t> at(axes.size(), 0);
  while (true) {
    StepOptions o = base;
    double seconds = 0;
    std::vector<int64_t> v;
    for (size_t i = 0; i < axes.size(); ++i) {
      SetAutoSetting(&o, axes[i], values[i][at[i]]);
      v.push_back(values[i][at[i]]);
    }
    for (size_t i = 0; i < axes.size(); ++i) seconds += AutoSettingSeconds(o, axes[i], v[i], cal);
    auto plan = PlanMemory(o);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (plan.ok() && Fits(*plan, caps)) {
      const int64_t d = plan->total(), h = plan->host_total();
      if (!best.any || seconds < best.seconds ||
          (seconds == best.seconds && (d < best.device || (d == best.device && h < best.host)))) {
        best = {true, v, seconds, d, h};
      }
    }
    size_t i = 0;
    while (i < axes.size() && ++at[i] == values[i].size()) at[i++] = 0;
    if (i == axes.size()) break;
  }
  return best;
}

TEST(AutoSettingsTest, CandidatesSpanEachSettingsRange) {
  const StepOptions o = AllOn();
  EXPECT_EQ(AutoCandidates(o, AutoSetting::kChunkTokens), (std::vector<int64_t>{16, 32, 64, 128}));
  EXPECT_EQ(AutoCandidates(o, AutoSetting::kStrip), (std::vector<int64_t>{16, 32, 64, 128, 256}));
  const int64_t boundary = 128 * 16 * 4;
  EXPECT_EQ(AutoCandidates(o, AutoSetting::kHostBudget),
            (std::vector<int64_t>{0, boundary, 2 * boundary, 3 * boundary}));
  // Under keep_attention, past every boundary that can leave (L - 1 = 3),
  // whole attention records (N x (16 + 4) fp32), at most L - 2 = 2.
  StepOptions kept = o;
  kept.checkpoints.keep_attention = true;
  const int64_t record = 128 * 20 * 4;
  EXPECT_EQ(AutoCandidates(kept, AutoSetting::kHostBudget),
            (std::vector<int64_t>{0, boundary, 2 * boundary, 3 * boundary, 3 * boundary + record,
                                  3 * boundary + 2 * record}));
  const std::vector<int64_t> buckets = AutoCandidates(o, AutoSetting::kBucketParams);
  const ParamLayout p = LayoutOf(o);
  EXPECT_EQ(buckets.front(), 1024);
  EXPECT_EQ(buckets.back(), std::max(p.shard_numel(), p.owned_numel_per_rank()));
  // A huge parameter group: buckets start where the group has at most 4096
  // of them (the pipeline model walks each).
  StepOptions wide = o;
  wide.model.experts = 1 << 14;
  const ParamLayout wp = LayoutOf(wide);
  const int64_t group = std::max(wp.shard_numel(), wp.owned_numel_per_rank());
  const std::vector<int64_t> wide_buckets = AutoCandidates(wide, AutoSetting::kBucketParams);
  EXPECT_LE((group + wide_buckets.front() - 1) / wide_buckets.front(), 4096) << group;
  EXPECT_GT((group + wide_buckets.front() / 2 - 1) / (wide_buckets.front() / 2), 4096) << group;
    // A deep model: at most 33 values of j, 0 and L - 1 among them.
  StepOptions deep = o;
  deep.model.layers = 100;
  const std::vector<int64_t> betas = AutoCandidates(deep, AutoSetting::kHostBudget);
  EXPECT_EQ(betas.size(), 33u);
  EXPECT_EQ(betas.front(), 0);
  EXPECT_EQ(betas.back(), 99 * boundary);
  // In bf16 a boundary is 2 bytes an element: each candidate pools a whole
  // number of bf16 boundaries (not fp32's, which would be 2j of them), and
  // the trade's words count what the plan pools.
  StepOptions half = o;
  half.precision = Precision::kBf16Mixed;
  const int64_t bf16_boundary = 128 * 16 * 2;
  EXPECT_EQ(AutoCandidates(half, AutoSetting::kHostBudget),
            (std::vector<int64_t>{0, bf16_boundary, 2 * bf16_boundary, 3 * bf16_boundary}));
}

TEST(AutoSettingsTest, GemmRateIsInterpolatedInLogRowsWithTheLaunchApart) {
  Calibration c;
  const double D = kCalibrationGemmDim, launch = 1e-5;
  // 1e9 FLOP/s at 16 rows, 3e9 at 256 rows (log2: 4 and 8).
  c.gemm = {{16, launch + 2 * 16 * D * D / 1e9}, {256, launch + 2 * 256 * D * D / 3e9}};
  c.launch_seconds = launch;
  c.h2d_bytes_per_second = c.d2h_bytes_per_second = c.adamw_params_per_second = 1;
  // 64 rows: log2 6, halfway: 2e9 FLOP/s. The narrow dimension decides.
  EXPECT_NEAR(GemmSeconds(c, 64, 1000, 500), launch + 2.0 * 64 * 1000 * 500 / 2e9, 1e-12);
  EXPECT_NEAR(GemmSeconds(c, 1000, 64, 500), launch + 2.0 * 64 * 1000 * 500 / 2e9, 1e-12);
  // Clamped beyond the measured ends.
  EXPECT_NEAR(GemmSeconds(c, 4, 4, 4), launch + 2.0 * 64 / 1e9, 1e-12);
  EXPECT_NEAR(GemmSeconds(c, 4096, 4096, 4096), launch + 2.0 * 4096.0 * 4096 * 4096 / 3e9, 1e-9);
  EXPECT_EQ(GemmSeconds(c, 0, 5, 5), 0);
}

// A device cap that needs two pooled boundaries and a host cap that holds
// one: each alone can be met, not both, and the error says so with the
// real shortfalls. It named the plan at the smallest device bytes (three
// boundaries): the host short by two, beta "already at its smallest".
TEST(AutoSettingsTest, CapsThatEachFitButNotTogetherAreSaidAsSuch) {
  const StepOptions o = AllOn();  // N = 128, H = 16: a boundary is 8 KiB
  const int64_t boundary = 128 * 16 * 4;
  auto plan_at = [&](int64_t beta) {
    StepOptions at = o;
    SetAutoSetting(&at, AutoSetting::kHostBudget, beta);
    return *PlanMemory(at);
  };
  const MemoryPlan one = plan_at(boundary), two = plan_at(2 * boundary);
  ASSERT_EQ(two.host_total() - one.host_total(), boundary);
  ASSERT_EQ(one.total() - two.total(), boundary);
  const FitCaps caps{two.total(), one.host_total()};
  auto got =
      ChooseAutoSettings(o, AutoRequest{false, false, true, false}, DefaultCalibration(CalibrationBackend::kCpu), caps);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_THAT(got.status().message(),
              AllOf(HasSubstr("host_memory_bytes: no value of the `auto` settings fits both caps"),
                    HasSubstr(absl::StrCat("need at least ", two.host_total(),
                                           " host bytes (at "
                                           "schedule.sco.host_budget_bytes=",
                                           2 * boundary, ")")),
                    HasSubstr(absl::StrCat("short by ", boundary, "; those that fit the host need at least ",
                                           one.total(), " device bytes, short by ", boundary))));
}

// Deep enough that the checkpoints are the largest live set, and most of
// them the kept attention's records, all on the device (full checkpoints)
// where no `auto` setting moves them: a cap nothing fits says how much of
// the set they are.
TEST(AutoSettingsTest, NothingFitsNamesTheKeptAttentionInTheCheckpoints) {
  StepOptions o = AllOn();
  o.model.layers = 32;
  o.layout.batch = 256;  // N = 4,096
  o.checkpoints.kind = CheckpointOptions::Kind::kFull;
  o.checkpoints.keep_attention = true;
  const int64_t records = 32 * 4096 * (16 + 4) * 4;
  ASSERT_EQ(CheckpointPools(o).records.device_bytes(), records);
  auto got = ChooseAutoSettings(o, AutoRequest{true, false, false, false}, DefaultCalibration(CalibrationBackend::kCpu),
                                FitCaps{1 << 20, 0});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_THAT(std::string(got.status().message()),
              AllOf(HasSubstr("the largest live set is checkpoints"),
                    HasSubstr(absl::StrCat(records, " bytes of it are schedule.keep_attention's records"))));
}

TEST(AutoSettingsTest, ModelPiecesMatchHandComputations) {
  const StepOptions o = AllOn();  // N = 128, P = 2, E = 4, k = 2, H = 16, F = 24, L = 4
  const Calibration c = Flat(1e9, 1e-6, 1e8, 1e7, 1e-4);
  // c = 32: K = 4 chunks of 32 tokens, 32 rows per expert (32 k P / E), 2
  // local experts; per chunk 6 all-to-alls, 22 other kernels, and per
  // expert 12 GEMMs and 3 SwiGLU kernels (kernels/dispatch/llep_chunk.cc).
  const double chunk = 6 * 1e-4 + 22 * 1e-6 + 2 * (12 * (1e-6 + 2.0 * 32 * 16 * 24 / 1e9) + 3 * 1e-6);
  EXPECT_NEAR(DispatchSeconds(o, 32, c), 4 * 4 * chunk, 1e-12);
  // c above N plans as K = 1.
  EXPECT_DOUBLE_EQ(DispatchSeconds(o, 1000, c), DispatchSeconds(o, 128, c));
  // S = 100 over a shard of 256: two full strips and one of 56; tiles of 64
  // rows, 2 tiles; P = 2 meetings.
  auto strip = [&](double cols) { return 4 * (1e-6 + 2.0 * 64 * 16 * cols / 1e9) + 2 * 1e-6; };
  EXPECT_NEAR(ProjectionSeconds(o, 100, c), 2 * 2 * (2 * strip(100) + strip(56)), 1e-12);
  // beta = 0 costs nothing; two pooled boundaries cost their launches and
  // what the layer does not hide (at 1e8 B/s an 8 KiB copy takes 82 us).
  EXPECT_EQ(CheckpointSeconds(o, 0, c), 0);
  // Copies this fast hide behind the layer: only the launches count.
  EXPECT_NEAR(CheckpointSeconds(o, 2 * 8192, c), 2 * 2 * 1e-6, 1e-15);
  // At 1e5 B/s an 8 KiB boundary's copy outlasts the layer: the rest of it
  // is exposed, down behind one forward, up behind recompute + backward.
  const Calibration slow = Flat(1e9, 1e-6, 1e5, 1e7, 1e-4);
  const double fwd = LayerForwardSeconds(o, slow), copy = 1e-6 + 8192 / 1e5;
  EXPECT_NEAR(fwd,
              GemmSeconds(slow, 128, 16, 16 + 2 * 8) + GemmSeconds(slow, 128, 16, 16) +
                  GemmSeconds(slow, 128, 16, 32) + GemmSeconds(slow, 128, 16, 4) +
                  2 * 3 * GemmSeconds(slow, 128, 16, 24),
              1e-15);
  ASSERT_LT(3 * fwd, copy);
  EXPECT_NEAR(CheckpointSeconds(o, 2 * 8192, slow), 2 * (2 * 1e-6 + (copy - fwd) + (copy - 3 * fwd)), 1e-12);
  // A kept attention's recompute skips attention's core ([128 x 16] x
  // [16 x 32] above): the restore has that much less to hide behind.
  StepOptions kept = o;
  kept.checkpoints.keep_attention = true;
  const double core = GemmSeconds(slow, 128, 16, 32);
  EXPECT_NEAR(CheckpointSeconds(kept, 2 * 8192, slow), 2 * (2 * 1e-6 + (copy - fwd) + (copy - (3 * fwd - core))),
              1e-12);
  // Past the boundaries, whole records (128 x 20 x 4 = 10 KiB): three
  // pooled boundaries and two records. The two layers that copy both hide
  // their sum (one link each way); the third its boundary alone.
  const double record_copy = 128 * 20 * 4 / 1e5, boundary_copy = 8192 / 1e5, behind = 3 * fwd - core;
  ASSERT_LT(behind, boundary_copy);
  EXPECT_NEAR(CheckpointSeconds(kept, 3 * 8192 + 2 * 128 * 20 * 4, slow),
              5 * 2 * 1e-6 +
                  2 * ((2e-6 + boundary_copy + record_copy - fwd) + (2e-6 + boundary_copy + record_copy - behind)) +
                  (1e-6 + boundary_copy - fwd) + (1e-6 + boundary_copy - behind),
              1e-12);
  // Whole boundaries only.
  EXPECT_EQ(CheckpointSeconds(o, 2 * 8192 + 5, slow), CheckpointSeconds(o, 2 * 8192, slow));
  // One bucket of everything, one slot: upload, update, download in series.
  StepOptions one = o;
  one.optimizer_placement.staging_slots = 1;
  const ParamLayout p = LayoutOf(o);
  const int64_t S = p.shard_numel(), X = p.owned_numel_per_rank();
  ASSERT_GT(S, 0);
  ASSERT_GT(X, 0);
  auto serial = [&](int64_t n, double floats) {
    return 3 * 1e-6 + 2 * floats * n * 4 / 1e8 + n / 1e7;
  };
  EXPECT_NEAR(OptimizerSeconds(one, std::max(S, X), c), serial(S, 3) + serial(X, 2), 1e-12);
  // bf16: the owned group's fp32 master lives on the host too and travels
  // with m and v (offload_stream_adamw.cc); the layout is the same.
  StepOptions one_bf16 = one;
  one_bf16.precision = Precision::kBf16Mixed;
  ASSERT_EQ(LayoutOf(one_bf16).owned_numel_per_rank(), X);
  EXPECT_NEAR(OptimizerSeconds(one_bf16, std::max(S, X), c), serial(S, 3) + serial(X, 3), 1e-12);
  // Two slots overlap the second bucket's upload with the first's update.
  EXPECT_LT(OptimizerSeconds(o, std::max(S, X), c), OptimizerSeconds(one, std::max(S, X), c));
}

// The chooser is the brute force's argmin, at caps from nothing fitting to
// everything fitting, on every synthetic machine, for each setting alone
// and all four together.
TEST(AutoSettingsTest, ChoiceIsTheArgminOfTheModelAmongFittingCombinations) {
  const StepOptions base = AllOn();
  StepOptions largest = base, smallest = base;
  for (int i = 0; i < kNumAutoSettings; ++i) {
    const std::vector<int64_t> v = AutoCandidates(base, static_cast<AutoSetting>(i));
    const bool beta = static_cast<AutoSetting>(i) == AutoSetting::kHostBudget;
    SetAutoSetting(&largest, static_cast<AutoSetting>(i), beta ? v.front() : v.back());
    SetAutoSetting(&smallest, static_cast<AutoSetting>(i), beta ? v.back() : v.front());
  }
  const int64_t hi = PlanMemory(largest)->total(), lo = PlanMemory(smallest)->total();
  const int64_t host_hi = PlanMemory(largest)->host_total() + PlanMemory(smallest)->host_total();
  ASSERT_LT(lo, hi);
  std::vector<AutoRequest> requests = {Everything(), {true, false, false, false}, {false, true, false, false},
                                       {false, false, true, false}, {false, false, false, true},
                                       {true, false, true, false}};
  int chosen = 0, refused = 0;
  for (const auto& [name, cal] : Machines()) {
    for (const AutoRequest& req : requests) {
      for (int step = -1; step <= 8; ++step) {
        // From below the smallest plan to above the largest, and uncapped.
        const int64_t cap = step == 8 ? 0 : lo - 1 + (hi - lo + 1) * step / 7;
        for (int64_t host_cap : {int64_t{0}, host_hi / 3}) {
          const FitCaps caps{cap, host_cap};
          SCOPED_TRACE(absl::StrCat(name, " device cap ", cap, " host cap ", host_cap, " request ",
                                    req.chunk_tokens, req.strip, req.host_budget, req.bucket_params));
          const Brute want = BruteForce(base, req, cal, caps);
          auto got = ChooseAutoSettings(base, req, cal, caps);
          if (!want.any) {
            ++refused;
            ASSERT_FALSE(got.ok());
            EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
            EXPECT_THAT(got.status().message(), HasSubstr("memory_bytes: no value of the `auto` settings fits"));
            continue;
          }
          ++chosen;
          ASSERT_TRUE(got.ok()) << got.status();
          std::vector<int64_t> values;
          for (const AutoChoice::Setting& s : got->settings) values.push_back(s.value);
          EXPECT_EQ(values, want.values);
          EXPECT_DOUBLE_EQ(got->seconds, want.seconds);
          // The choice fits, by the plan of the options it returns.
          auto plan = PlanMemory(got->options);
          ASSERT_TRUE(plan.ok());
          EXPECT_TRUE(Fits(*plan, caps)) << plan->DebugString();
          EXPECT_EQ(plan->total(), got->plan.total());
          EXPECT_EQ(plan->host_total(), got->plan.host_total());
        }
      }
    }
  }
  // Both outcomes were exercised.
  EXPECT_GT(chosen, 100);
  EXPECT_GT(refused, 10);
}

// The trades the model is for: with room, latency-bound machines take the
// fewest chunks, strips and buckets and pool nothing; a tighter device cap
// buys memory with the setting whose time costs least.
TEST(AutoSettingsTest, TradesFollowTheCurves) {
  const StepOptions base = AllOn();
  const Calibration latency = Flat(1e9, 1e-3, 1e9, 1e8, 5e-3);
  auto roomy = ChooseAutoSettings(base, Everything(), latency, FitCaps{});
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  ASSERT_EQ(roomy->settings.size(), 4u);
  EXPECT_EQ(roomy->settings[0].value, 128);  // c = N: K = 1
  EXPECT_EQ(roomy->settings[1].value, 256);  // one strip per shard
  EXPECT_EQ(roomy->settings[2].value, 0);    // nothing pooled
  EXPECT_EQ(roomy->settings[0].fitting, roomy->settings[0].candidates);
  EXPECT_THAT(roomy->settings[0].why, HasSubstr("K = 1 chunk(s) per layer"));
  // A cap just under the roomy plan: something gives, and the choice fits.
  const FitCaps tight{roomy->plan.total() - 1, 0};
  auto squeezed = ChooseAutoSettings(base, Everything(), latency, tight);
  ASSERT_TRUE(squeezed.ok()) << squeezed.status();
  EXPECT_LE(squeezed->plan.total(), tight.device_bytes);
  EXPECT_GT(squeezed->seconds, roomy->seconds);
  // Only c automatic under a cap that c alone must meet: the largest c
  // that fits, and the why names the faster value that does not.
  StepOptions fixed = base;
  fixed.dispatch.pipelined.chunk_tokens = 128;
  const int64_t at128 = PlanMemory(fixed)->total();
  fixed.dispatch.pipelined.chunk_tokens = 64;
  const int64_t at64 = PlanMemory(fixed)->total();
  ASSERT_LT(at64, at128);
  auto c_only = ChooseAutoSettings(base, {true, false, false, false}, latency, FitCaps{at64, 0});
  ASSERT_TRUE(c_only.ok()) << c_only.status();
  EXPECT_EQ(c_only->settings[0].value, 64);
  EXPECT_EQ(c_only->settings[0].fitting, 3);
  EXPECT_THAT(c_only->settings[0].why, HasSubstr("128 would take"));
  EXPECT_THAT(c_only->settings[0].why, HasSubstr("does not fit device_memory_bytes"));
  // Slow copies make pooling a boundary expensive: beta stays 0 while the
  // cap allows, and moves only when the device cap demands it.
  const Calibration copies = Flat(1e12, 1e-7, 1e6, 1e10, 1e-7);
  auto beta_roomy = ChooseAutoSettings(base, {false, false, true, false}, copies, FitCaps{});
  ASSERT_TRUE(beta_roomy.ok());
  EXPECT_EQ(beta_roomy->settings[0].value, 0);
  auto beta_tight = ChooseAutoSettings(base, {false, false, true, false}, copies,
                                       FitCaps{beta_roomy->plan.total() - 1, 0});
  ASSERT_TRUE(beta_tight.ok()) << beta_tight.status();
  EXPECT_EQ(beta_tight->settings[0].value, 128 * 16 * 4);  // one boundary, no more
}

// N_max with the `auto` settings chosen at each N: a larger N than the
// spec's needs smaller settings (here c) than the spec's N chose, so the
// search that chooses again reaches further than one at the spec's values;
// and it is exact against the brute force over every combination at every
// shape of a scan (which also checks, on this range, that "some
// combination fits" is monotone in N, as auto_settings.h argues).
TEST(AutoSettingsTest, NMaxChoosesTheSettingsAgainAtEachNAndIsTight) {
  const StepOptions base = AllOn();
  const Calibration cal = DefaultCalibration(CalibrationBackend::kCpu);
  const AutoRequest req = Everything();
  // A cap that the spec's own N fits roomily (the chooser takes c = N there).
  auto roomy = ChooseAutoSettings(base, req, cal, FitCaps{});
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  const FitCaps caps{roomy->plan.total() + roomy->plan.total() / 4, 0};
  auto at_spec = ChooseAutoSettings(base, req, cal, caps);
  ASSERT_TRUE(at_spec.ok()) << at_spec.status();
  NMaxLimits limits;
  limits.max_batch = 64;
  limits.max_seq_len = 1024 * base.layout.ranks;
  auto fixed = SolveNMax(at_spec->options, caps, limits);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  auto per_n = SolveNMaxAuto(base, req, cal, caps, limits);
  ASSERT_TRUE(per_n.ok()) << per_n.status();
  for (auto axis : {&NMax::batch, &NMax::context}) {
    const bool batch_axis = axis == &NMax::batch;
    const NMaxAxis& got = (*per_n).*axis;
    SCOPED_TRACE(batch_axis ? "batch axis" : "context axis");
    ASSERT_EQ(got.limit, "device_memory_bytes") << got.detail;
    EXPECT_GT(got.tokens_per_rank, ((*fixed).*axis).tokens_per_rank);
    auto shape = [&](int64_t x) {
      StepOptions o = base;
      (batch_axis ? o.layout.batch : o.model.seq_len) = batch_axis ? x : x * base.layout.ranks;
      return o;
    };
    // The scan, to twice the answer: the largest shape where some
    // combination fits.
    const int64_t answer = batch_axis ? got.batch : got.seq_len / base.layout.ranks;
    const int64_t x_max = 2 * answer + 2;
    int64_t largest = 0;
    for (int64_t x = 1; x <= x_max; ++x) {
      const bool any = BruteForce(shape(x), req, cal, caps).any;
      if (any) {
        EXPECT_EQ(largest, x - 1) << "fits at " << x << " but not at " << largest + 1;
        largest = x;
      }
    }
    EXPECT_EQ(answer, largest);
    // The values reported at the answer are the chooser's there, and fit.
    auto there = ChooseAutoSettings(shape(answer), req, cal, caps);
    ASSERT_TRUE(there.ok()) << there.status();
    ASSERT_EQ(got.auto_values.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(got.auto_values[i].first, AutoSettingField(there->settings[i].setting));
      EXPECT_EQ(got.auto_values[i].second, there->settings[i].value);
    }
    // c had to shrink below what the spec's N chose.
    EXPECT_LT(got.auto_values[0].second, at_spec->settings[0].value);
  }
  // The what-if table chooses per N in the rows that run the spec's
  // schedules, and says "auto" there; its all-on row is this N_max.
  auto rows = WhatIfNMaxAuto(base, req, cal, caps, limits);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 6u);
  const WhatIfRow& on = rows->back();
  EXPECT_EQ(on.n_max.batch.tokens_per_rank, per_n->batch.tokens_per_rank);
  EXPECT_EQ(on.n_max.context.tokens_per_rank, per_n->context.tokens_per_rank);
  EXPECT_EQ(on.n_max.context.auto_values, per_n->context.auto_values);
  EXPECT_THAT(on.settings[0], HasSubstr("chunk_tokens=auto min_piece=4 max_borrowed=no cap (the spec's)"));
  EXPECT_THAT(on.settings[1], HasSubstr("strip=auto"));
  EXPECT_THAT(on.settings[2], HasSubstr("host_budget_bytes=auto"));
  EXPECT_THAT(on.settings[3], HasSubstr("bucket_params=auto"));
  // A row without PipelinedLLEP chooses the others only.
  const WhatIfRow& ring = (*rows)[2];
  ASSERT_EQ(ring.schedules, "ring_dtp");
  ASSERT_EQ(ring.n_max.batch.auto_values.size(), 1u);
  EXPECT_EQ(ring.n_max.batch.auto_values[0].first, "schedule.ring_dtp.strip");
  EXPECT_TRUE((*rows)[0].n_max.batch.auto_values.empty());  // all off
}

TEST(AutoSettingsTest, NothingFitsNamesTheCapAndTheLargestLiveSet) {
  const StepOptions base = AllOn();
  auto got = ChooseAutoSettings(base, Everything(), DefaultCalibration(CalibrationBackend::kCpu), FitCaps{1000, 0});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(got.status().message(),
              HasSubstr("device_memory_bytes: no value of the `auto` settings fits: at the smallest "
                        "(schedule.pipelined_llep.chunk_tokens=16, schedule.ring_dtp.strip=16, "
                        "schedule.sco.host_budget_bytes=24576, schedule.offload_stream_adamw.bucket_params=1024)"));
  EXPECT_THAT(got.status().message(), HasSubstr("against a cap of 1000"));
  EXPECT_THAT(got.status().message(), HasSubstr("the largest live set is "));
  // The host cap: beta's pool alone does not fit one byte.
  auto host = ChooseAutoSettings(base, {false, false, true, false}, DefaultCalibration(CalibrationBackend::kCpu),
                                 FitCaps{0, 1});
  ASSERT_FALSE(host.ok());
  EXPECT_THAT(host.status().message(), HasSubstr("host_memory_bytes: no value"));
}

TEST(AutoSettingsTest, RefusesAutoForAScheduleThatIsOffAndABadCalibration) {
  StepOptions o = AllOn();
  o.projection.kind = ProjectionOptions::Kind::kDense;
  auto got = ChooseAutoSettings(o, {false, true, false, false}, DefaultCalibration(CalibrationBackend::kCpu), {});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(),
              HasSubstr("schedule.ring_dtp.strip_auto: expected its schedule (schedule.ring_dtp) to be on"));
  Calibration bad = DefaultCalibration(CalibrationBackend::kCpu);
  std::swap(bad.gemm[0], bad.gemm[1]);
  got = ChooseAutoSettings(AllOn(), Everything(), bad, {});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.status().message(), HasSubstr("calibration.gemm[1].rows: expected 1 to 2^30, ascending"));
  bad = DefaultCalibration(CalibrationBackend::kCpu);
  bad.h2d_bytes_per_second = std::nan("");
  EXPECT_THAT(ValidateCalibration(bad).message(), HasSubstr("calibration.h2d_bytes_per_second: expected > 0"));
  // Absurd but finite values made the modelled step time inf - inf = NaN,
  // and the chooser then returned its first (slowest) combination as OK.
  bad = DefaultCalibration(CalibrationBackend::kCpu);
  bad.launch_seconds = 1e308;
  for (auto& p : bad.gemm) p.seconds = 1e308;
  EXPECT_THAT(ChooseAutoSettings(AllOn(), Everything(), bad, {}).status().message(),
              HasSubstr("calibration.gemm[0].seconds: expected > 0 and <= 60"));
  bad = DefaultCalibration(CalibrationBackend::kCpu);
  bad.adamw_params_per_second = 1e300;
  EXPECT_THAT(ValidateCalibration(bad).message(),
              HasSubstr("calibration.adamw_params_per_second: expected > 0 and <= 1e15"));
  // No request: the options as given.
  auto none = ChooseAutoSettings(AllOn(), AutoRequest{}, DefaultCalibration(CalibrationBackend::kCpu), {});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->settings.empty());
  EXPECT_EQ(none->plan.total(), PlanMemory(AllOn())->total());
}

}  // namespace
}  // namespace plateau
