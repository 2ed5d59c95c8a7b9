#include "kernels/budget/n_max.h"

#include <algorithm>
#include <array>
#include <limits>
#include <memory>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/model/params.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

// The plan of one candidate shape: PlanMemory, or PlanMemory under options
// that follow the shape (the what-if table's SCO budget, the `auto`
// settings chosen per shape).
using PlanFunction = ShapePlan;

std::string MiB(int64_t bytes) { return absl::StrFormat("%.2f MiB", bytes / 1048576.0); }

// "activations=12.00 MiB, checkpoints=4.00 MiB, weights=1.00 MiB": the three
// largest live sets of one space, which say what to change.
std::string Largest(const std::array<int64_t, kNumLiveSets>& bytes) {
  std::array<int, kNumLiveSets> order;
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return bytes[a] > bytes[b]; });
  std::vector<std::string> parts;
  for (int i : order) {
    if (bytes[i] == 0 || parts.size() == 3) break;
    parts.push_back(absl::StrCat(LiveSetName(static_cast<LiveSet>(i)), "=", MiB(bytes[i])));
  }
  return absl::StrJoin(parts, ", ");
}

// One candidate shape: it fits, or what stops it (NMaxAxis::limit, detail).
struct Probe {
  bool fits = false;
  std::string limit;
  std::string detail;
};

absl::StatusOr<Probe> TryShape(const StepOptions& o, const FitCaps& caps, const NMaxLimits& limits,
                               const PlanFunction& plan) {
  if (limits.still_wanted) PLATEAU_RETURN_IF_ERROR(limits.still_wanted());
  const int64_t N = TokensPerRank(o.model, o.layout);
  const std::string where =
      absl::StrCat("at layout.batch ", o.layout.batch, ", model.seq_len ", o.model.seq_len, " (N = ", N,
                   " tokens per rank)");
  if (limits.check) {
    if (absl::Status s = limits.check(o); !s.ok()) {
      return Probe{false, "refused", absl::StrCat(where, ": ", s.message())};
    }
  }
  StepOptions planned = o;
  absl::StatusOr<MemoryPlan> p = plan(&planned);
  if (!p.ok()) return Probe{false, "refused", absl::StrCat(where, ": ", p.status().message())};
  if (caps.device_bytes > 0 && DeviceBytesAgainstCap(*p, caps) > caps.device_bytes) {
    return Probe{false, "device_memory_bytes",
                 absl::StrCat(where, ": the device plan is ", MiB(DeviceBytesAgainstCap(*p, caps)),
                              caps.balanced_dispatch ? " (dispatch at its balanced case)" : "", " against the cap of ",
                              MiB(caps.device_bytes), " (largest: ", Largest(p->bytes), ")")};
  }
  if (caps.host_bytes > 0 && p->host_total() > caps.host_bytes) {
    return Probe{false, "host_memory_bytes",
                 absl::StrCat(where, ": the host plan is ", MiB(p->host_total()), " against the cap of ",
                              MiB(caps.host_bytes), " (largest: ", Largest(p->host_bytes), ")")};
  }
  return Probe{true, "", ""};
}

// The largest x in [1, x_max] whose shape fits: doubling (or halving),
// then bisection, keeping lo fitting and hi not. x is the batch, or
// seq_len / P.
absl::StatusOr<NMaxAxis> SearchAxis(const StepOptions& base, bool batch_axis, const FitCaps& caps,
                                    const NMaxLimits& limits, const PlanFunction& plan) {
  const int64_t P = base.layout.ranks;
  const int64_t x_max = batch_axis ? limits.max_batch : limits.max_seq_len / P;
  const char* field = batch_axis ? "layout.batch" : "model.seq_len";
  auto shape = [&](int64_t x) {
    StepOptions o = base;
    if (batch_axis) {
      o.layout.batch = x;
    } else {
      o.model.seq_len = x * P;
    }
    return o;
  };
  NMaxAxis out;
  auto answer = [&](int64_t x) {
    const StepOptions o = shape(x);
    out.batch = o.layout.batch;
    out.seq_len = o.model.seq_len;
    out.tokens_per_rank = x == 0 ? 0 : TokensPerRank(o.model, o.layout);
    if (x == 0) (batch_axis ? out.batch : out.seq_len) = 0;
  };
  if (x_max < 1) {
    answer(0);
    out.limit = field;
    out.detail = absl::StrCat("the validation limit of ", field, " (",
                              batch_axis ? limits.max_batch : limits.max_seq_len, ") is below one step (",
                              batch_axis ? 1 : P, ")");
    return out;
  }
  // From the options' own shape: up by doubling while it fits, or down by
  // halving until it does (fewer plans than from 1: the answer is usually
  // within a few factors of 2 of what the spec asks).
  const int64_t x0 = std::min(x_max, std::max<int64_t>(1, batch_axis ? base.layout.batch : base.model.seq_len / P));
  int64_t lo = 0, hi = -1;  // lo fits (0: nothing yet), hi does not (-1: none yet)
  Probe at_hi;
  PLATEAU_ASSIGN_OR_RETURN(Probe p0, TryShape(shape(x0), caps, limits, plan));
  if (p0.fits) {
    lo = x0;
  } else {
    hi = x0;
    at_hi = std::move(p0);
    for (int64_t x = x0 / 2; x >= 1 && lo == 0; x /= 2) {
      PLATEAU_ASSIGN_OR_RETURN(Probe p, TryShape(shape(x), caps, limits, plan));
      if (p.fits) {
        lo = x;
      } else {
        hi = x;
        at_hi = std::move(p);
      }
    }
    if (lo == 0) {  // hi == 1: even one step does not fit
      answer(0);
      out.limit = at_hi.limit;
      out.detail = absl::StrCat("nothing fits: ", at_hi.detail);
      return out;
    }
  }
  while (hi < 0 && lo < x_max) {
    const int64_t x = lo > x_max / 2 ? x_max : 2 * lo;
    PLATEAU_ASSIGN_OR_RETURN(Probe p, TryShape(shape(x), caps, limits, plan));
    if (p.fits) {
      lo = x;
    } else {
      hi = x;
      at_hi = std::move(p);
    }
  }
  if (hi < 0) {
    answer(lo);
    out.limit = field;
    out.detail = absl::StrCat(field, " = ", batch_axis ? out.batch : out.seq_len,
                              " fits: the validation limit, not a cap, ends the search");
    return out;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    PLATEAU_ASSIGN_OR_RETURN(Probe p, TryShape(shape(mid), caps, limits, plan));
    if (p.fits) {
      lo = mid;
    } else {
      hi = mid;
      at_hi = std::move(p);
    }
  }
  answer(lo);
  out.limit = at_hi.limit;
  out.detail = at_hi.detail;
  return out;
}

// PlanMemory over the shapes of `options`, with their parameter layout
// built once (it does not depend on the shape).
absl::StatusOr<PlanFunction> PlanShapesOf(const StepOptions& options) {
  PLATEAU_RETURN_IF_ERROR(ValidateStepShape(options));
  auto layout = std::make_shared<const ParamLayout>(LayoutOf(options));
  return PlanFunction([layout](StepOptions* shape) { return PlanMemory(*shape, *layout); });
}

absl::StatusOr<NMax> Solve(const StepOptions& options, const FitCaps& caps, const NMaxLimits& limits,
                           const PlanFunction& plan) {
  StepOptions own = options;
  PLATEAU_RETURN_IF_ERROR(plan(&own).status());
  if (caps.device_bytes < 0 || caps.host_bytes < 0 || (caps.device_bytes == 0 && caps.host_bytes == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device_memory_bytes: expected a device cap (or host_memory_bytes a host cap) > 0 to solve N_max "
        "against, got device ",
        caps.device_bytes, " and host ", caps.host_bytes));
  }
  NMax out;
  PLATEAU_ASSIGN_OR_RETURN(out.batch, SearchAxis(options, /*batch_axis=*/true, caps, limits, plan));
  PLATEAU_ASSIGN_OR_RETURN(out.context, SearchAxis(options, /*batch_axis=*/false, caps, limits, plan));
  return out;
}

// SCO with beta = every boundary (and attention record, under
// keep_attention) that can leave at the shape's N (PlanScoPools with an
// unlimited budget), less what the host cap cannot hold beside the
// other host terms (the plan with beta = 0).
PlanFunction ScoEveryBoundary(const FitCaps& caps, PlanFunction plan_memory) {
  return [caps, plan_memory](StepOptions* shape) -> absl::StatusOr<MemoryPlan> {
    StepOptions& o = *shape;
    o.checkpoints.kind = CheckpointOptions::Kind::kSco;
    o.checkpoints.host_budget_bytes = std::numeric_limits<int64_t>::max();
    int64_t beta = CheckpointPools(o).host_bytes();  // the attention records too, under keep_attention
    o.checkpoints.host_budget_bytes = 0;
    if (caps.host_bytes > 0) {
      StepOptions without = o;
      PLATEAU_ASSIGN_OR_RETURN(MemoryPlan others, plan_memory(&without));
      beta = std::max<int64_t>(0, std::min(beta, caps.host_bytes - others.host_total()));
    }
    o.checkpoints.host_budget_bytes = beta;
    return plan_memory(&o);
  };
}

std::string Origin(bool spec) { return spec ? "(the spec's)" : "(default)"; }

}  // namespace

int64_t DeviceBytesAgainstCap(const MemoryPlan& plan, const FitCaps& caps) {
  if (!caps.balanced_dispatch) return plan.total();
  return plan.total() - plan.bytes[static_cast<int>(LiveSet::kDispatch)] + plan.dispatch_balanced_bytes;
}

bool Fits(const MemoryPlan& plan, const FitCaps& caps) {
  return (caps.device_bytes == 0 || DeviceBytesAgainstCap(plan, caps) <= caps.device_bytes) &&
         (caps.host_bytes == 0 || plan.host_total() <= caps.host_bytes);
}

absl::StatusOr<NMax> SolveNMax(const StepOptions& options, const FitCaps& caps, const NMaxLimits& limits) {
  PLATEAU_ASSIGN_OR_RETURN(PlanFunction plan, PlanShapesOf(options));
  return Solve(options, caps, limits, plan);
}

absl::StatusOr<NMax> SolveNMaxWith(const StepOptions& options, const FitCaps& caps, const NMaxLimits& limits,
                                   const ShapePlan& plan) {
  PLATEAU_RETURN_IF_ERROR(ValidateStepShape(options));
  return Solve(options, caps, limits, plan);
}

absl::StatusOr<std::vector<WhatIfRow>> WhatIfNMax(const StepOptions& options, const FitCaps& caps,
                                                  const NMaxLimits& limits, const WhatIfPerShape* per_shape) {
  PLATEAU_RETURN_IF_ERROR(PlanMemory(options).status());
  // A setting chosen at each shape prints as "auto" (its value at each
  // N_max is in the row's NMaxAxis::auto_values).
  auto chosen = [&](int setting, int64_t value) {
    return per_shape != nullptr && per_shape->chosen[setting] ? std::string("auto") : absl::StrCat(value);
  };
  // Each schedule's "on": the options' own settings when they chose it.
  struct Schedule {
    const char* name;
    std::function<void(StepOptions*)> on;
    std::string settings;
    bool adaptive_sco = false;
  };
  std::vector<Schedule> schedules;
  {
    const bool spec = options.dispatch.kind == DispatchOptions::Kind::kPipelinedLlep;
    const PipelinedLlepOptions p = spec ? options.dispatch.pipelined : PipelinedLlepOptions{};
    schedules.push_back({"pipelined_llep",
                         [p](StepOptions* o) {
                           o->dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
                           o->dispatch.pipelined = p;
                         },
                         absl::StrCat("pipelined_llep chunk_tokens=", spec ? chosen(0, p.chunk_tokens) : absl::StrCat(p.chunk_tokens),
                                      " min_piece=", p.balance.min_piece, " max_borrowed=",
                                      p.balance.max_borrowed == 0 ? std::string("no cap")
                                                                  : absl::StrCat(p.balance.max_borrowed),
                                      " ", Origin(spec))});
  }
  {
    const bool spec = options.projection.kind == ProjectionOptions::Kind::kRingDtp;
    ProjectionOptions p = options.projection;
    if (!spec) {
      p = ProjectionOptions{};
      p.kind = ProjectionOptions::Kind::kRingDtp;
      p.strip = std::min<int64_t>(p.strip, options.model.vocab_size);
    }
    const char* mode = !p.mode.has_value()                    ? "chosen at each N"
                       : *p.mode == RingDtpMode::kActivations ? "activations"
                                                              : "weights";
    schedules.push_back({"ring_dtp", [p](StepOptions* o) { o->projection = p; },
                         absl::StrCat("ring_dtp strip=", spec ? chosen(1, p.strip) : absl::StrCat(p.strip),
                                      " row_tile=", p.row_tile,
                                      " chunk_rows=", p.chunk_rows, " mode=", mode, " ", Origin(spec))});
  }
  {
    const bool spec = options.checkpoints.kind == CheckpointOptions::Kind::kSco;
    const CheckpointOptions c = options.checkpoints;
    schedules.push_back(
        {"sco",
         [c, spec](StepOptions* o) {
           o->checkpoints.kind = CheckpointOptions::Kind::kSco;
           if (spec) o->checkpoints = c;
         },
         spec ? absl::StrCat("sco host_budget_bytes=", chosen(2, c.host_budget_bytes), " ", Origin(true))
              : absl::StrCat("sco host_budget_bytes=every boundary that can leave (", std::max<int64_t>(0, options.model.layers - 1),
                             " of ", options.model.layers + 1, ") at each N",
                             caps.host_bytes > 0 ? ", within the host cap" : "", " ", Origin(false)),
         !spec});
  }
  {
    const bool spec = options.optimizer_placement.kind == OptimizerPlacementOptions::Kind::kOffloadStream;
    OptimizerPlacementOptions p = spec ? options.optimizer_placement : OptimizerPlacementOptions{};
    p.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
    if (!spec) {
      // An eighth of the larger parameter group at most: a bucket of the
      // whole group would stage more on the device than device AdamW keeps.
      const ParamLayout layout = LayoutOf(options);
      const int64_t group = std::max(layout.shard_numel(), layout.owned_numel_per_rank());
      p.bucket_params = std::max<int64_t>(1, std::min(p.bucket_params, (group + 7) / 8));
    }
    schedules.push_back({"offload_stream_adamw", [p](StepOptions* o) { o->optimizer_placement = p; },
                         absl::StrCat("offload_stream_adamw bucket_params=",
                                      spec ? chosen(3, p.bucket_params) : absl::StrCat(p.bucket_params),
                                      " staging_slots=", p.staging_slots, " ", Origin(spec))});
  }

  StepOptions off = options;
  off.dispatch.kind = DispatchOptions::Kind::kStandardEp;
  off.projection.kind = ProjectionOptions::Kind::kDense;
  off.checkpoints.kind = CheckpointOptions::Kind::kFull;
  off.optimizer_placement.kind = OptimizerPlacementOptions::Kind::kDevice;

  // The caller's stop (NMaxLimits::still_wanted) ends the table: told
  // apart from a row's own INVALID_ARGUMENT, which is an answer (below).
  absl::Status stopped;
  NMaxLimits row_limits = limits;
  if (limits.still_wanted) {
    row_limits.still_wanted = [&stopped, &limits] {
      absl::Status s = limits.still_wanted();
      if (!s.ok()) stopped = s;
      return s;
    };
  }
  std::vector<WhatIfRow> rows;
  auto add = [&](std::string name, std::vector<const Schedule*> on) -> absl::Status {
    StepOptions o = off;
    WhatIfRow row;
    row.schedules = std::move(name);
    bool adaptive_sco = false;
    for (const Schedule* s : on) {
      s->on(&o);
      row.settings.push_back(s->settings);
      adaptive_sco |= s->adaptive_sco;
    }
    if (on.empty()) row.settings.push_back("standard_ep, dense projection, full checkpoints, device AdamW");
    // Not a schedule of the table: every row keeps the spec's choice, and
    // says so where it costs memory.
    if (o.checkpoints.keep_attention) {
      row.settings.push_back(o.checkpoints.kind == CheckpointOptions::Kind::kSco
                                 ? "keep_attention (its records beside the boundaries in SCO's pools)"
                                 : "keep_attention (its records on the device)");
    }
    // A combination the model cannot run (e.g. Ring-DTP with fewer
    // vocabulary entries than ranks) is a row that says why, not a table
    // that fails.
    absl::StatusOr<PlanFunction> plan = PlanShapesOf(o);
    if (plan.ok() && per_shape != nullptr) plan = per_shape->plan(o);
    if (plan.ok() && adaptive_sco) plan = ScoEveryBoundary(caps, *plan);
    absl::StatusOr<NMax> n_max = !plan.ok() ? absl::StatusOr<NMax>(plan.status()) : Solve(o, caps, row_limits, *plan);
    PLATEAU_RETURN_IF_ERROR(stopped);
    if (n_max.ok()) {
      row.n_max = *std::move(n_max);
      // What the row's plan chose at each answer (planned again there).
      for (NMaxAxis* axis : {&row.n_max.batch, &row.n_max.context}) {
        if (per_shape == nullptr || !per_shape->values || axis->tokens_per_rank == 0) continue;
        StepOptions at = o;
        at.layout.batch = axis->batch;
        at.model.seq_len = axis->seq_len;
        PLATEAU_RETURN_IF_ERROR((*plan)(&at).status());
        axis->auto_values = per_shape->values(at);
      }
    } else if (n_max.status().code() == absl::StatusCode::kInvalidArgument) {
      for (NMaxAxis* axis : {&row.n_max.batch, &row.n_max.context}) {
        axis->limit = "refused";
        axis->detail = std::string(n_max.status().message());
      }
    } else {
      return n_max.status();
    }
    rows.push_back(std::move(row));
    return absl::OkStatus();
  };
  PLATEAU_RETURN_IF_ERROR(add("all off", {}));
  std::vector<const Schedule*> all;
  for (const Schedule& s : schedules) {
    PLATEAU_RETURN_IF_ERROR(add(s.name, {&s}));
    all.push_back(&s);
  }
  PLATEAU_RETURN_IF_ERROR(add("all on", all));
  return rows;
}

}  // namespace plateau
