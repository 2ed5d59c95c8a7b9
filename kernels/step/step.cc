#include "kernels/step/step.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/bf16.h"
#include "kernels/budget/budget.h"
#include "kernels/model/model_kernels.h"
#include "kernels/model/working_ops.h"
#include "kernels/status_macros.h"
#include "kernels/step/grad_reduce.h"
#include "kernels/step/ring_attention.h"
#include "kernels/step/schedules.h"

namespace plateau {

struct TrainingStep::Impl {
  std::unique_ptr<Stream> compute, comm;
  std::unique_ptr<Event> ev_compute, ev_comm;
  std::unique_ptr<ModelKernels> kernels;
  // The schedule at each point (kernels/step/schedules.h).
  std::unique_ptr<BoundaryStore> checkpoints;  // the L+1 layer boundaries h_0 … h_L
  // Under keep_attention: layer l's [o | lse] (fp32) as record l; null
  // otherwise.
  std::unique_ptr<BoundaryStore> attention_records;
  std::unique_ptr<ExpertDispatch> dispatch;
  std::unique_ptr<VocabProjection> projection;
  // kOptimizer lives here: the dense shard's master and AdamW moments, the
  // owned weights' moments (fp32: they are their own master; bf16 mixed:
  // their fp32 master too).
  std::unique_ptr<OptimizerUpdate> optimizer;

  // kWeights: working dense weights (all-gathered) and this rank's owned
  // weights (its experts; under Ring-DTP also its lm_head vocabulary shard:
  // kernels/model/params.h). Every buffer below whose budget role is
  // "working" (StepLaunchBuffers) holds the working type W (float, or Bf16
  // under bf16 mixed); the others fp32 (or int32 / double as named).
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
  // Attention forwards run (RingForward calls) since Create.
  int64_t attention_forwards = 0;
  // The bf16 gradient reduce's staging: one of the activation buffers
  // above, borrowed (Allocate says which and why); null in fp32.
  Buffer* reduce_staging = nullptr;

  int64_t off_embed = 0, off_final_norm = 0;
  // This rank's rows of lm_head (the projection's FirstWeightRow() onward)
  // and of its gradient: at element lm_head_off of the dense weights (and
  // their gradient), or of the owned vector when lm_head_owned.
  bool lm_head_owned = false;
  int64_t lm_head_off = 0;
  template <typename W>
  W* lm_head() const {
    return (lm_head_owned ? owned : dense).as<W>() + lm_head_off;
  }
  template <typename W>
  W* lm_head_grad() const {
    return (lm_head_owned ? owned_grad : dense_grad).as<W>() + lm_head_off;
  }
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
absl::Status CheckPrecision(const StepOptions& o, const Backend& backend) {
  if (o.precision == Precision::kFp32) return absl::OkStatus();
  PLATEAU_RETURN_IF_ERROR(CheckBf16Schedules(o));
  if (!backend.computes_bf16()) {
    return absl::UnimplementedError(absl::StrCat(
        "precision: ", PrecisionName(o.precision), " is not computed by the ", BackendKindName(backend.kind()),
        " backend; the cpu and cuda backends compute it"));
  }
  return absl::OkStatus();
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
  PLATEAU_RETURN_IF_ERROR(CheckPrecision(options, backend));
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
  ModelKernelsOptions kernel_options;
  // An fp32 step launches no bf16 attention op: kTiles tells CUDA to skip
  // the tensor-core kernels' wgmma decision (model_kernels.h).
  kernel_options.bf16_attention =
      options_.precision == Precision::kFp32 ? Bf16Attention::kTiles : options_.bf16_attention;
  kernel_options.tc_wgmma = options_.attention_wgmma;
  PLATEAU_ASSIGN_OR_RETURN(I.kernels, ModelKernels::Create(backend_, kernel_options));
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
  if (options_.precision == Precision::kBf16Mixed) {
    // The bf16 ZeRO reduce (grad_reduce.h) stages its chunks in the largest
    // activation buffer (the fewest chunks), borrowed, so the plan's bytes
    // do not change. Every kActivations buffer is dead by then, in every
    // schedule: they are the step's own working set of one layer, which no
    // schedule keeps past its call (the checkpoint store, the dispatch, the
    // projection and the optimizers own their buffers, and SCO's and the
    // offloaded optimizers' streams touch only theirs); their last reader,
    // EmbeddingBackward (dh, tokens), runs on compute before the reduce's
    // first exchange waits for compute, and their next writer is the next
    // pass, after ForwardBackward has synchronised both streams. The chunk
    // is >= 1 element: `o` alone ([N, hidden] fp32) holds two slots of
    // N hidden / P, and bf16 takes hidden >= experts >= ranks
    // (CheckBf16Schedules; experts % ranks == 0). Checked here all the same,
    // so that a shape that breaks it is refused at Create, not mid-step.
    const int64_t lent = GradReduceStagingIndex(specs);
    if (lent >= 0) I.reduce_staging = &(I.*(members[lent].member));
    const int64_t staging = I.reduce_staging == nullptr ? 0 : static_cast<int64_t>(I.reduce_staging->bytes());
    if (world_.size() > 1 && GradReduceBf16::ChunkElements(world_.size(), staging) < 1) {
      return absl::FailedPreconditionError(absl::StrCat("grad_reduce: the largest activation buffer (", staging,
                                                        " bytes) cannot stage one bf16 element per rank in two slots (",
                                                        4 * world_.size(), " bytes)"));
    }
  }
  auto params_of = [&](auto* w) {
    using W = std::remove_pointer_t<decltype(w)>;
    OptimizerParamsT<W> params;
    params.dense_working = I.dense.as<W>();
    params.owned = I.owned.as<W>();
    params.dense_grad_shard = I.dense_grad_shard.as<W>();
    params.owned_grad = I.owned_grad.as<W>();
    params.shard_numel = layout_.shard_numel();
    params.owned_numel = layout_.owned_numel_per_rank();
    return params;
  };
  PLATEAU_ASSIGN_OR_RETURN(StepSchedules schedules,
                           CreateSchedules({options_, backend_, *I.kernels, world_, *I.compute, *I.comm,
                                            params_of(static_cast<float*>(nullptr)),
                                            params_of(static_cast<Bf16*>(nullptr))}));
  I.checkpoints = std::move(schedules.checkpoints);
  I.attention_records = std::move(schedules.attention_records);
  I.dispatch = std::move(schedules.dispatch);
  I.projection = std::move(schedules.projection);
  I.optimizer = std::move(schedules.optimizer);

  I.off_embed = layout_.DenseOffset("embed.weight");
  I.off_final_norm = layout_.DenseOffset("final_norm.weight");
  if (layout_.lm_head_layout() == LmHeadLayout::kVocabularySharded) {
    // The owned vector holds exactly the projection's rows.
    I.lm_head_owned = true;
    I.lm_head_off = layout_.lm_head_shard_offset();
  } else {
    I.lm_head_off = layout_.DenseOffset("lm_head.weight") + I.projection->FirstWeightRow() * m.hidden;
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
  // Under bf16 the seed's fp32 values are the masters and the optimizer
  // writes the working copies rn(master).
  const int64_t rank = world_.rank();
  std::vector<float> owned = layout_.InitOwned(rank, options_.seed);
  OptimizerShardState initial;  // zero moments
  if (options_.precision == Precision::kBf16Mixed) {
    initial.owned_master = std::move(owned);
  } else {
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.compute, I.owned.data(), owned.data(), I.owned.bytes()));
  }
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
// The step itself, one body for both precisions: W is the working type
// (float in fp32, Bf16 in bf16 mixed: kernels/model/working_ops.h), and
// every op on a working buffer goes through WorkingOps<W>, whose float
// instantiation is the fp32 op argument for argument (so the fp32 step is
// the fp32 code, bit for bit). What the plan keeps fp32 (rstd, the
// online-softmax state and attention's running output o, lse, delta, the
// router's logits, probabilities, gates and their gradients, the loss) is
// float in both. Everything below is enqueued on the compute stream unless
// it says comm; the two meet through events.

namespace {

template <typename W>
struct Ctx {
  using Ops = WorkingOps<W>;
  const ModelConfig& m;
  const ParamLayout& p;
  Backend& be;
  Communicator& world;
  TrainingStep::Impl& I;
  int64_t N, B, Ns, rank, P;
  // The pass keeps each layer's attention forward for its backward
  // (CheckpointOptions::keep_attention, in a pass with a backward).
  bool keep_attention = false;
  int64_t qd() const { return m.heads * m.head_dim(); }
  int64_t kvd() const { return m.kv_heads * m.head_dim(); }
  Stream& c() { return *I.compute; }
  ModelKernels& k() { return *I.kernels; }
  W* weight(int64_t off) { return I.dense.as<W>() + off; }
  W* grad(int64_t off) { return I.dense_grad.as<W>() + off; }
  ExpertWeightsT<W> experts(int64_t l) {
    const W* e = I.owned.as<W>();
    return {e + p.ExpertOffset(l, 0, 0), e + p.ExpertOffset(l, 1, 0), e + p.ExpertOffset(l, 2, 0)};
  }
  ExpertGradsT<W> expert_grads(int64_t l) {
    W* e = I.owned_grad.as<W>();
    return {e + p.ExpertOffset(l, 0, 0), e + p.ExpertOffset(l, 1, 0), e + p.ExpertOffset(l, 2, 0)};
  }
  AttentionShape shape() const {
    return {B, Ns, Ns, m.heads, m.kv_heads, m.head_dim(), rank * Ns, 0,
            1.0f / std::sqrt(static_cast<float>(m.head_dim()))};
  }
  // comm waits for what compute has enqueued so far, and vice versa.
  absl::Status CommAfterCompute() { return OrderAfter(*I.comm, *I.compute, *I.ev_compute); }
  absl::Status ComputeAfterComm() { return OrderAfter(*I.compute, *I.comm, *I.ev_comm); }
  absl::Status Gemm(bool ta, bool tb, int64_t M, int64_t Nn, int64_t K, const W* a, int64_t lda,
                    const W* b, int64_t ldb, float beta, W* out, int64_t ldc) {
    return Ops::Gemm(be, c(), {ta, tb, M, Nn, K, 1.0f, a, lda, b, ldb, beta, out, ldc});
  }
  // The same GEMM with an fp32 output (the router's logits).
  absl::Status GemmAccum(bool ta, bool tb, int64_t M, int64_t Nn, int64_t K, const W* a, int64_t lda,
                         const W* b, int64_t ldb, float beta, float* out, int64_t ldc) {
    return Ops::GemmAccum(be, c(), {ta, tb, M, Nn, K, 1.0f, a, lda, b, ldb, beta, out, ldc});
  }
  // Attention's output as the Wo GEMMs read it. fp32: `o` itself. bf16: o
  // stays fp32 (the running output across the ring's hops, and
  // AttentionDelta's input), and the GEMMs read its bf16 copy, which the
  // plan gives no buffer of its own: `dq` ([N, heads d], working) is idle
  // from the forward to the ring backward, so ConvertWo writes the copy
  // there after each (re)computed forward and both Wo GEMMs of the layer's
  // backward read it before RingBackward overwrites dq.
  const W* o_for_wo() {
    if constexpr (std::is_same_v<W, float>) {
      return I.o.as<float>();
    } else {
      return I.dq.as<W>();
    }
  }
  absl::Status ConvertWo() {
    if constexpr (std::is_same_v<W, float>) {
      return absl::OkStatus();
    } else {
      return be.ConvertToBf16(c(), I.dq.as<W>(), I.o.as<float>(), N * qd());
    }
  }
};

// Ring attention (ring_attention.h) on the step's buffers.
template <typename W>
RingAttentionT<W> Ring(Ctx<W>& x) {
  TrainingStep::Impl& I = x.I;
  return RingAttentionT<W>{x.be, *I.kernels, x.world, *I.compute, *I.comm, *I.ev_compute, *I.ev_comm,
                           x.shape(), x.N};
}

template <typename W>
absl::Status RingForward(Ctx<W>& x) {
  TrainingStep::Impl& I = x.I;
  ++I.attention_forwards;
  return Ring(x).Forward(I.q.as<W>(), I.kv.as<W>(), I.ml.as<float>(), I.o.as<float>(), I.lse.as<float>(),
                         I.fwd_trav.as<W>(), I.attn_work.as<float>());
}

template <typename W>
absl::Status RingBackward(Ctx<W>& x) {
  TrainingStep::Impl& I = x.I;
  // bf16: dq sums in fp32 across the hops in `o` ([N, heads d] fp32, dead
  // once AttentionDelta has read it: the layer's Wo GEMMs read its bf16
  // copy before this) and is rounded once; fp32: dq is its own accumulator.
  float* dq_acc = nullptr;
  if constexpr (!std::is_same_v<W, float>) dq_acc = I.o.as<float>();
  return Ring(x).Backward(I.q.as<W>(), I.kv.as<W>(), I.dO.as<W>(), I.lse.as<float>(), I.delta.as<float>(), I.dq.as<W>(),
                          I.dkv.as<W>(), I.bwd_trav.data(), I.attn_work.as<float>(), dq_acc);
}

// Attention's forward of layer l into o and lse. With keep_attention the
// forward also copies them into record l of the attention records' store
// (full or SCO, as the boundaries), and the recompute before the backward
// copies them back instead of running the ring again:
// the ring's forward is deterministic, so these are the bits it would
// compute (the backward reads only o, lse and the recomputed q, k, v; the
// online-softmax state and the travellers are the forward's own scratch).
// The copies are device to device, N (heads d + heads) floats each way, small
// beside the attention they replace.
template <typename W>
absl::Status AttentionForward(Ctx<W>& x, int64_t l, bool for_backward) {
  TrainingStep::Impl& I = x.I;
  const int64_t o_bytes = x.N * x.qd() * static_cast<int64_t>(sizeof(float));
  const int64_t lse_bytes = x.N * x.m.heads * static_cast<int64_t>(sizeof(float));
  if (x.keep_attention && for_backward) {
    // The store's record l, ready for compute (SCO: restored from the host
    // pool by event, the next one's restore starting behind it), done with
    // once its copies are enqueued: a store orders its own later copies
    // after compute's work so far.
    PLATEAU_ASSIGN_OR_RETURN(const float* record, I.attention_records->Acquire<float>(l));
    PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.c(), I.o.data(), record, o_bytes));
    PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.c(), I.lse.data(), record + x.N * x.qd(), lse_bytes));
    return I.attention_records->Done(l);
  }
  PLATEAU_RETURN_IF_ERROR(RingForward(x));
  if (!x.keep_attention) return absl::OkStatus();
  PLATEAU_ASSIGN_OR_RETURN(float* record, I.attention_records->Slot<float>(l));
  PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.c(), record, I.o.data(), o_bytes));
  PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.c(), record + x.N * x.qd(), I.lse.data(), lse_bytes));
  return I.attention_records->Produced(l);
}

// Layer l from its input `in` (boundary l) to `out` (boundary l+1). Leaves
// the working set (and the dispatch state) in place for LayerBackward. With
// `for_backward` (the recompute before LayerBackward) `out` is scratch and
// the dispatch point may skip its output (ExpertDispatch::ForwardForBackward:
// PipelinedLLEP's Backward replays its chunks anyway).
template <typename W>
absl::Status LayerForward(Ctx<W>& x, int64_t l, const W* in, W* out, bool for_backward = false) {
  using Ops = WorkingOps<W>;
  TrainingStep::Impl& I = x.I;
  const ModelConfig& m = x.m;
  const auto& off = I.layer_off[l];
  const int64_t N = x.N, H = m.hidden, qd = x.qd(), kvd = x.kvd();
  W* a = I.a.as<W>();
  W* q = I.q.as<W>();
  PLATEAU_RETURN_IF_ERROR(Ops::RmsNormForward(x.be, x.c(), a, I.rstd_a.as<float>(), in, x.weight(off.attn_norm),
                                              N, H, m.norm_eps));
  W* k = I.kv.as<W>();
  W* v = k + N * kvd;
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, qd, H, a, H, x.weight(off.wq), qd, 0.0f, q, qd));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, kvd, H, a, H, x.weight(off.wk), kvd, 0.0f, k, kvd));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, kvd, H, a, H, x.weight(off.wv), kvd, 0.0f, v, kvd));
  PLATEAU_RETURN_IF_ERROR(Ops::Rope(x.k(), x.c(), q, x.B, x.Ns, m.heads, m.head_dim(), x.rank * x.Ns,
                                    m.rope_theta, false));
  PLATEAU_RETURN_IF_ERROR(Ops::Rope(x.k(), x.c(), k, x.B, x.Ns, m.kv_heads, m.head_dim(), x.rank * x.Ns,
                                    m.rope_theta, false));
  PLATEAU_RETURN_IF_ERROR(AttentionForward(x, l, for_backward));
  PLATEAU_RETURN_IF_ERROR(x.ConvertWo());
  // h1 = in + o wo
  W* h1 = I.h1.as<W>();
  W* u = I.u.as<W>();
  PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.c(), h1, in, N * H * sizeof(W)));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, false, N, H, qd, x.o_for_wo(), qd, x.weight(off.wo), H, 1.0f, h1, H));
  // MoE on rmsnorm(h1). The router's logits, probabilities and gates are
  // fp32 in either precision (its softmax and top-k are rounding-sensitive).
  PLATEAU_RETURN_IF_ERROR(Ops::RmsNormForward(x.be, x.c(), u, I.rstd_u.as<float>(), h1, x.weight(off.moe_norm),
                                              N, H, m.norm_eps));
  PLATEAU_RETURN_IF_ERROR(x.GemmAccum(false, false, N, m.experts, H, u, H, x.weight(off.router), m.experts,
                                      0.0f, I.rlogits.as<float>(), m.experts));
  PLATEAU_RETURN_IF_ERROR(I.kernels->Router(x.c(), I.rlogits.as<float>(), N, m.experts, m.top_k,
                                            I.probs.as<float>(), I.chosen.as<int32_t>(),
                                            I.gates.as<float>()));
  PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.c(), out, h1, N * H * sizeof(W)));
  // The recompute's routing is bitwise the forward's (the same boundary, the
  // same kernels), so a dispatch may reuse what the forward planned.
  I.dispatch->SetLayer(l);
  if (for_backward) {
    return I.dispatch->ForwardForBackward(u, I.chosen.as<int32_t>(), I.gates.as<float>(), N, x.experts(l), out);
  }
  return I.dispatch->Forward(u, I.chosen.as<int32_t>(), I.gates.as<float>(), N, x.experts(l), out);
}

// Given dh = d loss / d boundary l+1 (after LayerForward(l) recomputed the
// working set), accumulates layer l's weight gradients and turns dh into
// d loss / d boundary l.
template <typename W>
absl::Status LayerBackward(Ctx<W>& x, int64_t l, const W* in) {
  using Ops = WorkingOps<W>;
  TrainingStep::Impl& I = x.I;
  const ModelConfig& m = x.m;
  const auto& off = I.layer_off[l];
  const int64_t N = x.N, H = m.hidden, qd = x.qd(), kvd = x.kvd(), E = m.experts;
  W* dh = I.dh.as<W>();
  W* du = I.du.as<W>();
  W* tmp = I.tmp.as<W>();
  W* u = I.u.as<W>();
  // MoE: out = h1 + moe(rmsnorm(h1)).
  PLATEAU_RETURN_IF_ERROR(Ops::Fill(x.be, x.c(), du, N * H, 0.0f));
  PLATEAU_RETURN_IF_ERROR(I.dispatch->Backward(dh, x.experts(l), du, I.dgates.as<float>(), x.expert_grads(l)));
  PLATEAU_RETURN_IF_ERROR(I.kernels->RouterBackward(x.c(), I.probs.as<float>(), I.chosen.as<int32_t>(),
                                                    I.gates.as<float>(), I.dgates.as<float>(), N, E,
                                                    m.top_k, I.drlogits.as<float>()));
  // The router's GEMMs read d rlogits in the working type: fp32 as it is;
  // bf16 rounded once into tmp (idle here: the recompute's scratch output,
  // overwritten below; E <= H is checked at Create).
  const W* drlogits;
  if constexpr (std::is_same_v<W, float>) {
    drlogits = I.drlogits.as<float>();
  } else {
    PLATEAU_RETURN_IF_ERROR(x.be.ConvertToBf16(x.c(), tmp, I.drlogits.as<float>(), N * E));
    drlogits = tmp;
  }
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, H, E, N, u, H, drlogits, E, 1.0f, x.grad(off.router), E));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, H, E, drlogits, E, x.weight(off.router), E, 1.0f, du, H));
  PLATEAU_RETURN_IF_ERROR(Ops::RmsNormBackward(x.be, x.c(), tmp, x.grad(off.moe_norm), du, I.h1.as<W>(),
                                               x.weight(off.moe_norm), I.rstd_u.as<float>(), N, H));
  W* dh1 = I.dh1.as<W>();
  PLATEAU_RETURN_IF_ERROR(Ops::Add(x.be, x.c(), dh1, dh, tmp, N * H));
  // Attention: h1 = in + attn(rmsnorm(in)).
  W* dO = I.dO.as<W>();
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, qd, H, N, x.o_for_wo(), qd, dh1, H, 1.0f, x.grad(off.wo), H));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, qd, H, dh1, H, x.weight(off.wo), H, 0.0f, dO, qd));
  const AttentionShape s = x.shape();
  PLATEAU_RETURN_IF_ERROR(Ops::AttentionDelta(x.k(), x.c(), s, I.o.as<float>(), dO, I.delta.as<float>()));
  PLATEAU_RETURN_IF_ERROR(RingBackward(x));
  W* dq = I.dq.as<W>();
  W* dk = I.dkv.as<W>();
  W* dv = dk + N * kvd;
  PLATEAU_RETURN_IF_ERROR(Ops::Rope(x.k(), x.c(), dq, x.B, x.Ns, m.heads, m.head_dim(), x.rank * x.Ns,
                                    m.rope_theta, true));
  PLATEAU_RETURN_IF_ERROR(Ops::Rope(x.k(), x.c(), dk, x.B, x.Ns, m.kv_heads, m.head_dim(), x.rank * x.Ns,
                                    m.rope_theta, true));
  const W* a = I.a.as<W>();
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, H, qd, N, a, H, dq, qd, 1.0f, x.grad(off.wq), qd));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, H, kvd, N, a, H, dk, kvd, 1.0f, x.grad(off.wk), kvd));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(true, false, H, kvd, N, a, H, dv, kvd, 1.0f, x.grad(off.wv), kvd));
  W* da = du;  // du is consumed: reuse it for d a
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, H, qd, dq, qd, x.weight(off.wq), qd, 0.0f, da, H));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, H, kvd, dk, kvd, x.weight(off.wk), kvd, 1.0f, da, H));
  PLATEAU_RETURN_IF_ERROR(x.Gemm(false, true, N, H, kvd, dv, kvd, x.weight(off.wv), kvd, 1.0f, da, H));
  PLATEAU_RETURN_IF_ERROR(Ops::RmsNormBackward(x.be, x.c(), tmp, x.grad(off.attn_norm), da, in,
                                               x.weight(off.attn_norm), I.rstd_a.as<float>(), N, H));
  return Ops::Add(x.be, x.c(), dh, dh1, tmp, N * H);
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
  if (options_.precision == Precision::kBf16Mixed) return PassT<Bf16>(tokens, targets, phases, backward);
  return PassT<float>(tokens, targets, phases, backward);
}

template <typename W>
absl::StatusOr<StepStats> TrainingStep::PassT(const std::vector<int32_t>& tokens,
                                              const std::vector<int32_t>& targets, PhaseRecorder* phases,
                                              bool backward) {
  using Ops = WorkingOps<W>;
  PLATEAU_RETURN_IF_ERROR(CheckBatch(tokens, targets));
  Impl& I = *impl_;
  const ModelConfig& m = options_.model;
  const int64_t N = TokensPerRank(m, options_.layout), H = m.hidden;
  Ctx<W> x{m, layout_, backend_, world_, I, N, options_.layout.batch, m.seq_len / world_.size(),
           world_.rank(), world_.size()};
  x.keep_attention = backward && options_.checkpoints.keep_attention;
  backend_.device().tracker().ResetPeaks();
  backend_.host().tracker().ResetPeaks();

  PLATEAU_RETURN_IF_ERROR(backend_.Copy(x.c(), I.tokens.data(), tokens.data(), N * sizeof(int32_t)));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(x.c(), I.targets.data(), targets.data(), N * sizeof(int32_t)));
  PLATEAU_RETURN_IF_ERROR(Ops::Fill(backend_, x.c(), I.dense_grad.as<W>(), layout_.dense_padded(), 0.0f));
  PLATEAU_RETURN_IF_ERROR(Ops::Fill(backend_, x.c(), I.owned_grad.as<W>(), layout_.owned_numel_per_rank(), 0.0f));

  // Forward: keep only the layer boundaries, in the checkpoint store.
  BoundaryStore& boundaries = *I.checkpoints;
  PLATEAU_ASSIGN_OR_RETURN(W* h, boundaries.Slot<W>(0));
  PLATEAU_RETURN_IF_ERROR(Ops::Embedding(x.k(), x.c(), x.weight(I.off_embed), m.vocab_size,
                                         I.tokens.as<int32_t>(), N, H, h));
  PLATEAU_RETURN_IF_ERROR(boundaries.Produced(0));
  EndPhase(phases, StepPhase::kEmbedding);
  for (int64_t l = 0; l < m.layers; ++l) {
    PLATEAU_ASSIGN_OR_RETURN(W* next, boundaries.Slot<W>(l + 1));
    PLATEAU_RETURN_IF_ERROR(LayerForward(x, l, h, next));
    I.dispatch->Release();
    PLATEAU_RETURN_IF_ERROR(boundaries.Produced(l + 1));
    EndPhase(phases, StepPhase::kForward, l);
    h = next;
  }
  const W* hL = h;
  W* z = I.z.as<W>();
  PLATEAU_RETURN_IF_ERROR(Ops::RmsNormForward(backend_, x.c(), z, I.rstd_f.as<float>(), hL,
                                              x.weight(I.off_final_norm), N, H, m.norm_eps));
  double* stats = I.stats.as<double>();
  PLATEAU_RETURN_IF_ERROR(backend_.Fill(x.c(), I.scalars.as<float>(), 2, 0.0f));
  // Zeroed by a fill of its bytes (the double +0.0 is all zero bits), not a
  // copy from a host constant: on CUDA a copy from pageable memory may
  // wait for the stream, a stall in the middle of every step.
  PLATEAU_RETURN_IF_ERROR(backend_.Fill(x.c(), reinterpret_cast<float*>(stats), 4, 0.0f));
  // The projection reads and writes its rows of lm_head: all of them in the
  // all-gathered dense weights (dense projection; the reduce-scatter sums
  // their gradient), or this rank's vocabulary shard in its owned weights
  // (Ring-DTP completes the shard's gradient here: no reduce-scatter).
  const W* lm_head = I.lm_head<W>();
  PLATEAU_RETURN_IF_ERROR(I.projection->Forward(z, lm_head, I.targets.as<int32_t>(), stats));
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
      PLATEAU_RETURN_IF_ERROR(boundaries.Acquire<W>(l).status());
      PLATEAU_RETURN_IF_ERROR(boundaries.Done(l));
    }
    PLATEAU_RETURN_IF_ERROR(I.compute->Synchronize());
    out.step = step_;
    out.device = backend_.device().tracker().Snapshot();
    out.host = backend_.host().tracker().Snapshot();
    return out;
  }

  // Backward.
  W* tmp = I.tmp.as<W>();
  W* dh = I.dh.as<W>();
  PLATEAU_RETURN_IF_ERROR(I.projection->Backward(z, lm_head, I.targets.as<int32_t>(), scale, tmp,
                                                 I.lm_head_grad<W>()));
  PLATEAU_ASSIGN_OR_RETURN(hL, boundaries.Acquire<W>(m.layers));
  PLATEAU_RETURN_IF_ERROR(Ops::RmsNormBackward(backend_, x.c(), dh, x.grad(I.off_final_norm), tmp, hL,
                                               x.weight(I.off_final_norm), I.rstd_f.as<float>(), N, H));
  PLATEAU_RETURN_IF_ERROR(boundaries.Done(m.layers));
  EndPhase(phases, StepPhase::kProjectionBackward);
  for (int64_t l = m.layers - 1; l >= 0; --l) {
    // Recompute the layer from its checkpoint; its output is not needed
    // again, so it goes to scratch (tmp, which LayerBackward overwrites),
    // not back into the store.
    PLATEAU_ASSIGN_OR_RETURN(const W* in, boundaries.Acquire<W>(l));
    PLATEAU_RETURN_IF_ERROR(LayerForward(x, l, in, tmp, /*for_backward=*/true));
    EndPhase(phases, StepPhase::kRecompute, l);
    PLATEAU_RETURN_IF_ERROR(LayerBackward(x, l, in));
    PLATEAU_RETURN_IF_ERROR(boundaries.Done(l));
    EndPhase(phases, StepPhase::kBackward, l);
  }
  PLATEAU_RETURN_IF_ERROR(Ops::EmbeddingBackward(x.k(), x.c(), dh, I.tokens.as<int32_t>(), N, H,
                                                 x.grad(I.off_embed), m.vocab_size));
  // ZeRO: every rank's dense gradient summed into the owner's shard. fp32:
  // the reduce-scatter. bf16: an fp32 sum over the ranks in rank order,
  // rounded once (grad_reduce.h; the ring's bf16 reduce-scatter would round
  // once per hop, P - 1 roundings of alike terms), staged in the borrowed
  // activation buffer (Allocate).
  if constexpr (std::is_same_v<W, float>) {
    PLATEAU_RETURN_IF_ERROR(x.CommAfterCompute());
    PLATEAU_RETURN_IF_ERROR(world_.ReduceScatter(*I.comm, I.dense_grad.data(), I.dense_grad_shard.data(),
                                                 layout_.shard_numel(), kWorkingDataType<W>, ReduceOp::kSum));
  } else {
    GradReduceBf16 reduce{backend_, world_, *I.compute, *I.comm, *I.ev_compute, *I.ev_comm};
    PLATEAU_RETURN_IF_ERROR(reduce.Run(I.dense_grad.as<Bf16>(), I.dense_grad_shard.as<Bf16>(), layout_.shard_numel(),
                                       I.reduce_staging->data(), static_cast<int64_t>(I.reduce_staging->bytes())));
  }
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
  // Global gradient norm: this rank's dense shard and owned weights, summed
  // over ranks; an fp32 reduction of the loaded gradients in either
  // precision.
  float* sq = I.scalars.as<float>();
  if (options_.precision == Precision::kBf16Mixed) {
    PLATEAU_RETURN_IF_ERROR(backend_.SumSquaresBf16(*I.comm, &sq[0], I.dense_grad_shard.as<Bf16>(), S));
    PLATEAU_RETURN_IF_ERROR(backend_.SumSquaresBf16(*I.comm, &sq[1], I.owned_grad.as<Bf16>(), X));
  } else {
    PLATEAU_RETURN_IF_ERROR(backend_.SumSquares(*I.comm, &sq[0], I.dense_grad_shard.as<float>(), S));
    PLATEAU_RETURN_IF_ERROR(backend_.SumSquares(*I.comm, &sq[1], I.owned_grad.as<float>(), X));
  }
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
//
// Device memory: none beyond the plan's. The all-gathers below move the
// state in chunks through `dense_grad`, borrowed: the full [S * P] working
// gradient (kGrads, S * P * w bytes, allocated at Create in every
// configuration). It is idle between calls: every ForwardBackward fills it
// with zeros before it writes it, and it is dead once the ZeRO
// reduce-scatter has summed it into dense_grad_shard (what GatherGrads and
// the optimizer read), so what a gather leaves in it is never read. It is
// the biggest launch buffer idle between steps in every schedule (the
// activations scale with N and may be tiny; the checkpoint store and the
// dispatch buffers are schedule-owned, SCO's partly on the host): its
// size scales with P, as the gathered data does, giving a chunk of
// floor(S * P * w / (P * elem)) = floor(S * w / elem) elements per rank,
// at least S / 2 (fp32 state through bf16 working gradients). That is >= 1
// in every valid layout: experts % ranks == 0 puts the H * E router weights
// of a layer (dense) at >= P elements, plus the embedding, so the dense
// count exceeds P and S >= 2. The dense shard's vectors take one or two
// chunks; the owned ones (the experts: usually the bulk) ceil(X / chunk).
// Before this, each gather allocated n * P elements of kWorkspace (plus an
// n-element staging buffer for host-side state), outside the plan: at a
// model's real size a checkpoint at N_max would run out of device memory.
//
// Host memory: every rank receives the whole state (an all-gather) and
// returns it in full: 3 x 4 x (dense + experts) bytes for GatherState's
// three families (weights, m, v), on every rank, plus its shard and one
// family's gathered flat vectors. That is the baseline, kept for the tests
// that compare every rank's state; the trainer's checkpoints take the
// streamed path (StreamState, LoadStreamedState), which holds no full
// tensor anywhere.

namespace {

// All-gathers `n` elements of `type` per rank in chunks through the device
// buffer `scratch`, on stream `s`, and hands each gathered chunk to
// on_chunk(lo, len, values): values [P][len] on the host (kBfloat16 loaded
// exactly into floats), rank r's elements [lo, lo + len) at r * len, valid
// until on_chunk returns. With a null on_chunk this rank takes part in the
// gathers and copies nothing out. The source is device memory, or the
// caller's host memory when `src_on_host` (then each chunk is first copied
// into this rank's block of the scratch and gathered in place). Collective;
// `scratch` must be idle, and is clobbered. Host memory where on_chunk is
// set: one gathered chunk as floats, P x chunk = scratch.bytes() / elem
// floats (the scratch's bytes again for fp32 sources).
using ChunkFn = std::function<void(int64_t lo, int64_t len, const float* values)>;
absl::Status GatherChunks(Backend& be, Communicator& world, Stream& s, Buffer& scratch, const void* src,
                          bool src_on_host, int64_t n, DataType type, const ChunkFn& on_chunk) {
  const int64_t P = world.size(), rank = world.rank();
  const int64_t elem = static_cast<int64_t>(DataTypeSize(type));
  const int64_t chunk = static_cast<int64_t>(scratch.bytes()) / (P * elem);
  if (chunk < 1) {
    return absl::InternalError(absl::StrCat("gather: the ", scratch.bytes(), "-byte scratch cannot hold one ",
                                            DataTypeName(type), " element per rank of ", P, " ranks"));
  }
  std::vector<float> host;
  std::vector<Bf16> bits;  // one bf16 chunk of every rank, on the host
  if (on_chunk) host.resize(std::min(chunk, n) * P);
  char* recv = static_cast<char*>(scratch.data());
  const char* from = static_cast<const char*>(src);
  for (int64_t lo = 0; lo < n; lo += chunk) {
    const int64_t len = std::min(chunk, n - lo), bytes = len * elem;
    // The gathered chunk is [P][len]: rank r's block at r * bytes.
    if (src_on_host) {
      char* mine = recv + rank * bytes;
      // From the caller's memory: done when Copy returns (backend.h).
      PLATEAU_RETURN_IF_ERROR(be.Copy(s, mine, from + lo * elem, bytes));
      PLATEAU_RETURN_IF_ERROR(world.AllGather(s, mine, recv, len, type));
    } else {
      PLATEAU_RETURN_IF_ERROR(world.AllGather(s, from + lo * elem, recv, len, type));
    }
    if (!on_chunk) continue;
    // Into host memory: done when Copy returns, after the gather (same
    // stream), so the next chunk may overwrite the scratch.
    if (type == DataType::kBfloat16) {
      bits.resize(len * P);
      PLATEAU_RETURN_IF_ERROR(be.Copy(s, bits.data(), recv, bytes * P));
      for (int64_t i = 0; i < len * P; ++i) host[i] = Bf16ToFloat(bits[i]);
    } else {
      PLATEAU_RETURN_IF_ERROR(be.Copy(s, host.data(), recv, bytes * P));
    }
    on_chunk(lo, len, host.data());
  }
  return s.Synchronize();
}

// GatherChunks into host floats [P * n], rank r's at r * n.
absl::StatusOr<std::vector<float>> GatherThrough(Backend& be, Communicator& world, Stream& s, Buffer& scratch,
                                                 const void* src, bool src_on_host, int64_t n,
                                                 DataType type = DataType::kFloat32) {
  const int64_t P = world.size();
  std::vector<float> out(n * P);
  PLATEAU_RETURN_IF_ERROR(GatherChunks(be, world, s, scratch, src, src_on_host, n, type,
                                       [&](int64_t lo, int64_t len, const float* values) {
                                         for (int64_t r = 0; r < P; ++r) {
                                           std::copy_n(values + r * len, len, out.data() + r * n + lo);
                                         }
                                       }));
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::vector<float>>> TrainingStep::GatherWeights() {
  Impl& I = *impl_;
  const bool bf16 = options_.precision == Precision::kBf16Mixed;
  const DataType type = bf16 ? DataType::kBfloat16 : DataType::kFloat32;
  // The working dense weights are the masters all-gathered (fp32: the same
  // bits; bf16: their roundings).
  std::vector<float> dense(layout_.dense_padded());
  if (bf16) {
    std::vector<Bf16> bits(dense.size());
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.comm, bits.data(), I.dense.data(), I.dense.bytes()));
    for (size_t i = 0; i < dense.size(); ++i) dense[i] = Bf16ToFloat(bits[i]);
  } else {
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.comm, dense.data(), I.dense.data(), I.dense.bytes()));
  }
  // The scratch (dense_grad) once the compute stream is done with it: it is
  // at every method's return; the wait makes the hand-over explicit.
  PLATEAU_RETURN_IF_ERROR(I.compute->Synchronize());
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> owned,
                           GatherThrough(backend_, world_, *I.comm, I.dense_grad, I.owned.data(), /*src_on_host=*/false,
                                         layout_.owned_numel_per_rank(), type));
  return layout_.Assemble(dense, owned);
}

absl::StatusOr<std::vector<std::vector<float>>> TrainingStep::GatherGrads() {
  Impl& I = *impl_;
  const DataType type = options_.precision == Precision::kBf16Mixed ? DataType::kBfloat16 : DataType::kFloat32;
  // dense_grad_shard holds the reduced gradient; dense_grad (the scratch)
  // is dead after the reduce-scatter.
  PLATEAU_RETURN_IF_ERROR(I.compute->Synchronize());
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> dense,
                           GatherThrough(backend_, world_, *I.comm, I.dense_grad, I.dense_grad_shard.data(),
                                         /*src_on_host=*/false, layout_.shard_numel(), type));
  PLATEAU_ASSIGN_OR_RETURN(std::vector<float> owned,
                           GatherThrough(backend_, world_, *I.comm, I.dense_grad, I.owned_grad.data(),
                                         /*src_on_host=*/false, layout_.owned_numel_per_rank(), type));
  return layout_.Assemble(dense, owned);
}

absl::StatusOr<std::pair<int64_t, int64_t>> TrainingStep::RangeAcrossRanks(int64_t value) {
  Impl& I = *impl_;
  // The maximum of value and of -value: one all-reduce for both ends. The
  // stats buffer is free between steps (each Pass zeroes it first).
  double* d = I.stats.as<double>();
  double host[2] = {static_cast<double>(value), -static_cast<double>(value)};
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.comm, d, host, sizeof(host)));
  PLATEAU_RETURN_IF_ERROR(world_.AllReduce(*I.comm, d, d, 2, DataType::kFloat64, ReduceOp::kMax));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.comm, host, d, sizeof(host)));
  PLATEAU_RETURN_IF_ERROR(I.comm->Synchronize());
  return std::pair<int64_t, int64_t>{-static_cast<int64_t>(host[1]), static_cast<int64_t>(host[0])};
}

absl::StatusOr<ModelState> TrainingStep::GatherState() {
  Impl& I = *impl_;
  const bool bf16 = options_.precision == Precision::kBf16Mixed;
  ModelState st;
  if (!bf16) {
    PLATEAU_ASSIGN_OR_RETURN(st.weights, GatherWeights());
  }
  const int64_t S = layout_.shard_numel(), X = layout_.owned_numel_per_rank();
  // This rank's shard on the host (the optimizer's own copy out).
  PLATEAU_ASSIGN_OR_RETURN(OptimizerShardState mine, I.optimizer->Save());
  PLATEAU_RETURN_IF_ERROR(I.compute->Synchronize());  // the scratch's last user
  // One family: the dense shards and the owned vectors, gathered and
  // assembled into full tensors (the flat vectors go when it returns).
  auto family = [&](const std::vector<float>& dense, const std::vector<float>& owned)
      -> absl::StatusOr<std::vector<std::vector<float>>> {
    PLATEAU_ASSIGN_OR_RETURN(std::vector<float> d, GatherThrough(backend_, world_, *I.comm, I.dense_grad, dense.data(),
                                                                 /*src_on_host=*/true, S));
    PLATEAU_ASSIGN_OR_RETURN(std::vector<float> o, GatherThrough(backend_, world_, *I.comm, I.dense_grad, owned.data(),
                                                                 /*src_on_host=*/true, X));
    return layout_.Assemble(d, o);
  };
  if (bf16) {
    // The fp32 masters, not their bf16 working copies.
    PLATEAU_ASSIGN_OR_RETURN(st.weights, family(mine.dense_master, mine.owned_master));
  }
  PLATEAU_ASSIGN_OR_RETURN(st.m, family(mine.dense_m, mine.owned_m));
  PLATEAU_ASSIGN_OR_RETURN(st.v, family(mine.dense_v, mine.owned_v));
  st.step = step_;
  return st;
}

// The full state on every rank (tests; the trainer streams, below), read
// through LoadStreamedState: this rank's shard is cut from it.
absl::Status TrainingStep::LoadState(const ModelState& st) {
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
  return LoadStreamedState(st.step, [&st](StateFamily f, int weight, int64_t offset, float* values, int64_t n) {
    std::copy_n(st.family(f)[weight].data() + offset, n, values);
    return absl::OkStatus();
  });
}

// Streamed: the families in turn, each as the dense shards then the owned
// vectors of all ranks, gathered chunk by chunk through the dense gradient
// buffer (GatherChunks) and cut into runs by the layout's one map
// (ParamLayout::ForEach*Run). The weights are the fp32 masters: the
// optimizer's dense master shard, and the owned weights themselves in fp32
// (on the device) or their separate masters under bf16.
absl::Status TrainingStep::StreamState(const StateSink* sink) {
  Impl& I = *impl_;
  const bool bf16 = options_.precision == Precision::kBf16Mixed;
  const int64_t P = world_.size(), S = layout_.shard_numel(), X = layout_.owned_numel_per_rank();
  PLATEAU_ASSIGN_OR_RETURN(OptimizerShardState mine, I.optimizer->Save());
  PLATEAU_RETURN_IF_ERROR(I.compute->Synchronize());  // the scratch's last user
  // The sink's first failure. The gathers go on without it, so that every
  // rank makes the same collectives and none waits for a rank that left.
  absl::Status sink_status;
  auto part = [&](StateFamily family, bool owned, const void* src, bool src_on_host) {
    ChunkFn to_sink;
    if (sink != nullptr) {
      to_sink = [&](int64_t lo, int64_t len, const float* values) {
        for (int64_t r = 0; r < P && sink_status.ok(); ++r) {
          auto emit = [&](const ParamLayout::Run& run) {
            if (!sink_status.ok()) return;
            sink_status = (*sink)(family, run.weight, run.tensor_offset, values + r * len + (run.part_offset - lo),
                                  run.numel);
          };
          if (owned) {
            layout_.ForEachOwnedRun(r, lo, lo + len, emit);
          } else {
            layout_.ForEachDenseRun(r, lo, lo + len, emit);
          }
        }
      };
    }
    return GatherChunks(backend_, world_, *I.comm, I.dense_grad, src, src_on_host, owned ? X : S,
                        DataType::kFloat32, to_sink);
  };
  PLATEAU_RETURN_IF_ERROR(part(StateFamily::kWeights, false, mine.dense_master.data(), true));
  PLATEAU_RETURN_IF_ERROR(bf16 ? part(StateFamily::kWeights, true, mine.owned_master.data(), true)
                               : part(StateFamily::kWeights, true, I.owned.data(), false));
  PLATEAU_RETURN_IF_ERROR(part(StateFamily::kM, false, mine.dense_m.data(), true));
  PLATEAU_RETURN_IF_ERROR(part(StateFamily::kM, true, mine.owned_m.data(), true));
  PLATEAU_RETURN_IF_ERROR(part(StateFamily::kV, false, mine.dense_v.data(), true));
  PLATEAU_RETURN_IF_ERROR(part(StateFamily::kV, true, mine.owned_v.data(), true));
  return sink_status;
}

int64_t TrainingStep::StreamStateHostBytes(bool with_sink) const {
  return plateau::StreamStateHostBytes(options_, layout_, with_sink);
}

int64_t TrainingStep::LoadStreamedStateHostBytes() const { return plateau::LoadStreamedStateHostBytes(layout_); }

int64_t TrainingStep::attention_forwards() const { return impl_->attention_forwards; }

std::string TrainingStep::KernelsDescribe() const { return impl_->kernels->Describe(); }

std::vector<Stream*> TrainingStep::streams() { return {impl_->compute.get(), impl_->comm.get()}; }

// Device memory: none. Each rank reads its own dense shard and owned vector
// (the runs of its parts, ParamLayout::ForEach*Run) from the source and
// copies them straight into the launch-sized buffers: the owned working
// weights here, the masters and moments by OptimizerUpdate::Load (device
// buffers, or the offloaded optimizers' host state), whose refresh
// all-gathers in place into the working dense weights. Padding stays zero.
absl::Status TrainingStep::LoadStreamedState(int64_t step, const StateSource& source) {
  Impl& I = *impl_;
  if (step < 0) return absl::InvalidArgumentError("state: step must be >= 0");
  const int64_t rank = world_.rank(), S = layout_.shard_numel(), X = layout_.owned_numel_per_rank();
  OptimizerShardState shard;
  std::vector<float> owned;
  auto read = [&](StateFamily family, std::vector<float>* dense_part, std::vector<float>* owned_part) {
    dense_part->assign(S, 0.0f);
    owned_part->assign(X, 0.0f);
    absl::Status s;
    auto into = [&](std::vector<float>* part) {
      return [&s, &source, family, part](const ParamLayout::Run& run) {
        if (s.ok()) s = source(family, run.weight, run.tensor_offset, part->data() + run.part_offset, run.numel);
      };
    };
    layout_.ForEachDenseRun(rank, 0, S, into(dense_part));
    layout_.ForEachOwnedRun(rank, 0, X, into(owned_part));
    return s;
  };
  PLATEAU_RETURN_IF_ERROR(read(StateFamily::kWeights, &shard.dense_master, &owned));
  PLATEAU_RETURN_IF_ERROR(read(StateFamily::kM, &shard.dense_m, &shard.owned_m));
  PLATEAU_RETURN_IF_ERROR(read(StateFamily::kV, &shard.dense_v, &shard.owned_v));
  if (options_.precision == Precision::kBf16Mixed) {
    // The owned weights' fp32 master; the optimizer writes rn(master).
    shard.owned_master = std::move(owned);
  } else {
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*I.compute, I.owned.data(), owned.data(), I.owned.bytes()));
  }
  PLATEAU_RETURN_IF_ERROR(I.optimizer->Load(shard));
  step_ = step;
  return absl::OkStatus();
}

}  // namespace plateau
