#include "kernels/budget/budget.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/dispatch/standard_ep_plan.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/model/attention_shape.h"
#include "kernels/model/params.h"
#include "kernels/projection/projection_plan.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

int64_t ProjectionBytes(const StepOptions& o) {
  const ElementBytes e = ElementBytesOf(o.precision);
  if (o.projection.kind == ProjectionOptions::Kind::kRingDtp) {
    return RingDtpBoundBytes(RingDtpConfigOf(o), o.layout.ranks, e);
  }
  return DenseProjectionBoundBytes(TokensPerRank(o.model, o.layout), o.model.vocab_size, e);
}

absl::Status ValidateProjection(const StepOptions& o) {
  const ProjectionOptions& p = o.projection;
  if (p.kind != ProjectionOptions::Kind::kRingDtp) return absl::OkStatus();
  auto bad = [](absl::string_view field, absl::string_view expected, int64_t got) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got));
  };
  if (p.strip < 1) return bad("projection.ring_dtp.strip", ">= 1 vocabulary columns", p.strip);
  if (p.row_tile < 1) return bad("projection.ring_dtp.row_tile", ">= 1 token rows", p.row_tile);
  if (p.chunk_rows < 0) {
    return bad("projection.ring_dtp.chunk_rows", ">= 0 (0: one pass)", p.chunk_rows);
  }
  if (o.model.vocab_size < o.layout.ranks) {
    return bad("model.vocab_size", absl::StrCat(">= layout.ranks = ", o.layout.ranks,
                                                " (Ring-DTP gives every rank a vocabulary shard)"),
               o.model.vocab_size);
  }
  return absl::OkStatus();
}

}  // namespace

namespace {
LmHeadLayout LmHeadLayoutOf(const StepOptions& o) {
  return o.projection.kind == ProjectionOptions::Kind::kRingDtp ? LmHeadLayout::kVocabularySharded
                                                                 : LmHeadLayout::kDense;
}
}  // namespace

ParamLayout LayoutOf(const StepOptions& o) { return ParamLayout(o.model, o.layout.ranks, LmHeadLayoutOf(o)); }

std::vector<StepBufferSpec> StepLaunchBuffers(const StepOptions& o) { return StepLaunchBuffers(o, LayoutOf(o)); }

int64_t GradReduceStagingIndex(const std::vector<StepBufferSpec>& buffers) {
  int64_t best = -1;
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].set != LiveSet::kActivations || buffers[i].space != SpaceKind::kDevice) continue;
    if (best < 0 || buffers[i].bytes > buffers[best].bytes) best = static_cast<int64_t>(i);
  }
  return best;
}

int64_t StreamStateHostBytes(const StepOptions& o, const ParamLayout& p, bool with_sink) {
  const int64_t S = p.shard_numel(), X = p.owned_numel_per_rank(), f = sizeof(float);
  const bool bf16 = o.precision == Precision::kBf16Mixed;
  const int64_t shard = f * (3 * S + (bf16 ? 3 : 2) * X);
  // The chunk: the dense gradient buffer (D x w bytes) read as P x chunk
  // elements of the gathered fp32 state, floor(D x w / (P x 4)) per rank.
  const int64_t P = p.ranks(), chunk = p.dense_padded() * ElementBytesOf(o.precision).working / (P * f);
  return shard + (with_sink ? f * P * std::min(chunk, std::max(S, X)) : 0);
}

int64_t LoadStreamedStateHostBytes(const ParamLayout& p) {
  return static_cast<int64_t>(sizeof(float)) * 3 * (p.shard_numel() + p.owned_numel_per_rank());
}

int64_t AttentionRecordWidth(const StepOptions& o) {
  return o.checkpoints.keep_attention ? o.model.heads * o.model.head_dim() + o.model.heads : 0;
}

ScoPools CheckpointPools(const StepOptions& o) {
  const int64_t beta = o.checkpoints.kind == CheckpointOptions::Kind::kSco ? o.checkpoints.host_budget_bytes : 0;
  return PlanScoPools(o.model.layers, TokensPerRank(o.model, o.layout), o.model.hidden, AttentionRecordWidth(o), beta,
                      ElementBytesOf(o.precision));
}

std::vector<StepBufferSpec> StepLaunchBuffers(const StepOptions& o, const ParamLayout& p) {
  const ModelConfig& m = o.model;
  const int64_t N = TokensPerRank(m, o.layout), H = m.hidden, d = m.head_dim();
  const int64_t qd = m.heads * d, kvd = m.kv_heads * d, E = m.experts, K = m.top_k;
  const int64_t rows_h = N * m.heads;  // (token, head) rows of attention state
  // Element sizes by role (kernels/model/precision.h): w the working
  // precision (weights, gradients, activations), a fp32 for what reduces or
  // accumulates: RMSNorm's rstd, attention's online-softmax state (m, l),
  // log-sum-exp and delta = rowsum(dO o), its score panel, the running
  // output o (the online softmax's accumulator across the ring's hops,
  // finalised in place: kernels/step/ring_attention.h), the dK/dV
  // accumulators that travel the ring (summed over P hops), and the
  // router's logits, probabilities and gates (its softmax and top-k choice
  // are sensitive to rounding; N E values, small beside N H).
  // Every kActivations buffer is dead once the embedding's gradient is
  // done: the bf16 step lends the largest to its ZeRO gradient reduce as
  // staging (step.cc's Allocate, kernels/step/grad_reduce.h), which
  // therefore has no term of its own.
  const ElementBytes e = ElementBytesOf(o.precision);
  const int64_t w = e.working, a = e.accum, i32 = sizeof(int32_t);
  const int64_t D = p.dense_padded(), S = p.shard_numel(), X = p.owned_numel_per_rank();
  return {
      {"dense", LiveSet::kWeights, D * w},
      {"owned", LiveSet::kWeights, X * w},
      {"dense_grad", LiveSet::kGrads, D * w},
      {"dense_grad_shard", LiveSet::kGrads, S * w},
      {"owned_grad", LiveSet::kGrads, X * w},
      {"tokens", LiveSet::kActivations, N * i32},
      {"targets", LiveSet::kActivations, N * i32},
      {"a", LiveSet::kActivations, N * H * w},
      {"rstd_a", LiveSet::kActivations, N * a},
      {"q", LiveSet::kActivations, N * qd * w},
      {"kv", LiveSet::kActivations, 2 * N * kvd * w},
      {"ml", LiveSet::kActivations, 2 * rows_h * a},
      {"o", LiveSet::kActivations, N * qd * a},
      {"lse", LiveSet::kActivations, rows_h * a},
      {"h1", LiveSet::kActivations, N * H * w},
      {"u", LiveSet::kActivations, N * H * w},
      {"rstd_u", LiveSet::kActivations, N * a},
      {"rlogits", LiveSet::kActivations, N * E * a},
      {"probs", LiveSet::kActivations, N * E * a},
      {"chosen", LiveSet::kActivations, N * K * i32},
      {"gates", LiveSet::kActivations, N * K * a},
      {"z", LiveSet::kActivations, N * H * w},
      {"rstd_f", LiveSet::kActivations, N * a},
      {"dh", LiveSet::kActivations, N * H * w},
      {"dh1", LiveSet::kActivations, N * H * w},
      {"du", LiveSet::kActivations, N * H * w},
      {"tmp", LiveSet::kActivations, N * H * w},
      {"dgates", LiveSet::kActivations, N * K * a},
      {"drlogits", LiveSet::kActivations, N * E * a},
      {"dO", LiveSet::kActivations, N * qd * w},
      {"delta", LiveSet::kActivations, rows_h * a},
      {"dq", LiveSet::kActivations, N * qd * w},
      {"dkv", LiveSet::kActivations, 2 * N * kvd * w},
      // Two slots of the forward's travelling [K | V] block, and of the
      // backward's [K | V] block with its [dK | dV] accumulators.
      {"fwd_trav", LiveSet::kActivations, 2 * 2 * N * kvd * w},
      {"bwd_trav", LiveSet::kActivations, 2 * (2 * N * kvd * w + 2 * N * kvd * a)},
      {"attn_work", LiveSet::kActivations,
       AttentionWorkspaceFloats(
           {o.layout.batch, N / o.layout.batch, N / o.layout.batch, m.heads, m.kv_heads, d, 0, 0, 1.0f}) *
           a},
      {"stats", LiveSet::kWorkspace, 2 * static_cast<int64_t>(sizeof(double))},
      {"scalars", LiveSet::kWorkspace, 2 * a},
  };
}

absl::Status CheckBf16Schedules(const StepOptions& o) {
  if (o.precision != Precision::kBf16Mixed) return absl::OkStatus();
  // Every schedule computes bf16; what remains are shapes the bf16 step
  // cannot take. The router's logit gradient [N, E] (fp32) is converted to
  // bf16 for its two GEMMs into the step's `tmp` [N, H], idle there: no
  // buffer of its own, so E <= H.
  if (o.model.experts > o.model.hidden) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.experts: expected at most model.hidden = ", o.model.hidden,
        " under precision bf16 (the router's bf16 logit gradient lives in an [N, hidden] scratch), got ",
        o.model.experts));
  }
  // (Ring-DTP's bf16 activation mode also needs an even hidden, which
  // every valid model has: hidden = heads x an even head dimension,
  // ValidateModel; RingDtp::Create keeps its own check for direct use.)
  return absl::OkStatus();
}

RingDtpConfig RingDtpConfigOf(const StepOptions& o) {
  const int64_t N = TokensPerRank(o.model, o.layout);
  RingDtpConfig c;
  c.rows = N;
  c.hidden = o.model.hidden;
  c.vocab = o.model.vocab_size;
  c.strip = o.projection.strip;
  c.row_tile = o.projection.row_tile;
  c.chunk_rows = o.projection.chunk_rows;
  c.mode = o.projection.mode.value_or(RingDtpChooseMode(N, o.model.vocab_size, o.layout.ranks));
  return c;
}

absl::Status ValidateStepShape(const StepOptions& o) {
  PLATEAU_RETURN_IF_ERROR(ValidateLayout(o.model, o.layout));
  if (o.checkpoints.kind == CheckpointOptions::Kind::kSco) {
    PLATEAU_RETURN_IF_ERROR(ValidateSco(o.checkpoints.host_budget_bytes));
  }
  switch (o.dispatch.kind) {
    case DispatchOptions::Kind::kStandardEp:
      break;
    case DispatchOptions::Kind::kLlep:
      PLATEAU_RETURN_IF_ERROR(ValidateLlepShape(o.model, o.layout.ranks));
      PLATEAU_RETURN_IF_ERROR(ValidateLlepOptions(o.dispatch.llep));
      break;
    case DispatchOptions::Kind::kPipelinedLlep:
      PLATEAU_RETURN_IF_ERROR(ValidateLlepShape(o.model, o.layout.ranks));
      PLATEAU_RETURN_IF_ERROR(ValidatePipelinedLlepOptions(o.dispatch.pipelined));
      break;
  }
  if (o.optimizer_placement.kind == OptimizerPlacementOptions::Kind::kOffloadStream) {
    PLATEAU_RETURN_IF_ERROR(
        ValidateOffloadStream(o.optimizer_placement.bucket_params, o.optimizer_placement.staging_slots));
  }
  return ValidateProjection(o);
}

namespace {

int64_t Sum(const std::array<int64_t, kNumLiveSets>& bytes) {
  int64_t t = 0;
  for (int64_t b : bytes) t += b;
  return t;
}

void AppendSets(const std::array<int64_t, kNumLiveSets>& bytes, std::string* out) {
  for (int i = 0; i < kNumLiveSets; ++i) {
    if (bytes[i] == 0) continue;
    absl::StrAppend(out, LiveSetName(static_cast<LiveSet>(i)), "=", bytes[i], " ");
  }
  absl::StrAppend(out, "total=", Sum(bytes));
}

}  // namespace

int64_t MemoryPlan::total() const { return Sum(bytes); }
int64_t MemoryPlan::host_total() const { return Sum(host_bytes); }

std::string MemoryPlan::DebugString() const {
  std::string out;
  AppendSets(bytes, &out);
  if (host_total() > 0) {
    absl::StrAppend(&out, " host: ");
    AppendSets(host_bytes, &out);
  }
  return out;
}

absl::StatusOr<MemoryPlan> PlanMemory(const StepOptions& o) {
  PLATEAU_RETURN_IF_ERROR(ValidateStepShape(o));
  return PlanMemory(o, LayoutOf(o));
}

absl::StatusOr<MemoryPlan> PlanMemory(const StepOptions& o, const ParamLayout& p) {
  PLATEAU_RETURN_IF_ERROR(ValidateStepShape(o));
  const ModelConfig& m = o.model;
  const ModelConfig& lm = p.model();
  if (p.ranks() != o.layout.ranks || p.lm_head_layout() != LmHeadLayoutOf(o) ||
      lm.vocab_size != m.vocab_size || lm.hidden != m.hidden || lm.layers != m.layers || lm.heads != m.heads ||
      lm.kv_heads != m.kv_heads || lm.experts != m.experts || lm.expert_ffn != m.expert_ffn) {
    return absl::InvalidArgumentError("PlanMemory: the parameter layout given is not LayoutOf(options)");
  }
  MemoryPlan plan;
  for (const StepBufferSpec& b : StepLaunchBuffers(o, p)) {
    auto& space = b.space == SpaceKind::kHost ? plan.host_bytes : plan.bytes;
    space[static_cast<int>(b.set)] += b.bytes;
  }
  const int64_t N = TokensPerRank(o.model, o.layout);
  plan.bytes[static_cast<int>(LiveSet::kProjection)] += ProjectionBytes(o);
  // Optimizer: master, m and v on the device, or on the host (with staging
  // slots on the device when streamed).
  const int64_t S = p.shard_numel(), X = p.owned_numel_per_rank();
  const OptimizerPlacementOptions& op = o.optimizer_placement;
  const ElementBytes e = ElementBytesOf(o.precision);
  const OptimizerBytes optimizer =
      op.kind == OptimizerPlacementOptions::Kind::kCpuOffload ? CpuOffloadAdamWBytes(S, X, e)
      : op.kind == OptimizerPlacementOptions::Kind::kOffloadStream
          ? OffloadStreamAdamWBytes(S, X, op.bucket_params, op.staging_slots, e)
          : OptimizerBytes{DeviceAdamWBytes(S, X, e), 0};
  plan.bytes[static_cast<int>(LiveSet::kOptimizer)] += optimizer.device;
  plan.host_bytes[static_cast<int>(LiveSet::kOptimizer)] += optimizer.host;
  // Checkpoints: every boundary (and attention record, under
  // keep_attention) on the device, or SCO's device part and host pool
  // (FullCheckpointsBytes is PlanSco's device bytes at beta = 0).
  const ScoPools checkpoints = CheckpointPools(o);
  plan.bytes[static_cast<int>(LiveSet::kCheckpoints)] += checkpoints.device_bytes();
  plan.host_bytes[static_cast<int>(LiveSet::kCheckpoints)] += checkpoints.host_bytes();
  // Dispatch. Standard EP and LLEP have no bound of their own: their
  // receive buffers grow with the routes a rank is sent. Their plan is the
  // worst case (every route of every source rank lands on one rank), so that
  // it bounds every routing; the balanced case (N*k rows received, nothing
  // borrowed) is kept beside it for information. PipelinedLLEP's is its
  // bound, allocated at launch, flat in N (plus its pinned index staging and
  // the counts it keeps per layer for the recompute, on the host).
  const int64_t routes = N * o.model.top_k, P = o.layout.ranks;
  int64_t& dispatch = plan.bytes[static_cast<int>(LiveSet::kDispatch)];
  switch (o.dispatch.kind) {
    case DispatchOptions::Kind::kStandardEp:
      dispatch += StandardEpPeakBytes(o.model, routes, StandardEpWorstCaseReceivedRows(o.model, P, N), e);
      plan.dispatch_balanced_bytes = StandardEpPeakBytes(o.model, routes, routes, e);
      plan.dispatch_note = "standard_ep's worst case (every route of every rank received by one rank)";
      plan.routing_bytes = dispatch;
      break;
    case DispatchOptions::Kind::kLlep: {
      dispatch += LlepWorstCasePeakBytes(o.model, P, N, o.dispatch.llep, e);
      LlepChunkSizes balanced;
      balanced.tokens = N;
      balanced.routes = routes;
      balanced.rows = routes;
      plan.dispatch_balanced_bytes = LlepPeakBytes(o.model, P, balanced, e);
      plan.dispatch_note = "llep's worst case (every route received by one rank, the most experts borrowed)";
      plan.routing_bytes = dispatch;
      break;
    }
    case DispatchOptions::Kind::kPipelinedLlep:
      dispatch += PipelinedLlepBoundBytes(o.model, P, N, o.dispatch.pipelined, e);
      plan.host_bytes[static_cast<int>(LiveSet::kDispatch)] +=
          PipelinedLlepHostBytes(o.model, P, N, o.dispatch.pipelined);
      plan.dispatch_balanced_bytes = dispatch;
      plan.dispatch_note = "pipelined_llep's bound, for every routing (Eq. 1: P c k rows per chunk)";
      break;
  }
  return plan;
}


}  // namespace plateau
