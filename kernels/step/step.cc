#include "kernels/step/step.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/model/model_kernels.h"
#include "kernels/step/ring_attention.h"
#include "kernels/step/schedules.h"
#include "kernels/status_macros.h"

namespace plateau {

struct TrainingStep::Impl {
  std::unique_ptr<Stream> compute, comm;
  std::unique_ptr<Event> ev_compute, ev_comm;
  std::unique_ptr<ModelKernels> kernels;
  // The schedule at each point (kernels/step/schedules.h).
  std::unique_ptr<BoundaryStore> checkpoints;  // the L+1 layer boundaries h_0 … h_L
  std::unique_ptr<ExpertDispatch> dispatch;
  std::unique_ptr<VocabProjection> projection;
  // kOptimizer lives here: the dense shard's master and AdamW moments, the
  // owned weights' moments (fp32: they are their own master).
  std::unique_ptr<OptimizerUpdate> optimizer;

  // kWeights: working dense weights (all-gathered) and this rank's owned
  // weights (its experts; under Ring-DTP also its lm_head vocabulary shard:
  // kernels/model/params.h).
  Buffer dense, owned;
  // kGrads
  Buffer dense_grad, dense_grad_shard, owned_grad;
  // kActivations: one layer's working set (recomputed in backward).
  Buffer tokens, targets;               // int32 [N]
  Buffer a, rstd_a, q, kv, ml, o, lse;  // kv: [k | v]; ml: [m | l]
  Buffer h1, u, rstd_u, rlogits, probs, chosen, gates;
  Buffer z, rstd_f, dh, dh1, du, tmp, dgates, drlogits, dO, delta, dq, dkv;
  Buffer fwd_trav, bwd_trav;            // ring travellers, two of each
  Buffer attn_work;                     // attention panel scratch
  // kWorkspace
  Buffer stats;    // 2 doubles: loss sum, valid count
  Buffer scalars;  // 2 floats: squared norms (dense shard, owned weights)

  int64_t off_embed = 0, off_final_norm = 0;
  // This rank's rows of lm_head (the projection's FirstWeightRow() onward)
  // and of its gradient: in the dense weights, or in the owned vector.
  float* lm_head = nullptr;
  float* lm_head_grad = nullptr;
  struct LayerOff {
    int64_t attn_norm, wq, wk, wv, wo, moe_norm, router;
  };
  std::vector<LayerOff> layer_off;
};

namespace {

// The Impl member of each launch-sized buffer, in the order of the budget's
// StepLaunchBuffers (kernels/budget/budget.h), which names each one: the plan
// and the allocation read one list of sizes.
struct LaunchMember {
  const char* name;
  Buffer TrainingStep::Impl::*member;
};

const std::vector<LaunchMember>& LaunchMembers() {
  using I = TrainingStep::Impl;
  static const std::vector<LaunchMember> kMembers = {
      {"dense", &I::dense},
      {"owned", &I::owned},
      {"dense_grad", &I::dense_grad},
      {"dense_grad_shard", &I::dense_grad_shard},
      {"owned_grad", &I::owned_grad},
      {"tokens", &I::tokens},
      {"targets", &I::targets},
      {"a", &I::a},
      {"rstd_a", &I::rstd_a},
      {"q", &I::q},
      {"kv", &I::kv},
      {"ml", &I::ml},
      {"o", &I::o},
      {"lse", &I::lse},
      {"h1", &I::h1},
      {"u", &I::u},
      {"rstd_u", &I::rstd_u},
      {"rlogits", &I::rlogits},
      {"probs", &I::probs},
      {"chosen", &I::chosen},
      {"gates", &I::gates},
      {"z", &I::z},
      {"rstd_f", &I::rstd_f},
      {"dh", &I::dh},
      {"dh1", &I::dh1},
      {"du", &I::du},
      {"tmp", &I::tmp},
      {"dgates", &I::dgates},
      {"drlogits", &I::drlogits},
      {"dO", &I::dO},
      {"delta", &I::delta},
      {"dq", &I::dq},
      {"dkv", &I::dkv},
      {"fwd_trav", &I::fwd_trav},
      {"bwd_trav", &I::bwd_trav},
      {"attn_work", &I::attn_work},
      {"stats", &I::stats},
      {"scalars", &I::scalars},
  };
  return kMembers;
}

absl::Status ValidateOptions(const StepOptions& o, int world_size) {
  PLATEAU_RETURN_IF_ERROR(ValidateStepShape(o));
  if (o.layout.ranks != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("layout.ranks: expected the world size ",
                                                   world_size, ", got ", o.layout.ranks));
  }
  const OptimizerConfig& opt = o.optimizer;
  AdamWArgs a{opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, 1, 1.0f};
  absl::Status s = ValidateAdamW(a);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("optimizer.", s.message()));
  if (!(opt.max_grad_norm >= 0.0f) || !std::isfinite(opt.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.max_grad_norm: expected a finite value >= 0, got ", opt.max_grad_norm));
  }
  return absl::OkStatus();
}

// The budget plans either precision; the kernels must compute the one
// asked, or the step would run fp32 in buffers sized for bf16.
absl::Status CheckPrecision(Precision p, const Backend& backend) {
  if (p == Precision::kFp32 || backend.computes_bf16()) return absl::OkStatus();
  if (backend.kind() == BackendKind::kCpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "precision: the cpu backend computes fp32 only, got ", PrecisionName(p),
        " (bf16 mixed precision is for the cuda backend, whose bf16 step is not written yet: issue 17)"));
  }
  return absl::UnimplementedError(absl::StrCat("precision: ", PrecisionName(p),
                                               " is not computed by this build's backend yet (issue 17)"));
}

}  // namespace

// ---------------------------------------------------------------------------

TrainingStep::TrainingStep(const StepOptions& options, Backend& backend, Communicator& world)
    : options_(options),
      backend_(backend),
      world_(world),
      layout_(LayoutOf(options)),
      impl_(std::make_unique<Impl>()) {}

TrainingStep::~TrainingStep() {
  // Outstanding work must finish before the buffers it uses are freed.
  if (impl_->compute) impl_->compute->Synchronize().IgnoreError();
  if (impl_->comm) impl_->comm->Synchronize().IgnoreError();
}

absl::StatusOr<std::unique_ptr<TrainingStep>> TrainingStep::Create(const StepOptions& options,
                                                                  Backend& backend,
                                                                  Communicator& world) {
  PLATEAU_RETURN_IF_ERROR(ValidateOptions(options, world.size()));
  PLATEAU_RETURN_IF_ERROR(CheckPrecision(options.precision, backend));
  // Refuse a device that cannot hold the launch-sized state before touching it.
  PLATEAU_ASSIGN_OR_RETURN(MemoryPlan plan, PlanMemory(options));
  const int64_t cap = backend.device().cap_bytes();
  if (cap != MemorySpace::kUncapped && plan.launch_total() > cap) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "device_memory_bytes: ", cap, " bytes cannot hold the step's launch-sized state of ",
        plan.launch_total(), " bytes (", plan.DebugString(), ")"));
  }
  // Every host live set is launch-sized: the whole host plan must fit.
  const int64_t host_cap = backend.host().cap_bytes();
  if (host_cap != MemorySpace::kUncapped && plan.host_total() > host_cap) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "host_memory_bytes: ", host_cap, " bytes cannot hold the step's host state of ",
        plan.host_total(), " bytes (", plan.DebugString(), ")"));
  }
  std::unique_ptr<TrainingStep> step(new TrainingStep(options, backend, world));
  PLATEAU_RETURN_IF_ERROR(step->Allocate());
  return step;
}

absl::Status TrainingStep::Allocate() {
  Impl& I = *impl_;
  const ModelConfig& m = options_.model;
  PLATEAU_ASSIGN_OR_RETURN(I.compute, backend_.CreateStream("compute"));
  PLATEAU_ASSIGN_OR_RETURN(I.comm, backend_.CreateStream("comm"));
  PLATEAU_ASSIGN_OR_RETURN(I.ev_compute, backend_.CreateEvent());
  PLATEAU_ASSIGN_OR_RETURN(I.ev_comm, backend_.CreateEvent());
  PLATEAU_ASSIGN_OR_RETURN(I.kernels, ModelKernels::Create(backend_));
  const std::vector<StepBufferSpec> specs = StepLaunchBuffers(options_);
  const std::vector<LaunchMember>& members = LaunchMembers();
  if (specs.size() != members.size()) {
    return absl::InternalError(absl::StrCat("the budget lists ", specs.size(),
                                            " launch buffers, the step has ", members.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (absl::string_view(specs[i].name) != members[i].name) {
      return absl::InternalError(absl::StrCat("launch buffer ", i, ": the budget names '",
                                              specs[i].name, "', the step '", members[i].name, "'"));
    }
    MemorySpace& space = specs[i].space == SpaceKind::kHost ? backend_.host() : backend_.device();
    PLATEAU_ASSIGN_OR_RETURN(I.*(members[i].member), space.Allocate(specs[i].set, specs[i].bytes));
  }
  OptimizerParams params;
  params.dense_working = I.dense.as<float>();
  params.owned = I.owned.as<float>();
  params.dense_grad_shard = I.dense_grad_shard.as<float>();
  params.owned_grad = I.owned_grad.as<float>();
  params.shard_numel = layout_.shard_numel();
  params.owned_numel = layout_.owned_numel_per_rank();
  PLATEAU_ASSIGN_OR_RETURN(StepSchedules schedules, CreateSchedules({options_, backend_, *I.kernels, world_,
                                                                     *I.compute, *I.comm, params}));
  I.checkpoints = std::move(schedules.checkpoints);
  I.dispatch = std::move(schedules.dispatch);
  I.projection = std::move(schedules.projection);
  I.optimizer = std::move(schedules.optimizer);

  I.off_embed = layout_.DenseOffset("embed.weight");
  I.off_final_norm = layout_.DenseOffset("final_norm.weight");
  if (layout_.lm_head_layout() == LmHeadLayout::kVocabularySharded) {
    // The owned vector holds exactly the projection's rows.
    I.lm_head = I.owned.as<float>() + layout_.lm_head_shard_offset();
    I.lm_head_grad = I.owned_grad.as<float>() + layout_.lm_head_shard_offset();
  } else {
    const int64_t rows = layout_.DenseOffset("lm_head.weight") + I.projection->FirstWeightRow() * m.hidden;
    I.lm_head = I.dense.as<float>() + rows;
    I.lm_head_grad = I.dense_grad.as<float>() + rows;
  }
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = absl::StrCat("layers.", l, ".");
    I.layer_off.push_back({layout_.DenseOffset(p + "attn_norm.weight"),
                           layout_.DenseOffset(p + "attn.wq"), layout_.DenseOffset(p + "attn.wk"),
                           layout_.DenseOffset(p + "attn.wv"), layout_.DenseOffset(p + "attn.wo"),
                           layout_.DenseOffset(p + "moe_norm.weight"),
                           layout_.DenseOffset(p + "router.weight")});
  }

  // Initial weights: this rank's shard and owned weights, then the all-gather.
  const int64_t rank = world_.rank();
  std::vector<float> owned = layout_.InitOwned(rank, options_.seed);
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.compute, I.owned.data(), owned.data(), I.owned.bytes()));
  OptimizerShardState initial;  // zero moments
  initial.dense_master = layout_.InitDenseShard(rank, options_.seed);
  return I.optimizer->Load(initial);
}

absl::Status TrainingStep::CheckBatch(const std::vector<int32_t>& tokens,
                                      const std::vector<int32_t>& targets) const {
  const int64_t N = TokensPerRank(options_.model, options_.layout);
  if (static_cast<int64_t>(tokens.size()) != N || static_cast<int64_t>(targets.size()) != N) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch: expected ", N, " tokens and targets per rank (batch * seq_len / ranks), got ",
        tokens.size(), " and ", targets.size()));
  }
  const int64_t V = options_.model.vocab_size;
  for (int64_t i = 0; i < N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch.tokens[", i, "] = ", tokens[i], " is outside [0, ", V, ")"));
    }
    if (targets[i] != kIgnoreIndex && (targets[i] < 0 || targets[i] >= V)) {
      return absl::InvalidArgumentError(absl::StrCat("batch.targets[", i, "] = ", targets[i],
                                                     " is outside [0, ", V, ") and not ",
                                                     kIgnoreIndex));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// The step itself. Everything below is enqueued on the compute stream unless
// it says comm; the two meet through events.

namespace {

struct Ctx {
  const ModelConfig& m;
  const ParamLayout& p;
  Backend& be;
  Communicator& world;
  TrainingStep::Impl& I;
  int64_t N, B, Ns, rank, P;
  int64_t qd() const { return m.heads * m.head_dim(); }
  int64_t kvd() const { return m.kv_heads * m.head_dim(); }
  Stream& c() { return *I.compute; }
  float* W(int64_t off) { return I.dense.as<float>() + off; }
  float* G(int64_t off) { return I.dense_grad.as<float>() + off; }
  ExpertWeights experts(int64_t l) {
    const float* e = I.owned.as<float>();
    return {e + p.ExpertOffset(l, 0, 0), e + p.ExpertOffset(l, 1, 0), e + p.ExpertOffset(l, 2, 0)};
  }
  ExpertGrads expert_grads(int64_t l) {
    float* e = I.owned_grad.as<float>();
    return {e + p.ExpertOffset(l, 0, 0), e + p.ExpertOffset(l, 1, 0), e + p.ExpertOffset(l, 2, 0)};
  }
  AttentionShape shape() const {
    return {B, Ns, Ns, m.heads, m.kv_heads, m.head_dim(), rank * Ns, 0,
            1.0f / std::sqrt(static_cast<float>(m.head_dim()))};
  }
  // comm waits for what compute has enqueued so far, and vice versa.
  absl::Status CommAfterCompute() {
    PLATEAU_RETURN_IF_ERROR(I.compute->Record(*I.ev_compute));
    return I.comm->Wait(*I.ev_compute);
  }
  absl::Status ComputeAfterComm() {
    PLATEAU_RETURN_IF_ERROR(I.comm->Record(*I.ev_comm));
    return I.compute->Wait(*I.ev_comm);
  }
  absl::Status Gemm(bool ta, bool tb, int64_t M, int64_t Nn, int64_t K, const float* a,
                    int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
    return be.Gemm(*I.compute, {ta, tb, M, Nn, K, 1.0f, a, lda, b, ldb, beta, c, ldc});
  }
};

// Ring attention (ring_attention.h) on the step's buffers.
RingAttention Ring(Ctx& x) {
  TrainingStep::Impl& I = x.I;
  return RingAttention{x.be, *I.kernels, x.world, *I.compute, *I.comm, *I.ev_compute, *I.ev_comm,
                       x.shape(), x.N};
}

absl::Status RingForward(Ctx& x) {
  TrainingStep::Impl& I = x.I;
  return Ring(x).Forward(I.q.as<float>(), I.kv.as<float>(), I.ml.as<float>(), I.o.as<float>(),
                         I.lse.as<float>(), I.fwd_trav.as<float>(), I.attn_work.as<float>());
}

absl::Status RingBackward(Ctx& x) {
  TrainingStep::Impl& I = x.I;
  return Ring(x).Backward(I.q.as<float>(), I.kv.as<float>(), I.dO.as<float>(), I.lse.as<float>(),
                          I.delta.as<float>(), I.dq.as<float>(), I.dkv.as<float>(), I.bwd_trav.as<float>(),
                          I.attn_work.as<float>());
}

// Layer l from its input `in` (boundary l) to `out` (boundary l+1). Leaves
// the working set (and the dispatch state) in place for LayerBackward. With
// `for_backward` (the recompute before LayerBackward) `out` is scratch and
// the dispatch point may skip its output (ExpertDispatch::ForwardForBackward:
// PipelinedLLEP's Backward replays its chunks anyway).
absl::Status LayerForward(Ctx& x, int64_t l, const float* in, float* out,
                          bool for_backward = false) {
  TrainingStep::Impl& I = x.I;
  const ModelConfig& m = x.m;
  const auto& off = I.layer_off[l];
  const int64_t N = x.N, H = m.hidden, qd = x.qd(), kvd = x.kvd();
  PLATEAU_RETURN_IF_ERROR(x.be.RmsNormForward(x.c(), I.a.as<float>(), I.rstd_a.as<float>(), in,
                                              x.W(off.attn_norm), N, H, m.norm_eps));
  float* k = I.kv.as<float>();
  float* v = k + N * kvd;
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, qd, H, I.a.as<float>(), H, x.W(off.wq), qd, 0.0f, I.q.as<float>(), qd));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, kvd, H, I.a.as<float>(), H, x.W(off.wk), kvd, 0.0f, k, kvd));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, kvd, H, I.a.as<float>(), H, x.W(off.wv), kvd, 0.0f, v, kvd));
  PLATEAU_RETURN_IF_ERROR(I.kernels->Rope(x.c(), I.q.as<float>(), x.B, x.Ns, m.heads, m.head_dim(),
                                          x.rank * x.Ns, m.rope_theta, false));
  PLATEAU_RETURN_IF_ERROR(I.kernels->Rope(x.c(), k, x.B, x.Ns, m.kv_heads, m.head_dim(),
                                          x.rank * x.Ns, m.rope_theta, false));
  PLATEAU_RETURN_IF_ERROR(RingForward(x));
  // h1 = in + o wo
  PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.c(), I.h1.data(), in, N * H * sizeof(float)));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, H, qd, I.o.as<float>(), qd, x.W(off.wo), H, 1.0f, I.h1.as<float>(), H));
  // MoE on rmsnorm(h1).
  PLATEAU_RETURN_IF_ERROR(x.be.RmsNormForward(x.c(), I.u.as<float>(), I.rstd_u.as<float>(),
                                              I.h1.as<float>(), x.W(off.moe_norm), N, H, m.norm_eps));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, m.experts, H, I.u.as<float>(), H, x.W(off.router),
                                 m.experts, 0.0f, I.rlogits.as<float>(), m.experts));
  PLATEAU_RETURN_IF_ERROR(I.kernels->Router(x.c(), I.rlogits.as<float>(), N, m.experts, m.top_k,
                                            I.probs.as<float>(), I.chosen.as<int32_t>(),
                                            I.gates.as<float>()));
  PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.c(), out, I.h1.data(), N * H * sizeof(float)));
  if (for_backward) {
    return I.dispatch->ForwardForBackward(I.u.as<float>(), I.chosen.as<int32_t>(),
                                          I.gates.as<float>(), N, x.experts(l), out);
  }
  return I.dispatch->Forward(I.u.as<float>(), I.chosen.as<int32_t>(), I.gates.as<float>(), N,
                       x.experts(l), out);
}

// Given dh = d loss / d boundary l+1 (after LayerForward(l) recomputed the
// working set), accumulates layer l's weight gradients and turns dh into
// d loss / d boundary l.
absl::Status LayerBackward(Ctx& x, int64_t l, const float* in) {
  TrainingStep::Impl& I = x.I;
  const ModelConfig& m = x.m;
  const auto& off = I.layer_off[l];
  const int64_t N = x.N, H = m.hidden, qd = x.qd(), kvd = x.kvd(), E = m.experts;
  float* dh = I.dh.as<float>();
  // MoE: out = h1 + moe(rmsnorm(h1)).
  PLATEAU_RETURN_IF_ERROR(x.be.Fill(x.c(), I.du.as<float>(), N * H, 0.0f));
  PLATEAU_RETURN_IF_ERROR(I.dispatch->Backward(dh, x.experts(l), I.du.as<float>(), I.dgates.as<float>(),
                                         x.expert_grads(l)));
  PLATEAU_RETURN_IF_ERROR(I.kernels->RouterBackward(x.c(), I.probs.as<float>(), I.chosen.as<int32_t>(),
                                                    I.gates.as<float>(), I.dgates.as<float>(), N, E,
                                                    m.top_k, I.drlogits.as<float>()));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, H, E, N, I.u.as<float>(), H, I.drlogits.as<float>(), E,
                                 1.0f, x.G(off.router), E));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, H, E, I.drlogits.as<float>(), E, x.W(off.router), E,
                                 1.0f, I.du.as<float>(), H));
  PLATEAU_RETURN_IF_ERROR(x.be.RmsNormBackward(x.c(), I.tmp.as<float>(), x.G(off.moe_norm),
                                               I.du.as<float>(), I.h1.as<float>(), x.W(off.moe_norm),
                                               I.rstd_u.as<float>(), N, H));
  float* dh1 = I.dh1.as<float>();
  PLATEAU_RETURN_IF_ERROR(x.be.Add(x.c(), dh1, dh, I.tmp.as<float>(), N * H));
  // Attention: h1 = in + attn(rmsnorm(in)).
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, qd, H, N, I.o.as<float>(), qd, dh1, H, 1.0f, x.G(off.wo), H));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, qd, H, dh1, H, x.W(off.wo), H, 0.0f, I.dO.as<float>(), qd));
  const AttentionShape s = x.shape();
  PLATEAU_RETURN_IF_ERROR(I.kernels->AttentionDelta(x.c(), s, I.o.as<float>(), I.dO.as<float>(),
                                                    I.delta.as<float>()));
  PLATEAU_RETURN_IF_ERROR(RingBackward(x));
  float* dk = I.dkv.as<float>();
  float* dv = dk + N * kvd;
  PLATEAU_RETURN_IF_ERROR(I.kernels->Rope(x.c(), I.dq.as<float>(), x.B, x.Ns, m.heads, m.head_dim(),
                                          x.rank * x.Ns, m.rope_theta, true));
  PLATEAU_RETURN_IF_ERROR(I.kernels->Rope(x.c(), dk, x.B, x.Ns, m.kv_heads, m.head_dim(),
                                          x.rank * x.Ns, m.rope_theta, true));
  const float* a = I.a.as<float>();
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, H, qd, N, a, H, I.dq.as<float>(), qd, 1.0f, x.G(off.wq), qd));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, H, kvd, N, a, H, dk, kvd, 1.0f, x.G(off.wk), kvd));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, H, kvd, N, a, H, dv, kvd, 1.0f, x.G(off.wv), kvd));
  float* da = I.du.as<float>();  // du is consumed: reuse it for d a
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, H, qd, I.dq.as<float>(), qd, x.W(off.wq), qd, 0.0f, da, H));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, H, kvd, dk, kvd, x.W(off.wk), kvd, 1.0f, da, H));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, H, kvd, dv, kvd, x.W(off.wv), kvd, 1.0f, da, H));
  PLATEAU_RETURN_IF_ERROR(x.be.RmsNormBackward(x.c(), I.tmp.as<float>(), x.G(off.attn_norm), da, in,
                                               x.W(off.attn_norm), I.rstd_a.as<float>(), N, H));
  return x.be.Add(x.c(), dh, dh1, I.tmp.as<float>(), N * H);
}

}  // namespace

absl::StatusOr<StepStats> TrainingStep::ForwardBackward(const std::vector<int32_t>& tokens,
                                                        const std::vector<int32_t>& targets,
                                                        PhaseRecorder* phases) {
  return Pass(tokens, targets, phases, /*backward=*/true);
}

absl::StatusOr<StepStats> TrainingStep::Evaluate(const std::vector<int32_t>& tokens,
                                                 const std::vector<int32_t>& targets) {
  return Pass(tokens, targets, nullptr, /*backward=*/false);
}

absl::StatusOr<StepStats> TrainingStep::Pass(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                                             PhaseRecorder* phases, bool backward) {
  PLATEAU_RETURN_IF_ERROR(CheckBatch(tokens, targets));
  Impl& I = *impl_;
  const ModelConfig& m = options_.model;
  const int64_t N = TokensPerRank(m, options_.layout), H = m.hidden;
  Ctx x{m, layout_, backend_, world_, I, N, options_.layout.batch, m.seq_len / world_.size(),
        world_.rank(), world_.size()};
  backend_.device().tracker().ResetPeaks();
  backend_.host().tracker().ResetPeaks();

  PLATEAU_RETURN_IF_ERROR(backend_.Copy(x.c(), I.tokens.data(), tokens.data(), N * sizeof(int32_t)));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(x.c(), I.targets.data(), targets.data(), N * sizeof(int32_t)));
  PLATEAU_RETURN_IF_ERROR(backend_.Fill(x.c(), I.dense_grad.as<float>(), layout_.dense_padded(), 0.0f));
  PLATEAU_RETURN_IF_ERROR(backend_.Fill(x.c(), I.owned_grad.as<float>(), layout_.owned_numel_per_rank(), 0.0f));

  // Forward: keep only the layer boundaries, in the checkpoint store.
  BoundaryStore& boundaries = *I.checkpoints;
  PLATEAU_ASSIGN_OR_RETURN(float* h, boundaries.Slot(0));
  PLATEAU_RETURN_IF_ERROR(I.kernels->Embedding(x.c(), x.W(I.off_embed), m.vocab_size,
                                               I.tokens.as<int32_t>(), N, H, h));
  PLATEAU_RETURN_IF_ERROR(boundaries.Produced(0));
  EndPhase(phases, StepPhase::kEmbedding);
  for (int64_t l = 0; l < m.layers; ++l) {
    PLATEAU_ASSIGN_OR_RETURN(float* next, boundaries.Slot(l + 1));
    PLATEAU_RETURN_IF_ERROR(LayerForward(x, l, h, next));
    I.dispatch->Release();
    PLATEAU_RETURN_IF_ERROR(boundaries.Produced(l + 1));
    EndPhase(phases, StepPhase::kForward, l);
    h = next;
  }
  const float* hL = h;
  PLATEAU_RETURN_IF_ERROR(backend_.RmsNormForward(x.c(), I.z.as<float>(), I.rstd_f.as<float>(), hL,
                                                  x.W(I.off_final_norm), N, H, m.norm_eps));
  double* stats = I.stats.as<double>();
  PLATEAU_RETURN_IF_ERROR(backend_.Fill(x.c(), I.scalars.as<float>(), 2, 0.0f));
  {
    static constexpr double kZero[2] = {0.0, 0.0};
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(x.c(), stats, kZero, sizeof(kZero)));
  }
  // The projection reads and writes its rows of lm_head: all of them in the
  // all-gathered dense weights (dense projection; the reduce-scatter sums
  // their gradient), or this rank's vocabulary shard in its owned weights
  // (Ring-DTP completes the shard's gradient here: no reduce-scatter).
  PLATEAU_RETURN_IF_ERROR(I.projection->Forward(I.z.as<float>(), I.lm_head, I.targets.as<int32_t>(), stats));
  // The mean is over the global batch: sum and count from every rank.
  PLATEAU_RETURN_IF_ERROR(x.CommAfterCompute());
  PLATEAU_RETURN_IF_ERROR(world_.AllReduce(*I.comm, stats, stats, 2, DataType::kFloat64, ReduceOp::kSum));
  double host_stats[2];
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.comm, host_stats, stats, sizeof(host_stats)));
  PLATEAU_RETURN_IF_ERROR(I.comm->Synchronize());
  StepStats out;
  out.valid_tokens = static_cast<int64_t>(host_stats[1]);
  out.loss = out.valid_tokens > 0 ? host_stats[0] / host_stats[1] : 0.0;
  const float scale = out.valid_tokens > 0 ? static_cast<float>(1.0 / host_stats[1]) : 0.0f;
  EndPhase(phases, StepPhase::kProjectionForward);
  if (!backward) {
    // Nothing reads the boundaries: release them in the backward's order
    // (SCO brings its host ones back and drops them, within the step's own
    // peaks), so that the store ends the pass as a step leaves it.
    for (int64_t l = m.layers; l >= 0; --l) {
      PLATEAU_RETURN_IF_ERROR(boundaries.Acquire(l).status());
      PLATEAU_RETURN_IF_ERROR(boundaries.Done(l));
    }
    PLATEAU_RETURN_IF_ERROR(I.compute->Synchronize());
    out.step = step_;
    out.device = backend_.device().tracker().Snapshot();
    out.host = backend_.host().tracker().Snapshot();
    return out;
  }

  // Backward.
  PLATEAU_RETURN_IF_ERROR(I.projection->Backward(I.z.as<float>(), I.lm_head, I.targets.as<int32_t>(),
                                                 scale, I.tmp.as<float>(), I.lm_head_grad));
  PLATEAU_ASSIGN_OR_RETURN(hL, boundaries.Acquire(m.layers));
  PLATEAU_RETURN_IF_ERROR(backend_.RmsNormBackward(x.c(), I.dh.as<float>(), x.G(I.off_final_norm),
                                                   I.tmp.as<float>(), hL, x.W(I.off_final_norm),
                                                   I.rstd_f.as<float>(), N, H));
  PLATEAU_RETURN_IF_ERROR(boundaries.Done(m.layers));
  EndPhase(phases, StepPhase::kProjectionBackward);
  for (int64_t l = m.layers - 1; l >= 0; --l) {
    // Recompute the layer from its checkpoint; its output is not needed
    // again, so it goes to scratch (tmp, which LayerBackward overwrites),
    // not back into the store.
    PLATEAU_ASSIGN_OR_RETURN(const float* in, boundaries.Acquire(l));
    PLATEAU_RETURN_IF_ERROR(LayerForward(x, l, in, I.tmp.as<float>(), /*for_backward=*/true));
    EndPhase(phases, StepPhase::kRecompute, l);
    PLATEAU_RETURN_IF_ERROR(LayerBackward(x, l, in));
    PLATEAU_RETURN_IF_ERROR(boundaries.Done(l));
    EndPhase(phases, StepPhase::kBackward, l);
  }
  PLATEAU_RETURN_IF_ERROR(I.kernels->EmbeddingBackward(x.c(), I.dh.as<float>(), I.tokens.as<int32_t>(),
                                                       N, H, x.G(I.off_embed)));
  // ZeRO: every rank's dense gradient summed into the owner's shard.
  PLATEAU_RETURN_IF_ERROR(x.CommAfterCompute());
  PLATEAU_RETURN_IF_ERROR(world_.ReduceScatter(*I.comm, I.dense_grad.data(), I.dense_grad_shard.data(),
                                               layout_.shard_numel(), DataType::kFloat32,
                                               ReduceOp::kSum));
  PLATEAU_RETURN_IF_ERROR(I.comm->Synchronize());
  PLATEAU_RETURN_IF_ERROR(I.compute->Synchronize());
  EndPhase(phases, StepPhase::kGradReduce);
  out.step = step_;
  out.device = backend_.device().tracker().Snapshot();
  out.host = backend_.host().tracker().Snapshot();
  return out;
}

absl::StatusOr<StepStats> TrainingStep::Step(const std::vector<int32_t>& tokens,
                                             const std::vector<int32_t>& targets, PhaseRecorder* phases) {
  PLATEAU_ASSIGN_OR_RETURN(StepStats out, ForwardBackward(tokens, targets, phases));
  Impl& I = *impl_;
  const OptimizerConfig& o = options_.optimizer;
  const int64_t S = layout_.shard_numel(), X = layout_.owned_numel_per_rank();
  // Global gradient norm: this rank's dense shard and owned weights, summed over ranks.
  float* sq = I.scalars.as<float>();
  PLATEAU_RETURN_IF_ERROR(backend_.SumSquares(*I.comm, &sq[0], I.dense_grad_shard.as<float>(), S));
  PLATEAU_RETURN_IF_ERROR(backend_.SumSquares(*I.comm, &sq[1], I.owned_grad.as<float>(), X));
  PLATEAU_RETURN_IF_ERROR(world_.AllReduce(*I.comm, sq, sq, 2, DataType::kFloat32, ReduceOp::kSum));
  float host_sq[2];
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.comm, host_sq, sq, sizeof(host_sq)));
  PLATEAU_RETURN_IF_ERROR(I.comm->Synchronize());
  out.grad_norm = std::sqrt(static_cast<double>(host_sq[0]) + host_sq[1]);
  float clip = 1.0f;
  if (o.max_grad_norm > 0.0f) {
    clip = std::min(1.0f, o.max_grad_norm / (static_cast<float>(out.grad_norm) + 1e-6f));
  }
  ++step_;
  EndPhase(phases, StepPhase::kGradNorm);
  // AdamW on this rank's shard and owned weights, then the working weights.
  // A bucketed optimizer ends a phase per bucket; the recorder is the
  // optimizer's only for this call.
  I.optimizer->set_phase_recorder(phases);
  const absl::Status updated = I.optimizer->Update(clip, step_);
  I.optimizer->set_phase_recorder(nullptr);
  PLATEAU_RETURN_IF_ERROR(updated);
  EndPhase(phases, StepPhase::kOptimizer);
  out.step = step_;
  out.device = backend_.device().tracker().Snapshot();
  out.host = backend_.host().tracker().Snapshot();
  return out;
}

// ---------------------------------------------------------------------------
// Whole-model views, for tests and checkpoints.

namespace {

// All-gathers `count` floats from every rank into a host vector.
absl::StatusOr<std::vector<float>> GatherToHost(Backend& be, Communicator& world, Stream& s,
                                               const void* src, int64_t count) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer all, be.device().Allocate(LiveSet::kWorkspace,
                                                            count * world.size() * sizeof(float)));
  PLATEAU_RETURN_IF_ERROR(world.AllGather(s, src, all.data(), count, DataType::kFloat32));
  std::vector<float> host(count * world.size());
  PLATEAU_RETURN_IF_ERROR(be.Copy(s, host.data(), all.data(), all.bytes()));
  PLATEAU_RETURN_IF_ERROR(s.Synchronize());
  return host;
}

}  // namespace

absl::StatusOr<std::vector<std::vector<float>>> TrainingStep::GatherWeights() {
  Impl& I = *impl_;
  // The working dense weights are the masters all-gathered (fp32: the same bits).
  std::vector<float> dense(layout_.dense_padded());
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.comm, dense.data(), I.dense.data(), I.dense.bytes()));
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> owned,
                           GatherToHost(backend_, world_, *I.comm, I.owned.data(),
                                        layout_.owned_numel_per_rank()));
  return layout_.Assemble(dense, owned);
}

absl::StatusOr<std::vector<std::vector<float>>> TrainingStep::GatherGrads() {
  Impl& I = *impl_;
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> dense,
                           GatherToHost(backend_, world_, *I.comm, I.dense_grad_shard.data(),
                                        layout_.shard_numel()));
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> owned,
                           GatherToHost(backend_, world_, *I.comm, I.owned_grad.data(),
                                        layout_.owned_numel_per_rank()));
  return layout_.Assemble(dense, owned);
}

absl::StatusOr<ModelState> TrainingStep::GatherState() {
  Impl& I = *impl_;
  ModelState st;
  PLATEAU_ASSIGN_OR_RETURN(st.weights, GatherWeights());
  const int64_t S = layout_.shard_numel(), X = layout_.owned_numel_per_rank();
  PLATEAU_ASSIGN_OR_RETURN(OptimizerShardState mine, I.optimizer->Save());
  auto gather = [&](const std::vector<float>& host, int64_t n) -> absl::StatusOr<std::vector<float>> {
    PLATEAU_ASSIGN_OR_RETURN(Buffer dev, backend_.device().Allocate(LiveSet::kWorkspace, n * sizeof(float)));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.comm, dev.data(), host.data(), dev.bytes()));
    return GatherToHost(backend_, world_, *I.comm, dev.data(), n);
  };
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> dm, gather(mine.dense_m, S));
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> em, gather(mine.owned_m, X));
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> dv, gather(mine.dense_v, S));
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> ev, gather(mine.owned_v, X));
  st.m = layout_.Assemble(dm, em);
  st.v = layout_.Assemble(dv, ev);
  st.step = step_;
  return st;
}

absl::Status TrainingStep::LoadState(const ModelState& st) {
  Impl& I = *impl_;
  const size_t n = layout_.weights().size();
  for (const auto* t : {&st.weights, &st.m, &st.v}) {
    if (t->size() != n) {
      return absl::InvalidArgumentError(absl::StrCat("state: expected ", n, " tensors, got ", t->size()));
    }
    for (size_t i = 0; i < n; ++i) {
      if (static_cast<int64_t>((*t)[i].size()) != layout_.weights()[i].numel()) {
        return absl::InvalidArgumentError(absl::StrCat("state: tensor ", layout_.weights()[i].name,
                                                        " has ", (*t)[i].size(), " values, expected ",
                                                        layout_.weights()[i].numel()));
      }
    }
  }
  if (st.step < 0) return absl::InvalidArgumentError("state: step must be >= 0");
  const int64_t rank = world_.rank();
  OptimizerShardState shard;
  std::vector<float> owned;
  layout_.ShardFrom(st.m, rank, &shard.dense_m, &shard.owned_m);
  layout_.ShardFrom(st.v, rank, &shard.dense_v, &shard.owned_v);
  layout_.ShardFrom(st.weights, rank, &shard.dense_master, &owned);
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.compute, I.owned.data(), owned.data(), I.owned.bytes()));
  PLATEAU_RETURN_IF_ERROR(I.optimizer->Load(shard));
  step_ = st.step;
  return absl::OkStatus();
}

}  // namespace plateau
