#include "kernels/budget/auto_settings.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/memory.h"
#include "kernels/model/params.h"
#include "kernels/model/precision.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string MiB(int64_t bytes) { return absl::StrFormat("%.2f MiB", bytes / 1048576.0); }
std::string Ms(double s) { return absl::StrFormat("%.3g ms", s * 1e3); }

// The GEMM rate (FLOP/s, launch excluded) the calibration measured at
// `rows`, interpolated linearly in log2(rows) between its points and
// clamped at its ends. A point no slower than the launch itself says
// little about the rate: its net time is taken as at least a tenth of it.
double RateAt(const Calibration& c, double rows) {
  auto rate = [&](const Calibration::GemmPoint& p) {
    const double net = std::max(p.seconds - c.launch_seconds, 0.1 * p.seconds);
    return 2.0 * p.rows * kCalibrationGemmDim * kCalibrationGemmDim / net;
  };
  const auto& g = c.gemm;
  if (rows <= g.front().rows) return rate(g.front());
  if (rows >= g.back().rows) return rate(g.back());
  size_t i = 1;
  while (g[i].rows < rows) ++i;
  const double x0 = std::log2(static_cast<double>(g[i - 1].rows)), x1 = std::log2(static_cast<double>(g[i].rows));
  const double t = (std::log2(rows) - x0) / (x1 - x0);
  return rate(g[i - 1]) + t * (rate(g[i]) - rate(g[i - 1]));
}

int64_t LiveSetOf(AutoSetting s) {
  switch (s) {
    case AutoSetting::kChunkTokens:
      return static_cast<int>(LiveSet::kDispatch);
    case AutoSetting::kStrip:
      return static_cast<int>(LiveSet::kProjection);
    case AutoSetting::kHostBudget:
      return static_cast<int>(LiveSet::kCheckpoints);
    case AutoSetting::kBucketParams:
      return static_cast<int>(LiveSet::kOptimizer);
  }
  return 0;
}

constexpr int64_t kMaxBucketsPerGroup = 4096;

// Powers of two from `lo` below `top`, then `top`.
std::vector<int64_t> Doubling(int64_t lo, int64_t top) {
  std::vector<int64_t> out;
  for (int64_t v = lo; v < top; v *= 2) out.push_back(v);
  out.push_back(top);
  return out;
}

absl::Status ScheduleOn(const StepOptions& o, AutoSetting s) {
  bool on = false;
  const char* needs = "";
  switch (s) {
    case AutoSetting::kChunkTokens:
      on = o.dispatch.kind == DispatchOptions::Kind::kPipelinedLlep;
      needs = "schedule.pipelined_llep";
      break;
    case AutoSetting::kStrip:
      on = o.projection.kind == ProjectionOptions::Kind::kRingDtp;
      needs = "schedule.ring_dtp";
      break;
    case AutoSetting::kHostBudget:
      on = o.checkpoints.kind == CheckpointOptions::Kind::kSco;
      needs = "schedule.sco";
      break;
    case AutoSetting::kBucketParams:
      on = o.optimizer_placement.kind == OptimizerPlacementOptions::Kind::kOffloadStream;
      needs = "schedule.offload_stream_adamw";
      break;
  }
  if (on) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(AutoSettingField(s), "_auto: expected its schedule (", needs, ") to be on"));
}

// The trade at a setting's value, for people.
std::string Trade(const StepOptions& o, const ParamLayout& p, AutoSetting s, int64_t v, const MemoryPlan& plan) {
  const int64_t N = TokensPerRank(o.model, o.layout);
  switch (s) {
    case AutoSetting::kChunkTokens:
      return absl::StrCat("K = ", PipelinedLlepChunks(N, v), " chunk(s) per layer; dispatch bound ",
                          MiB(plan.bytes[LiveSetOf(s)]), " (P c k rows per chunk)");
    case AutoSetting::kStrip: {
      const int64_t shard = CeilDiv(o.model.vocab_size, o.layout.ranks);
      return absl::StrCat(CeilDiv(shard, std::min(v, shard)), " strip(s) per vocabulary shard of ", shard,
                          "; projection ", MiB(plan.bytes[LiveSetOf(s)]));
    }
    case AutoSetting::kHostBudget: {
      StepOptions at = o;
      at.checkpoints.host_budget_bytes = v;
      const ScoPools pools = CheckpointPools(at);
      const std::string records = pools.records.boundaries > 0
                                      ? absl::StrCat(" and ", pools.records.host_boundaries, " of ",
                                                     pools.records.boundaries, " attention records")
                                      : "";
      return absl::StrCat(pools.boundaries.host_boundaries, " of ", pools.boundaries.boundaries, " boundaries", records,
                          " in the host pool (", MiB(pools.host_bytes()), "); device checkpoints ",
                          MiB(pools.device_bytes()));
    }
    case AutoSetting::kBucketParams: {
      const int64_t bucket = OffloadStreamBucket(p.shard_numel(), p.owned_numel_per_rank(), v);
      return absl::StrCat(CeilDiv(p.shard_numel(), bucket) + CeilDiv(p.owned_numel_per_rank(), bucket),
                          " bucket(s) per update; ", o.optimizer_placement.staging_slots, " staging slot(s) ",
                          MiB(plan.bytes[LiveSetOf(s)]));
    }
  }
  return "";
}

}  // namespace

Calibration DefaultCalibration(CalibrationBackend backend) {
  Calibration c;
  // The rate falls off below ~32 rows as small GEMMs do: rate(m) = peak m /
  // (m + 32). Peak, launch, copies and the AdamW rate: docs/SCHEDULES.md.
  const bool cuda = backend == CalibrationBackend::kCuda;
  const double peak = cuda ? 50e12 : 50e9;
  c.launch_seconds = cuda ? 8e-6 : 5e-6;
  for (int64_t rows = 1; rows <= 4096; rows *= 4) {
    const double rate = peak * rows / (rows + 32.0);
    c.gemm.push_back({rows, c.launch_seconds + 2.0 * rows * kCalibrationGemmDim * kCalibrationGemmDim / rate});
  }
  c.h2d_bytes_per_second = cuda ? 50e9 : 5e9;
  c.d2h_bytes_per_second = cuda ? 50e9 : 5e9;
  c.adamw_params_per_second = cuda ? 100e9 : 0.2e9;
  c.collective_seconds = cuda ? 20e-6 : 100e-6;
  return c;
}

absl::Status ValidateCalibration(const Calibration& c) {
  auto bad = [](absl::string_view field, absl::string_view expected, double got) {
    return absl::InvalidArgumentError(absl::StrCat("calibration.", field, ": expected ", expected, ", got ", got));
  };
  // Bounds far past any machine, so that the model's sums stay finite (a
  // calibration arrives from a worker or a hand-edited cache file): a
  // measured operation takes under a minute, a rate under 1e15 a second.
  constexpr double kMaxSeconds = 60, kMaxRate = 1e15;
  auto positive = [](double v) { return std::isfinite(v) && v > 0; };
  if (c.gemm.empty()) return bad("gemm", "at least one point", 0);
  for (size_t i = 0; i < c.gemm.size(); ++i) {
    if (c.gemm[i].rows < 1 || c.gemm[i].rows > (int64_t{1} << 30) || (i > 0 && c.gemm[i].rows <= c.gemm[i - 1].rows)) {
      return bad(absl::StrCat("gemm[", i, "].rows"), "1 to 2^30, ascending", static_cast<double>(c.gemm[i].rows));
    }
    if (!positive(c.gemm[i].seconds) || c.gemm[i].seconds > kMaxSeconds) {
      return bad(absl::StrCat("gemm[", i, "].seconds"), "> 0 and <= 60", c.gemm[i].seconds);
    }
  }
  if (!(std::isfinite(c.launch_seconds) && c.launch_seconds >= 0 && c.launch_seconds <= kMaxSeconds)) {
    return bad("launch_seconds", ">= 0 and <= 60", c.launch_seconds);
  }
  for (auto [field, rate] : {std::pair<const char*, double>{"h2d_bytes_per_second", c.h2d_bytes_per_second},
                             {"d2h_bytes_per_second", c.d2h_bytes_per_second},
                             {"adamw_params_per_second", c.adamw_params_per_second}}) {
    if (!positive(rate) || rate > kMaxRate) return bad(field, "> 0 and <= 1e15", rate);
  }
  if (!(std::isfinite(c.collective_seconds) && c.collective_seconds >= 0 && c.collective_seconds <= kMaxSeconds)) {
    return bad("collective_seconds", ">= 0 and <= 60", c.collective_seconds);
  }
  return absl::OkStatus();
}

double GemmSeconds(const Calibration& c, int64_t m, int64_t k, int64_t n) {
  if (m <= 0 || k <= 0 || n <= 0) return 0;
  const double narrow = static_cast<double>(std::min({m, k, n}));
  return c.launch_seconds + 2.0 * m * k * n / RateAt(c, narrow);
}

double DispatchSeconds(const StepOptions& o, int64_t chunk_tokens, const Calibration& c) {
  const ModelConfig& m = o.model;
  const int64_t N = TokensPerRank(m, o.layout), P = o.layout.ranks;
  const int64_t K = PipelinedLlepChunks(N, chunk_tokens);
  const int64_t per_chunk = CeilDiv(N, K);  // the tokens a chunk takes
  const int64_t local_experts = std::max<int64_t>(1, m.experts / P);
  const int64_t rows = std::max<int64_t>(1, CeilDiv(per_chunk * m.top_k * P, m.experts));
  // What a chunk runs (kernels/dispatch/llep_chunk.cc, balanced: no weights
  // shipped; strided membership): the forward's 2 all-to-alls and the
  // backward replay's 4; 22 kernels besides the GEMMs (the index upload,
  // row gathers, combines, scatters: 8 in the forward, 14 in the replay);
  // per local expert 12 GEMMs (3 forward, 3 + 6 in the replay: the step's
  // checkpointed recompute runs no expert work, ForwardForBackward) and 3
  // SwiGLU kernels (forward, replay, backward).
  constexpr int kCollectivesPerChunk = 6, kLaunchesPerChunk = 22, kGemmsPerExpert = 12, kLaunchesPerExpert = 3;
  const double chunk = kCollectivesPerChunk * c.collective_seconds + kLaunchesPerChunk * c.launch_seconds +
                       local_experts * (kGemmsPerExpert * GemmSeconds(c, rows, m.hidden, m.expert_ffn) +
                                        kLaunchesPerExpert * c.launch_seconds);
  return static_cast<double>(m.layers) * K * chunk;
}

double ProjectionSeconds(const StepOptions& o, int64_t strip, const Calibration& c) {
  const ModelConfig& m = o.model;
  const int64_t N = TokensPerRank(m, o.layout), P = o.layout.ranks;
  const int64_t shard = CeilDiv(m.vocab_size, P);
  const int64_t S = std::min(strip, shard);
  const int64_t tile = std::min(N, std::max<int64_t>(1, o.projection.row_tile));
  const int64_t tiles = CeilDiv(N, tile);
  const int64_t full = shard / S, rest = shard % S;
  auto strip_seconds = [&](int64_t cols) { return 4 * GemmSeconds(c, tile, m.hidden, cols) + 2 * c.launch_seconds; };
  return static_cast<double>(P) * tiles * (full * strip_seconds(S) + (rest ? strip_seconds(rest) : 0.0));
}

double LayerForwardSeconds(const StepOptions& o, const Calibration& c) {
  const ModelConfig& m = o.model;
  const int64_t N = TokensPerRank(m, o.layout), H = m.hidden, d = m.head_dim();
  const int64_t qd = m.heads * d, kvd = m.kv_heads * d, P = o.layout.ranks;
  const int64_t local_experts = std::max<int64_t>(1, m.experts / P);
  const int64_t expert_rows = std::max<int64_t>(1, CeilDiv(N * m.top_k * P, m.experts));
  return GemmSeconds(c, N, H, qd + 2 * kvd) + GemmSeconds(c, N, qd, H) + GemmSeconds(c, N, qd, m.seq_len) +
         GemmSeconds(c, N, H, m.experts) + local_experts * 3 * GemmSeconds(c, expert_rows, H, m.expert_ffn);
}

double CheckpointSeconds(const StepOptions& o, int64_t host_budget_bytes, const Calibration& c) {
  const ModelConfig& m = o.model;
  const int64_t N = TokensPerRank(m, o.layout);
  // The boundaries in the working type (bf16 pools twice as many per byte),
  // then the attention records (keep_attention, fp32) of what is left.
  StepOptions at = o;
  at.checkpoints.kind = CheckpointOptions::Kind::kSco;
  at.checkpoints.host_budget_bytes = host_budget_bytes;
  const ScoPools pools = CheckpointPools(at);
  const double forward = LayerForwardSeconds(o, c);
  // A restore hides behind the recompute and the backward, three forwards,
  // less attention's core when the recompute skips it (keep_attention).
  const int64_t qd = m.heads * m.head_dim();
  const double behind_up = 3 * forward - (o.checkpoints.keep_attention ? GemmSeconds(c, N, qd, m.seq_len) : 0.0);
  // Each pooled boundary or record: its launch down and up on the compute
  // stream. A layer whose boundary and record are both pooled copies both
  // over the one link in each direction (two copy streams, one PCIe): the
  // layer hides their sum. (Records are pooled only once every boundary
  // that can leave is: the first j_r layers copy both.)
  const ScoLayout& b = pools.boundaries;
  const ScoLayout& r = pools.records;
  const double down_b = static_cast<double>(b.boundary_bytes) / c.d2h_bytes_per_second,
               up_b = static_cast<double>(b.boundary_bytes) / c.h2d_bytes_per_second,
               down_r = static_cast<double>(r.boundary_bytes) / c.d2h_bytes_per_second,
               up_r = static_cast<double>(r.boundary_bytes) / c.h2d_bytes_per_second;
  const double launches = 2 * c.launch_seconds;
  auto exposed = [&](double down, double up, double copies) {
    return std::max(0.0, copies * c.launch_seconds + down - forward) +
           std::max(0.0, copies * c.launch_seconds + up - behind_up);
  };
  const int64_t both = std::min(b.host_boundaries, r.host_boundaries);
  return static_cast<double>(b.host_boundaries + r.host_boundaries) * launches +
         static_cast<double>(both) * exposed(down_b + down_r, up_b + up_r, 2) +
         static_cast<double>(b.host_boundaries - both) * exposed(down_b, up_b, 1) +
         static_cast<double>(r.host_boundaries - both) * exposed(down_r, up_r, 1);
}

namespace {

// The owned group's states that travel: m and v, and the fp32 master where
// the working copy is bf16 (OffloadStreamAdamW keeps it on the host then).
double OwnedFloats(const StepOptions& o) { return ElementBytesOf(o.precision).working_is_master() ? 2.0 : 3.0; }

// OptimizerSeconds on the parameter groups' sizes (LayoutOf lists every
// weight: the chooser builds it once, not once per candidate).
// owned_floats: what an owned bucket moves each way per parameter (m and
// v; the master too where it is not the working copy: bf16).
double PipelineSeconds(int64_t shard, int64_t owned, int64_t staging_slots, int64_t bucket_params, double owned_floats,
                       const Calibration& c) {
  const int64_t bucket = OffloadStreamBucket(shard, owned, bucket_params);
  const size_t slots = static_cast<size_t>(std::max<int64_t>(1, staging_slots));
  // End times of each stage; a stage starts when its stream is free and its
  // input is ready; an upload also needs its slot back (the download of the
  // bucket `slots` before it). The buckets in OffloadStreamBuckets' order:
  // the dense group, then the owned one, never across.
  std::vector<double> slot_free(slots, 0.0);
  double up_free = 0, compute_free = 0, down_free = 0;
  size_t i = 0;
  for (const bool owned_group : {false, true}) {
    const int64_t n = owned_group ? owned : shard;
    // The dense group moves master, m and v; the owned group m and v, and
    // its master where the working copy is not it (bf16).
    const double floats = owned_group ? owned_floats : 3.0;
    for (int64_t off = 0; off < n; off += bucket, ++i) {
      const int64_t numel = std::min(bucket, n - off);
      const double bytes = floats * numel * sizeof(float);
      up_free = std::max(up_free, slot_free[i % slots]) + c.launch_seconds + bytes / c.h2d_bytes_per_second;
      compute_free = std::max(compute_free, up_free) + c.launch_seconds + numel / c.adamw_params_per_second;
      down_free = std::max(down_free, compute_free) + c.launch_seconds + bytes / c.d2h_bytes_per_second;
      slot_free[i % slots] = down_free;
    }
  }
  return down_free;
}

}  // namespace

double OptimizerSeconds(const StepOptions& o, int64_t bucket_params, const Calibration& c) {
  const ParamLayout p = LayoutOf(o);
  return PipelineSeconds(p.shard_numel(), p.owned_numel_per_rank(), o.optimizer_placement.staging_slots, bucket_params,
                         OwnedFloats(o), c);
}

const char* AutoSettingField(AutoSetting s) {
  switch (s) {
    case AutoSetting::kChunkTokens:
      return "schedule.pipelined_llep.chunk_tokens";
    case AutoSetting::kStrip:
      return "schedule.ring_dtp.strip";
    case AutoSetting::kHostBudget:
      return "schedule.sco.host_budget_bytes";
    case AutoSetting::kBucketParams:
      return "schedule.offload_stream_adamw.bucket_params";
  }
  return "";
}

bool AutoRequest::has(AutoSetting s) const {
  switch (s) {
    case AutoSetting::kChunkTokens:
      return chunk_tokens;
    case AutoSetting::kStrip:
      return strip;
    case AutoSetting::kHostBudget:
      return host_budget;
    case AutoSetting::kBucketParams:
      return bucket_params;
  }
  return false;
}

std::vector<int64_t> AutoCandidates(const StepOptions& o, AutoSetting s, const ParamLayout* layout) {
  const ModelConfig& m = o.model;
  const int64_t N = std::max<int64_t>(1, TokensPerRank(m, o.layout));
  switch (s) {
    case AutoSetting::kChunkTokens:
      return Doubling(16, N);
    case AutoSetting::kStrip:
      return Doubling(16, CeilDiv(m.vocab_size, o.layout.ranks));
    case AutoSetting::kHostBudget: {
      // Whole boundaries in the working type (bf16: 2 bytes an element),
      // then, under keep_attention, every boundary that can leave and whole
      // attention records (fp32) beside them (PlanScoPools' order).
      const int64_t max_j = std::max<int64_t>(0, m.layers - 1),
                    boundary = N * m.hidden * ElementBytesOf(o.precision).working;
      constexpr int64_t kMaxSteps = 32;
      std::vector<int64_t> out;
      auto steps = [&](int64_t max, int64_t base, int64_t unit) {
        for (int64_t i = 0; i <= std::min(max, kMaxSteps); ++i) {
          const int64_t j = max <= kMaxSteps ? i : (i * max + kMaxSteps / 2) / kMaxSteps;
          if (out.empty() || out.back() != base + j * unit) out.push_back(base + j * unit);
        }
      };
      steps(max_j, 0, boundary);
      if (const int64_t width = AttentionRecordWidth(o); width > 0) {
        steps(std::max<int64_t>(0, m.layers - 2), max_j * boundary, N * width * static_cast<int64_t>(sizeof(float)));
      }
      return out;
    }
    case AutoSetting::kBucketParams: {
      std::optional<ParamLayout> own;
      const ParamLayout& p = layout != nullptr ? *layout : own.emplace(LayoutOf(o));
      const int64_t group = std::max<int64_t>(1, std::max(p.shard_numel(), p.owned_numel_per_rank()));
      // Buckets under 1/4096 of the group only add launches (and would make
      // the pipeline model walk millions of them on a huge spec).
      int64_t lo = 1024;
      while (lo < group / kMaxBucketsPerGroup) lo *= 2;
      return Doubling(lo, group);
    }
  }
  return {};
}

void SetAutoSetting(StepOptions* o, AutoSetting s, int64_t v) {
  switch (s) {
    case AutoSetting::kChunkTokens:
      o->dispatch.pipelined.chunk_tokens = v;
      break;
    case AutoSetting::kStrip:
      o->projection.strip = v;
      break;
    case AutoSetting::kHostBudget:
      o->checkpoints.host_budget_bytes = v;
      break;
    case AutoSetting::kBucketParams:
      o->optimizer_placement.bucket_params = v;
      break;
  }
}

int64_t GetAutoSetting(const StepOptions& o, AutoSetting s) {
  switch (s) {
    case AutoSetting::kChunkTokens:
      return o.dispatch.pipelined.chunk_tokens;
    case AutoSetting::kStrip:
      return o.projection.strip;
    case AutoSetting::kHostBudget:
      return o.checkpoints.host_budget_bytes;
    case AutoSetting::kBucketParams:
      return o.optimizer_placement.bucket_params;
  }
  return 0;
}

double AutoSettingSeconds(const StepOptions& o, AutoSetting s, int64_t v, const Calibration& c) {
  switch (s) {
    case AutoSetting::kChunkTokens:
      return DispatchSeconds(o, v, c);
    case AutoSetting::kStrip:
      return ProjectionSeconds(o, v, c);
    case AutoSetting::kHostBudget:
      return CheckpointSeconds(o, v, c);
    case AutoSetting::kBucketParams:
      return OptimizerSeconds(o, v, c);
  }
  return 0;
}

absl::StatusOr<StepOptions> SmallestAutoSettings(const StepOptions& options, const AutoRequest& request,
                                                 const ParamLayout* given) {
  PLATEAU_RETURN_IF_ERROR(ValidateStepShape(options));
  StepOptions out = options;
  std::optional<ParamLayout> own;
  const ParamLayout& layout = given != nullptr ? *given : own.emplace(LayoutOf(options));
  for (int i = 0; i < kNumAutoSettings; ++i) {
    const AutoSetting s = static_cast<AutoSetting>(i);
    if (!request.has(s)) continue;
    PLATEAU_RETURN_IF_ERROR(ScheduleOn(options, s));
    // Each setting moves its own live set only: its smallest is the same
    // whatever the others are.
    int64_t best = 0, best_device = 0, best_host = 0;
    bool first = true;
    for (int64_t v : AutoCandidates(options, s, &layout)) {
      StepOptions o = out;
      SetAutoSetting(&o, s, v);
      PLATEAU_ASSIGN_OR_RETURN(const MemoryPlan p, PlanMemory(o, layout));
      if (first || p.total() < best_device || (p.total() == best_device && p.host_total() < best_host)) {
        best = v;
        best_device = p.total();
        best_host = p.host_total();
        first = false;
      }
    }
    SetAutoSetting(&out, s, best);
  }
  return out;
}

absl::StatusOr<AutoChoice> ChooseAutoSettings(const StepOptions& options, const AutoRequest& request,
                                              const Calibration& calibration, const FitCaps& caps,
                                              const ParamLayout* given) {
  PLATEAU_RETURN_IF_ERROR(ValidateCalibration(calibration));
  PLATEAU_RETURN_IF_ERROR(ValidateStepShape(options));
  // One entry per requested setting: its candidates, and for each the
  // modelled seconds and the plan's change against `base` in each space.
  struct Axis {
    AutoSetting setting;
    std::vector<int64_t> values;
    std::vector<double> seconds;
    std::vector<int64_t> device, host;
  };
  std::vector<Axis> axes;
  StepOptions base = options;
  for (int i = 0; i < kNumAutoSettings; ++i) {
    const AutoSetting s = static_cast<AutoSetting>(i);
    if (!request.has(s)) continue;
    PLATEAU_RETURN_IF_ERROR(ScheduleOn(options, s));
    Axis a{s, AutoCandidates(options, s, given), {}, {}, {}};
    SetAutoSetting(&base, s, a.values.front());
    axes.push_back(std::move(a));
  }
  AutoChoice out;
  out.options = options;
  if (axes.empty()) {
    PLATEAU_ASSIGN_OR_RETURN(out.plan, PlanMemory(options));
    return out;
  }
  // The settings change neither the parameters nor where the lm_head lives.
  std::optional<ParamLayout> own;
  const ParamLayout& layout = given != nullptr ? *given : own.emplace(LayoutOf(base));
  PLATEAU_ASSIGN_OR_RETURN(const MemoryPlan base_plan, PlanMemory(base, layout));
  for (Axis& a : axes) {
    for (int64_t v : a.values) {
      StepOptions o = base;
      SetAutoSetting(&o, a.setting, v);
      PLATEAU_ASSIGN_OR_RETURN(const MemoryPlan p, PlanMemory(o, layout));
      // Against the cap as admission counts it (the dispatch at its
      // balanced case under caps.balanced_dispatch).
      a.device.push_back(DeviceBytesAgainstCap(p, caps) - DeviceBytesAgainstCap(base_plan, caps));
      a.host.push_back(p.host_total() - base_plan.host_total());
      a.seconds.push_back(a.setting == AutoSetting::kBucketParams
                              ? PipelineSeconds(layout.shard_numel(), layout.owned_numel_per_rank(),
                                                base.optimizer_placement.staging_slots, v, OwnedFloats(base),
                                                calibration)
                              : AutoSettingSeconds(base, a.setting, v, calibration));
    }
  }
  auto fits = [&](int64_t device, int64_t host) {
    return (caps.device_bytes == 0 || device <= caps.device_bytes) && (caps.host_bytes == 0 || host <= caps.host_bytes);
  };
  // Every combination, in odometer order (the first axis fastest): the
  // first of equal (seconds, device, host) keeps the smaller values.
  std::vector<size_t> at(axes.size(), 0), best;
  double best_seconds = std::numeric_limits<double>::infinity();
  int64_t best_device = 0, best_host = 0;
  // For the error when nothing fits both caps: the least host bytes among
  // the combinations that fit the device cap, and the least device bytes
  // among those that fit the host cap (-1: none fits that cap).
  constexpr int64_t kNone = -1;
  int64_t least_host = kNone, least_device = kNone;
  std::vector<size_t> at_least_host;
  while (true) {
    double seconds = 0;
    int64_t device = DeviceBytesAgainstCap(base_plan, caps), host = base_plan.host_total();
    for (size_t i = 0; i < axes.size(); ++i) {
      seconds += axes[i].seconds[at[i]];
      device += axes[i].device[at[i]];
      host += axes[i].host[at[i]];
    }
    if ((caps.device_bytes == 0 || device <= caps.device_bytes) && (least_host == kNone || host < least_host)) {
      least_host = host;
      at_least_host = at;
    }
    if ((caps.host_bytes == 0 || host <= caps.host_bytes) && (least_device == kNone || device < least_device)) {
      least_device = device;
    }
    if (fits(device, host) &&
        (best.empty() || seconds < best_seconds ||
         (seconds == best_seconds && (device < best_device || (device == best_device && host < best_host))))) {
      best = at;
      best_seconds = seconds;
      best_device = device;
      best_host = host;
    }
    size_t i = 0;
    while (i < axes.size() && ++at[i] == axes[i].values.size()) at[i++] = 0;
    if (i == axes.size()) break;
  }
  // The options at a combination of the axes' values.
  const auto options_at = [&](const std::vector<size_t>& combination) {
    StepOptions o = options;
    for (size_t i = 0; i < axes.size(); ++i) SetAutoSetting(&o, axes[i].setting, axes[i].values[combination[i]]);
    return o;
  };
  // For the errors: "field=value, ..." of the `auto` settings of `o`, and
  // the nonzero live sets of `bytes` ("name=bytes, ...") with the largest.
  const auto values_of = [&](const StepOptions& o) {
    std::vector<std::string> values;
    for (const Axis& a : axes)
      values.push_back(absl::StrCat(AutoSettingField(a.setting), "=", GetAutoSetting(o, a.setting)));
    return absl::StrJoin(values, ", ");
  };
  const auto sets_of = [](const std::array<int64_t, kNumLiveSets>& bytes, int* largest) {
    std::vector<std::string> sets;
    *largest = 0;
    for (int i = 0; i < kNumLiveSets; ++i) {
      if (bytes[i] > bytes[*largest]) *largest = i;
      if (bytes[i] != 0) sets.push_back(absl::StrCat(LiveSetName(static_cast<LiveSet>(i)), "=", bytes[i]));
    }
    return absl::StrJoin(sets, ", ");
  };
  if (best.empty() && least_host != kNone && least_device != kNone) {
    // Each cap alone can be met, not both: the host's room the device
    // needs. (Said at the smallest device plan, the host's shortfall was
    // overstated and the setting called "already at its smallest".)
    return absl::ResourceExhaustedError(absl::StrCat(
        "host_memory_bytes: no value of the `auto` settings fits both caps: those that fit device_memory_bytes = ",
        caps.device_bytes, " need at least ", least_host, " host bytes (at ", values_of(options_at(at_least_host)),
        ") against a cap of ", caps.host_bytes, ", short by ", least_host - caps.host_bytes,
        "; those that fit the host need at least ", least_device, " device bytes, short by ",
        least_device - caps.device_bytes, "; raise either cap"));
  }
  if (best.empty() && least_host != kNone) {
    // Every combination that fits the device is over the host cap (and
    // none fits the host at all): said at the least host plan among them.
    const StepOptions least = options_at(at_least_host);
    PLATEAU_ASSIGN_OR_RETURN(const MemoryPlan p, PlanMemory(least, layout));
    int largest = 0;
    const std::string sets = sets_of(p.host_bytes, &largest);
    return absl::ResourceExhaustedError(
        absl::StrCat("host_memory_bytes: no value of the `auto` settings fits: at the least host plan (",
                     values_of(least), ") the host plan is ", p.host_total(), " bytes (", sets, ") against a cap of ",
                     caps.host_bytes, ", short by ", p.host_total() - caps.host_bytes, "; the largest live set is ",
                     LiveSetName(static_cast<LiveSet>(largest)), " (", p.host_bytes[largest], " bytes)"));
  }
  if (best.empty()) {
    // Nothing fits the device: the plan at each setting's smallest device
    // bytes (then host bytes), and the live set that dominates it.
    PLATEAU_ASSIGN_OR_RETURN(const StepOptions smallest, SmallestAutoSettings(options, request, &layout));
    PLATEAU_ASSIGN_OR_RETURN(const MemoryPlan p, PlanMemory(smallest, layout));
    const bool device_over = caps.device_bytes != 0 && DeviceBytesAgainstCap(p, caps) > caps.device_bytes;
    const auto& bytes = device_over ? p.bytes : p.host_bytes;
    const int64_t total = device_over ? DeviceBytesAgainstCap(p, caps) : p.host_total(),
                  cap = device_over ? caps.device_bytes : caps.host_bytes;
    int largest = 0;
    const std::string sets = sets_of(bytes, &largest);
    std::string changes = "which no `auto` setting changes";
    for (const Axis& a : axes) {
      if (LiveSetOf(a.setting) == largest) changes = absl::StrCat("already at its smallest by ", AutoSettingField(a.setting));
    }
    // The checkpoints' part that SCO cannot move: the kept attention's
    // records in the device slots and storage.
    if (device_over && largest == static_cast<int>(LiveSet::kCheckpoints) &&
        CheckpointPools(smallest).records.device_bytes() > 0) {
      absl::StrAppend(&changes, "; ", CheckpointPools(smallest).records.device_bytes(),
                      " bytes of it are schedule.keep_attention's records (false frees them)");
    }
    return absl::ResourceExhaustedError(
        absl::StrCat(device_over ? "device_memory_bytes" : "host_memory_bytes",
                     ": no value of the `auto` settings fits: at the smallest (", values_of(smallest), ") the ",
                     device_over ? "device" : "host", " plan is ", total, " bytes (", sets, ") against a cap of ", cap,
                     ", short by ", total - cap, "; the largest live set is ",
                     LiveSetName(static_cast<LiveSet>(largest)), " (", bytes[largest], " bytes), ", changes));
  }
  out.options = options_at(best);
  // The same budget as every plan: the sums above must be PlanMemory's.
  PLATEAU_ASSIGN_OR_RETURN(out.plan, PlanMemory(out.options, layout));
  if (!Fits(out.plan, caps) || DeviceBytesAgainstCap(out.plan, caps) != best_device ||
      out.plan.host_total() != best_host) {
    return absl::InternalError(absl::StrCat("auto settings: the chosen combination plans ", out.plan.total(), "/",
                                            out.plan.host_total(), " bytes (device/host), the search summed ",
                                            best_device, "/", best_host));
  }
  out.seconds = best_seconds;
  for (size_t i = 0; i < axes.size(); ++i) {
    const Axis& a = axes[i];
    AutoChoice::Setting s;
    s.setting = a.setting;
    s.value = a.values[best[i]];
    s.seconds = a.seconds[best[i]];
    s.candidates = static_cast<int>(a.values.size());
    // What fits with the others as chosen, and the fastest of all values.
    size_t fastest = best[i];
    for (size_t v = 0; v < a.values.size(); ++v) {
      if (fits(best_device - a.device[best[i]] + a.device[v], best_host - a.host[best[i]] + a.host[v])) ++s.fitting;
      if (a.seconds[v] < a.seconds[fastest]) fastest = v;
    }
    s.why = absl::StrCat(Trade(out.options, layout, a.setting, s.value, out.plan), "; modelled ", Ms(s.seconds),
                         " per step, the least of ", s.fitting, " fitting value(s) of ", s.candidates);
    if (fastest != best[i]) {
      const bool device_over = caps.device_bytes != 0 && best_device - a.device[best[i]] + a.device[fastest] > caps.device_bytes;
      absl::StrAppend(&s.why, "; ", a.values[fastest], " would take ", Ms(a.seconds[fastest]), " but does not fit ",
                      device_over ? "device_memory_bytes" : "host_memory_bytes");
    }
    out.settings.push_back(std::move(s));
  }
  return out;
}

namespace {

// The request less the settings whose schedule `o` does not run.
AutoRequest OnlyScheduled(const StepOptions& o, const AutoRequest& request) {
  AutoRequest r = request;
  r.chunk_tokens &= ScheduleOn(o, AutoSetting::kChunkTokens).ok();
  r.strip &= ScheduleOn(o, AutoSetting::kStrip).ok();
  r.host_budget &= ScheduleOn(o, AutoSetting::kHostBudget).ok();
  r.bucket_params &= ScheduleOn(o, AutoSetting::kBucketParams).ok();
  return r;
}

absl::Status CheckAutoRequest(const StepOptions& options, const AutoRequest& request, const Calibration& calibration) {
  PLATEAU_RETURN_IF_ERROR(ValidateCalibration(calibration));
  PLATEAU_RETURN_IF_ERROR(ValidateStepShape(options));
  for (int i = 0; i < kNumAutoSettings; ++i) {
    const AutoSetting s = static_cast<AutoSetting>(i);
    if (request.has(s)) PLATEAU_RETURN_IF_ERROR(ScheduleOn(options, s));
  }
  return absl::OkStatus();
}

}  // namespace

ShapePlan AutoShapePlan(const AutoRequest& request, const Calibration& calibration, const FitCaps& caps,
                        std::shared_ptr<const ParamLayout> layout) {
  return [request, calibration, caps, layout](StepOptions* shape) -> absl::StatusOr<MemoryPlan> {
    const AutoRequest r = OnlyScheduled(*shape, request);
    if (!r.any()) return layout != nullptr ? PlanMemory(*shape, *layout) : PlanMemory(*shape);
    absl::StatusOr<AutoChoice> choice = ChooseAutoSettings(*shape, r, calibration, caps, layout.get());
    if (choice.ok()) {
      *shape = choice->options;
      return choice->plan;
    }
    if (choice.status().code() != absl::StatusCode::kResourceExhausted) return choice.status();
    // Nothing fits here: the smallest plan, which is over a cap, so that the
    // search reads this shape as one that does not fit (and says by how much).
    PLATEAU_ASSIGN_OR_RETURN(*shape, SmallestAutoSettings(*shape, r, layout.get()));
    return layout != nullptr ? PlanMemory(*shape, *layout) : PlanMemory(*shape);
  };
}

std::vector<std::pair<std::string, int64_t>> AutoValues(const StepOptions& options, const AutoRequest& request) {
  const AutoRequest r = OnlyScheduled(options, request);
  std::vector<std::pair<std::string, int64_t>> out;
  for (int i = 0; i < kNumAutoSettings; ++i) {
    const AutoSetting s = static_cast<AutoSetting>(i);
    if (r.has(s)) out.push_back({AutoSettingField(s), GetAutoSetting(options, s)});
  }
  return out;
}

absl::StatusOr<NMax> SolveNMaxAuto(const StepOptions& options, const AutoRequest& request,
                                   const Calibration& calibration, const FitCaps& caps, const NMaxLimits& limits) {
  PLATEAU_RETURN_IF_ERROR(CheckAutoRequest(options, request, calibration));
  // The shapes share the options' parameter layout: built once.
  const ShapePlan plan =
      AutoShapePlan(request, calibration, caps, std::make_shared<const ParamLayout>(LayoutOf(options)));
  PLATEAU_ASSIGN_OR_RETURN(NMax out, SolveNMaxWith(options, caps, limits, plan));
  for (NMaxAxis* axis : {&out.batch, &out.context}) {
    if (axis->tokens_per_rank == 0) continue;
    StepOptions at = options;
    at.layout.batch = axis->batch;
    at.model.seq_len = axis->seq_len;
    PLATEAU_RETURN_IF_ERROR(plan(&at).status());
    axis->auto_values = AutoValues(at, request);
  }
  return out;
}

absl::StatusOr<std::vector<WhatIfRow>> WhatIfNMaxAuto(const StepOptions& options, const AutoRequest& request,
                                                      const Calibration& calibration, const FitCaps& caps,
                                                      const NMaxLimits& limits) {
  PLATEAU_RETURN_IF_ERROR(CheckAutoRequest(options, request, calibration));
  WhatIfPerShape per_shape;
  for (int i = 0; i < kNumAutoSettings; ++i) per_shape.chosen[i] = request.has(static_cast<AutoSetting>(i));
  // Each row's layout (Ring-DTP moves the lm_head), built once per row.
  per_shape.plan = [request, calibration, caps](const StepOptions& row) -> absl::StatusOr<ShapePlan> {
    return AutoShapePlan(request, calibration, caps, std::make_shared<const ParamLayout>(LayoutOf(row)));
  };
  per_shape.values = [request](const StepOptions& planned) { return AutoValues(planned, request); };
  return WhatIfNMax(options, caps, limits, &per_shape);
}

}  // namespace plateau
