#include "worker/job_spec.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/unknown_field_set.h"
#include "kernels/budget/budget.h"
#include "kernels/budget/n_max.h"
#include "kernels/model/attention_tc.h"
#include "kernels/model/config.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/status_macros.h"
#include "proto/does_not_fit.h"
#include "proto/utf8.h"
#include "server/labels.h"
#include "worker/calibration.h"

namespace plateau {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view expected, absl::string_view got) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got));
}

// Upper bounds that keep every byte count of the plan inside int64 (and far
// beyond any real job); a spec over them is refused, never overflowed.
constexpr int64_t kMaxDim = int64_t{1} << 20;
// The plan lists every layer's weights by name (ModelWeights, three times):
// 2^20 layers made planning one spec take 15 s and 1.9 GB on the
// coordinator's RPC thread. 4096 is far beyond any real depth.
constexpr int64_t kMaxLayers = int64_t{1} << 12;
constexpr int64_t kMaxRanks = 65536;
constexpr int64_t kMaxSteps = int64_t{1} << 40;
// Per size category of CheckSize; its five categories stay under INT64_MAX
// (9.2e18) together, so the plan's sum of live sets cannot overflow either.
constexpr double kMaxPlannedBytes = 1e18;
// JobSpec.priority's range, and max_duration_s's bound: a year, far beyond
// any run, and small enough for any time arithmetic.
constexpr int32_t kMaxJobPriority = 1000;
constexpr int64_t kMaxDurationS = 365 * 24 * 3600;

absl::Status CheckRange(absl::string_view field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) return Bad(field, absl::StrCat(lo, " to ", hi), absl::StrCat(v));
  return absl::OkStatus();
}

absl::Status CheckFloat(absl::string_view field, float v, float lo, bool lo_open, float hi,
                        bool hi_open) {
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (!ok) {
    return Bad(field,
               absl::StrCat("a finite value in ", lo_open ? "(" : "[", lo, ", ",
                            std::isinf(hi) ? "inf" : absl::StrCat(hi), hi_open ? ")" : "]"),
               absl::StrCat(v));
  }
  return absl::OkStatus();
}

// proto3 strings must be UTF-8: the wire parser (the coordinator's gRPC
// server, the rank reading its assignment) refuses a message with one that
// is not, so a spec built in process with such bytes must not validate.
// The parser's own check, so that the two agree.
absl::Status CheckText(absl::string_view field, const std::string& s) {
  if (!google::protobuf::internal::IsStructurallyValidUTF8(s.data(), static_cast<int>(s.size()))) {
    return Bad(field, "UTF-8 text (a proto3 string)", absl::StrCat(s.size(), " bytes that are not UTF-8"));
  }
  return absl::OkStatus();
}

// Text that plateauctl prints as it is (a job's name): no control
// characters, C0 (tab and newline included), DEL or C1, which a terminal
// would act on (escape sequences can rewrite what the operator sees).
// After CheckText: `s` is UTF-8, so C1 is the two bytes C2 80..C2 9F.
absl::Status CheckPrintable(absl::string_view field, const std::string& s) {
  const size_t i = FirstControlCharacter(s);
  if (i == s.size()) return absl::OkStatus();
  const auto c = static_cast<unsigned char>(s[i]);
  const int code = c == 0xC2 ? 0xC200 + static_cast<unsigned char>(s[i + 1]) : c;
  return Bad(field, "printable text (no control characters)",
             absl::StrCat("a control character at byte ", i, " (0x", absl::Hex(code), ")"));
}

absl::Status CheckPath(absl::string_view field, const std::string& path) {
  if (path.empty()) return Bad(field, "a path", "an empty string");
  PLATEAU_RETURN_IF_ERROR(CheckText(field, path));
  // Paths reach failure reasons and logs that operators read on terminals.
  PLATEAU_RETURN_IF_ERROR(CheckPrintable(field, path));
  if (path.size() > 4096 || path.find('\0') != std::string::npos) {
    return Bad(field, "a path of at most 4096 bytes without NUL", absl::StrCat(path.size(), " bytes"));
  }
  if (path[0] != '/') {
    return Bad(field, "an absolute path on the worker's node (plateauctl makes relative paths absolute)",
               absl::StrCat("'", path.substr(0, 256), path.size() > 256 ? "...'" : "'"));
  }
  return absl::OkStatus();
}

absl::Status ConvertModel(const v1::ModelSpec& s, ModelConfig* m) {
  for (auto [field, v] : {std::pair<const char*, int64_t>{"model.vocab_size", s.vocab_size()},
                          {"model.hidden", s.hidden()},
                          {"model.layers", s.layers()},
                          {"model.heads", s.heads()},
                          {"model.kv_heads", s.kv_heads()},
                          {"model.experts", s.experts()},
                          {"model.top_k", s.top_k()},
                          {"model.expert_ffn", s.expert_ffn()},
                          {"model.seq_len", s.seq_len()}}) {
    const std::string f = field;
    const int64_t hi = f == "model.vocab_size" ? (int64_t{1} << 31) : f == "model.layers" ? kMaxLayers : kMaxDim;
    const int64_t lo = f == "model.vocab_size" ? 2 : 1;
    PLATEAU_RETURN_IF_ERROR(CheckRange(field, v, lo, hi));
  }
  // Upper bounds far beyond real models, below the values whose fp32
  // arithmetic overflows (a weight std of 1e30 makes every activation inf).
  if (s.has_rope_theta()) {
    PLATEAU_RETURN_IF_ERROR(CheckFloat("model.rope_theta", s.rope_theta(), 1, true, 1e12f, false));
  }
  if (s.has_norm_eps()) PLATEAU_RETURN_IF_ERROR(CheckFloat("model.norm_eps", s.norm_eps(), 0, true, 1, false));
  if (s.has_init_std()) PLATEAU_RETURN_IF_ERROR(CheckFloat("model.init_std", s.init_std(), 0, true, 1, false));
  m->vocab_size = s.vocab_size();
  m->hidden = s.hidden();
  m->layers = s.layers();
  m->heads = s.heads();
  m->kv_heads = s.kv_heads();
  m->experts = s.experts();
  m->top_k = s.top_k();
  m->expert_ffn = s.expert_ffn();
  m->seq_len = s.seq_len();
  if (s.has_rope_theta()) m->rope_theta = s.rope_theta();
  if (s.has_norm_eps()) m->norm_eps = s.norm_eps();
  if (s.has_init_std()) m->init_std = s.init_std();
  return ValidateModelConfig(*m);
}

absl::Status ConvertOptimizer(const v1::OptimizerSpec& s, OptimizerConfig* o) {
  PLATEAU_RETURN_IF_ERROR(CheckFloat("optimizer.lr", s.lr(), 0, true, 1e3f, false));
  o->lr = s.lr();
  if (s.has_beta1()) {
    PLATEAU_RETURN_IF_ERROR(CheckFloat("optimizer.beta1", s.beta1(), 0, false, 1, true));
    o->beta1 = s.beta1();
  }
  if (s.has_beta2()) {
    PLATEAU_RETURN_IF_ERROR(CheckFloat("optimizer.beta2", s.beta2(), 0, false, 1, true));
    o->beta2 = s.beta2();
  }
  if (s.has_eps()) {
    PLATEAU_RETURN_IF_ERROR(CheckFloat("optimizer.eps", s.eps(), 0, true, 1, false));
    o->eps = s.eps();
  }
  if (s.has_weight_decay()) {
    PLATEAU_RETURN_IF_ERROR(CheckFloat("optimizer.weight_decay", s.weight_decay(), 0, false, 1, false));
    o->weight_decay = s.weight_decay();
  }
  if (s.has_max_grad_norm()) {
    PLATEAU_RETURN_IF_ERROR(
        CheckFloat("optimizer.max_grad_norm", s.max_grad_norm(), 0, false, INFINITY, true));
    o->max_grad_norm = s.max_grad_norm();
  }
  return absl::OkStatus();
}

// The schedule ends at the job's last step, so it is converted once steps
// is known (kernels/optimizer/lr_schedule.h checks it against lr).
absl::Status ConvertLrSchedule(const v1::OptimizerSpec& s, int64_t steps, OptimizerConfig* o) {
  switch (s.lr_decay()) {
    case v1::OptimizerSpec::LR_DECAY_UNSPECIFIED:
    case v1::OptimizerSpec::LR_DECAY_CONSTANT:
      o->schedule.decay = LrSchedule::Decay::kConstant;
      break;
    case v1::OptimizerSpec::LR_DECAY_COSINE:
      o->schedule.decay = LrSchedule::Decay::kCosine;
      break;
    case v1::OptimizerSpec::LR_DECAY_LINEAR:
      o->schedule.decay = LrSchedule::Decay::kLinear;
      break;
    default:
      return Bad("optimizer.lr_decay", "LR_DECAY_CONSTANT, LR_DECAY_COSINE or LR_DECAY_LINEAR",
                 absl::StrCat(static_cast<int>(s.lr_decay())));
  }
  o->schedule.warmup_steps = s.warmup_steps();
  o->schedule.total_steps = steps;
  o->schedule.min_lr = s.min_lr();
  return ValidateLrSchedule(*o, "optimizer");
}

absl::Status ConvertData(const v1::DataSpec& s, const ModelConfig& m, const LayoutConfig& l,
                         DataOptions* d) {
  switch (s.source_case()) {
    case v1::DataSpec::kRecall: {
      const v1::RecallData& r = s.recall();
      PLATEAU_RETURN_IF_ERROR(CheckRange("data.recall.num_keys", r.num_keys(), 1, kMaxDim));
      PLATEAU_RETURN_IF_ERROR(CheckRange("data.recall.num_values", r.num_values(), 1, kMaxDim));
      PLATEAU_RETURN_IF_ERROR(CheckRange("data.recall.pairs", r.pairs(), 1, r.num_keys()));
      PLATEAU_RETURN_IF_ERROR(CheckRange("data.recall.queries", r.queries(), 1, r.pairs()));
      d->kind = DataOptions::Kind::kRecall;
      d->recall.num_keys = r.num_keys();
      d->recall.num_values = r.num_values();
      d->recall.pairs = r.pairs();
      d->recall.queries = r.queries();
      d->recall.seed = r.has_seed() ? r.seed() : 1;
      const int64_t need = 2 * r.pairs() + 3 * r.queries();
      if (m.seq_len < need) {
        return Bad("model.seq_len",
                   absl::StrCat(">= ", need, " for ", r.pairs(), " recall pairs and ", r.queries(),
                                " queries (data.recall)"),
                   absl::StrCat(m.seq_len));
      }
      if (d->recall.vocab_size() > m.vocab_size) {
        return Bad("model.vocab_size",
                   absl::StrCat(">= ", d->recall.vocab_size(),
                                " for the recall task (2 + num_keys + num_values)"),
                   absl::StrCat(m.vocab_size));
      }
      // The data source's own checks, as the rank will run them: with the
      // held-out split, both of its streams (a task too small to split
      // was refused by every rank, after scheduling, not here).
      PLATEAU_RETURN_IF_ERROR(CheckRange("data.held_out_sequences", s.held_out_sequences(), 0, kMaxDim));
      for (bool validation : {false, true}) {
        if (validation && s.held_out_sequences() == 0) break;
        DataSlice slice{l.batch, m.seq_len, 0, l.ranks, s.held_out_sequences(), validation};
        auto src = OpenAssociativeRecall(d->recall, slice);
        if (!src.ok()) return src.status();
      }
      return absl::OkStatus();
    }
    case v1::DataSpec::kText:
      PLATEAU_RETURN_IF_ERROR(CheckPath("data.text.path", s.text().path()));
      if (m.vocab_size < 256) {
        return Bad("model.vocab_size", ">= 256 for byte-level text (data.text)",
                   absl::StrCat(m.vocab_size));
      }
      d->kind = DataOptions::Kind::kText;
      d->paths = {s.text().path()};
      return absl::OkStatus();
    case v1::DataSpec::kShards:
      if (s.shards().paths().empty()) return Bad("data.shards.paths", "at least one file", "none");
      for (int i = 0; i < s.shards().paths_size(); ++i) {
        PLATEAU_RETURN_IF_ERROR(CheckPath(absl::StrCat("data.shards.paths[", i, "]"), s.shards().paths(i)));
      }
      d->kind = DataOptions::Kind::kShards;
      d->paths.assign(s.shards().paths().begin(), s.shards().paths().end());
      return absl::OkStatus();
    case v1::DataSpec::SOURCE_NOT_SET:
      break;
  }
  return Bad("data", "one of data.recall, data.text or data.shards", "none");
}

// schedule.llep / schedule.pipelined_llep -> the step's dispatch options
// (standard EP when unset). A 0 takes the default; the values themselves
// are checked by the budget (kernels/dispatch/llep_plan.h), which names the
// field.
absl::Status ConvertDispatch(const v1::ScheduleSpec& s, DispatchOptions* out) {
  auto balance = [](double alpha, int64_t min_piece, double lambda, int64_t max_borrowed,
                    LlepOptions* o) {
    if (alpha != 0) o->alpha = alpha;
    if (min_piece != 0) o->min_piece = min_piece;
    if (lambda != 0) o->lambda = lambda;
    o->max_borrowed = max_borrowed;  // 0 is the default: no cap
  };
  switch (s.dispatch_case()) {
    case v1::ScheduleSpec::kLlep:
      out->kind = DispatchOptions::Kind::kLlep;
      balance(s.llep().alpha(), s.llep().min_piece(), s.llep().lambda(), s.llep().max_borrowed(),
              &out->llep);
      break;
    case v1::ScheduleSpec::kPipelinedLlep: {
      const v1::PipelinedLlepDispatch& p = s.pipelined_llep();
      out->kind = DispatchOptions::Kind::kPipelinedLlep;
      if (p.chunk_tokens_auto() && p.chunk_tokens() != 0) {
        return Bad("schedule.pipelined_llep.chunk_tokens", "0 (unset) beside chunk_tokens_auto: true",
                   absl::StrCat(p.chunk_tokens()));
      }
      if (p.chunk_tokens() != 0) out->pipelined.chunk_tokens = p.chunk_tokens();
      balance(p.alpha(), p.min_piece(), p.lambda(), p.max_borrowed(), &out->pipelined.balance);
      switch (p.membership()) {
        case v1::PipelinedLlepDispatch::MEMBERSHIP_UNSPECIFIED:
        case v1::PipelinedLlepDispatch::MEMBERSHIP_STRIDED:
          out->pipelined.membership = ChunkMembership::kStrided;
          break;
        case v1::PipelinedLlepDispatch::MEMBERSHIP_CONTIGUOUS:
          out->pipelined.membership = ChunkMembership::kContiguous;
          break;
        default:
          return Bad("schedule.pipelined_llep.membership",
                     "MEMBERSHIP_UNSPECIFIED, MEMBERSHIP_STRIDED or MEMBERSHIP_CONTIGUOUS",
                     absl::StrCat(static_cast<int>(p.membership())));
      }
      break;
    }
    default:
      break;
  }
  return absl::OkStatus();
}

// schedule.offload_stream_adamw / schedule.cpu_offload_adamw -> where the
// optimizer state lives (the device when unset). A 0 takes the default.
absl::Status ConvertOptimizerPlacement(const v1::ScheduleSpec& s, OptimizerPlacementOptions* out) {
  switch (s.optimizer_placement_case()) {
    case v1::ScheduleSpec::kCpuOffloadAdamw:
      out->kind = OptimizerPlacementOptions::Kind::kCpuOffload;
      break;
    case v1::ScheduleSpec::kOffloadStreamAdamw: {
      const v1::OffloadStreamAdamW& o = s.offload_stream_adamw();
      out->kind = OptimizerPlacementOptions::Kind::kOffloadStream;
      if (o.bucket_params_auto() && o.bucket_params() != 0) {
        return Bad("schedule.offload_stream_adamw.bucket_params", "0 (unset) beside bucket_params_auto: true",
                   absl::StrCat(o.bucket_params()));
      }
      if (o.bucket_params() != 0) out->bucket_params = o.bucket_params();
      if (o.staging_slots() != 0) out->staging_slots = o.staging_slots();
      break;
    }
    default:
      break;
  }
  return absl::OkStatus();
}

// An upper bound, in doubles, of every byte count the plan forms in int64
// (each buffer of PlanMemory's LaunchBuffers, the projection's bound, the
// dispatch estimate, the parameter counts), by category. Each category is
// over-counted and capped at kMaxPlannedBytes, so that no int64 product in
// the plan and no sum of its live sets can overflow; a spec over the cap is
// refused naming what is too large. (Checking only some products let
// tokens per rank x top_k x hidden overflow the dispatch estimate.)
absl::Status CheckSize(const ModelConfig& m, const LayoutConfig& l) {
  const double N = static_cast<double>(l.batch) * m.seq_len / l.ranks;  // tokens per rank
  const double T = static_cast<double>(m.seq_len) / l.ranks;            // of one sequence
  const double H = m.hidden, L = m.layers, E = m.experts, K = m.top_k, F = m.expert_ffn;
  const double V = m.vocab_size, P = l.ranks;
  // Routes sent per rank, and the rows one rank may receive at the worst
  // routing: LLEP's and PipelinedLLEP's plans size their buffers for every
  // rank's routes, P x N x k (kernels/dispatch/llep_plan.cc
  // LlepWorstCaseSizes), which bounds standard EP's P x N x min(k, E/P) too.
  // (Standard EP's alone let an LLEP plan with k >= E/P overflow.)
  const double sent = N * K, received = N * K * P;
  const double params = 2 * V * H + L * H * (4 * H + E + 3 * E * F + 2) + H;
  // Activations: the L+1 boundaries and ~40 [N, hidden]-sized buffers
  // (q, kv, travellers, ... heads and kv_heads <= hidden), the router's
  // [N, E] and [N, k], and the attention panel (at most 2 T^2).
  const double activations = 4 * N * (H * (L + 41) + 8 * E + 8) + 8 * T * T;
  for (auto [what, bytes] :
       {std::pair<const char*, double>{"the vocabulary projection (tokens per rank x model.vocab_size)",
                                       4 * (N * V + 3 * H * (N + V) + 12 * N)},
        {"the activations (tokens per rank x (model.hidden x model.layers + model.experts))", activations},
        // The rows x (hidden, expert_ffn) buffers of dispatch, their
        // index words, and PipelinedLLEP's count words ((1 + P) x chunks
        // x E, at most one chunk per token).
        {"the routed tokens (tokens per rank x model.top_k, received from layout.ranks ranks, x "
         "(model.hidden + model.expert_ffn))",
         4 * (sent + received) * (5 * H + 6 * F) + 16 * (sent + received) + 8 * (1 + P) * N * E},
        {"the parameters and their optimizer state", 32 * params},
        // schedule.keep_attention's records (counted whether or not it
        // is on: an over-count, as every category is).
        {"attention's kept outputs (tokens per rank x model.layers x (model.hidden + model.heads))",
         4 * N * L * (H + m.heads)}}) {
    if (!(bytes <= kMaxPlannedBytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model: the job is too large to plan: ", what, " would take ~", bytes,
          " bytes per rank (at most ", kMaxPlannedBytes, ")"));
    }
  }
  return absl::OkStatus();
}

std::string Bytes(int64_t b) {
  if (b >= (int64_t{1} << 30)) return absl::StrCat(b, " bytes (", absl::StrFormat("%.2f", b / 1073741824.0), " GiB)");
  return absl::StrCat(b, " bytes (", absl::StrFormat("%.2f", b / 1048576.0), " MiB)");
}

void AxisToProto(const NMaxAxis& a, v1::NMaxAxis* out) {
  out->set_batch(a.batch);
  out->set_seq_len(a.seq_len);
  out->set_tokens_per_rank(a.tokens_per_rank);
  out->set_limit(a.limit);
  out->set_detail(a.detail);
  for (const auto& [field, value] : a.auto_values) {
    v1::AutoSetting* s = out->add_auto_settings();
    s->set_field(field);
    s->set_value(value);
  }
}

void NMaxToProto(const NMax& n, v1::NMax* out) {
  AxisToProto(n.batch, out->mutable_batch());
  AxisToProto(n.context, out->mutable_context());
}

// N_max within the spec's own limits: the batch and seq_len its validation
// accepts, and CheckSize on every candidate so that no plan overflows.
NMaxLimits SpecLimits(const std::function<absl::Status()>& still_wanted) {
  NMaxLimits limits;
  limits.max_batch = kMaxDim;
  limits.max_seq_len = kMaxDim;
  limits.check = [](const StepOptions& o) { return CheckSize(o.model, o.layout); };
  limits.still_wanted = still_wanted;
  return limits;
}

// The spec's `auto` settings chosen on the context's calibration (or the
// default curve) against the spec's caps, or the context's worker's memory
// where the spec's cap is 0: the chosen values set in *step, and
// auto_settings and calibration set in *out (auto_nothing_fits when no
// value fits, which AdmitJob and placement read). The calibration used in
// *calibration. Nothing when none is `auto`.
absl::Status ChooseSpecAutoSettings(const v1::JobSpec& spec, const AutoContext& context, StepOptions* step,
                                    v1::MemoryPlan* out, Calibration* calibration_used) {
  const AutoRequest request = AutoRequestOf(spec);
  if (!request.any()) return absl::OkStatus();
  std::string source;
  PLATEAU_ASSIGN_OR_RETURN(const Calibration calibration, CalibrationFor(spec, context, &source));
  *calibration_used = calibration;
  FitCaps caps{spec.device_memory_bytes(), spec.host_memory_bytes()};
  // force_launch against the spec's own cap: admission asks only that the
  // launch-sized state fit (AdmitPlan), so the choice counts standard EP's
  // and LLEP's dispatch at its balanced case, not its worst; counted whole,
  // nothing fit and the slowest settings ran. Against a worker's memory
  // the whole plan must fit (placement's rule), as without force_launch.
  caps.balanced_dispatch = spec.force_launch() && spec.device_memory_bytes() > 0;
  std::string caps_note;
  if (caps.device_bytes == 0 && context.device_memory_bytes > 0) {
    caps.device_bytes = context.device_memory_bytes;
    caps_note = absl::StrCat("; device_memory_bytes 0: chosen against that worker's ", Bytes(caps.device_bytes));
  }
  if (caps.host_bytes == 0 && context.host_memory_bytes > 0) {
    caps.host_bytes = context.host_memory_bytes;
    absl::StrAppend(&caps_note, "; host_memory_bytes 0: chosen against that worker's ", Bytes(caps.host_bytes));
  }
  absl::StatusOr<AutoChoice> chosen = plateau::ChooseAutoSettings(*step, request, calibration, caps);
  if (chosen.status().code() == absl::StatusCode::kResourceExhausted) {
    // Nothing fits: the plan is shown at the smallest settings (over a cap),
    // with the reason as a note and in auto_nothing_fits, which admission
    // (the spec's cap) or placement (the worker's) refuses on.
    PLATEAU_ASSIGN_OR_RETURN(*step, SmallestAutoSettings(*step, request));
    // The cap the chooser names: the device's when the smallest plan is over
    // it (ChooseAutoSettings' rule), else the host's.
    PLATEAU_ASSIGN_OR_RETURN(const MemoryPlan smallest, PlanMemory(*step));
    const bool device_over = caps.device_bytes != 0 && DeviceBytesAgainstCap(smallest, caps) > caps.device_bytes;
    v1::AutoNothingFits* none = out->mutable_auto_nothing_fits();
    none->set_cap(device_over ? "device_memory_bytes" : "host_memory_bytes");
    none->set_cap_bytes(device_over ? caps.device_bytes : caps.host_bytes);
    none->set_cap_of_the_worker(device_over ? spec.device_memory_bytes() == 0 : spec.host_memory_bytes() == 0);
    none->set_reason(std::string(chosen.status().message()));
    for (int i = 0; i < kNumAutoSettings; ++i) {
      const AutoSetting s = static_cast<AutoSetting>(i);
      if (!request.has(s)) continue;
      v1::AutoSetting* a = out->add_auto_settings();
      a->set_field(AutoSettingField(s));
      a->set_value(GetAutoSetting(*step, s));
      a->set_modelled_seconds(AutoSettingSeconds(*step, s, a->value(), calibration));
      a->set_candidates(static_cast<int32_t>(AutoCandidates(*step, s).size()));
      a->set_fitting(0);
      a->set_why("no value fits the caps: planned at the value with the smallest plan (see the auto note)");
    }
    out->set_calibration(source);
    out->add_notes(absl::StrCat("auto: ", chosen.status().message()));
    return absl::OkStatus();
  }
  PLATEAU_ASSIGN_OR_RETURN(AutoChoice choice, std::move(chosen));
  *step = choice.options;
  for (const AutoChoice::Setting& s : choice.settings) {
    v1::AutoSetting* a = out->add_auto_settings();
    a->set_field(AutoSettingField(s.setting));
    a->set_value(s.value);
    a->set_modelled_seconds(s.seconds);
    a->set_candidates(s.candidates);
    a->set_fitting(s.fitting);
    a->set_why(s.why);
  }
  out->set_calibration(source);
  out->add_notes(absl::StrCat("auto: ", choice.settings.size(),
                              " setting(s) chosen by least modelled time among the plans that fit; curves ", source,
                              caps_note));
  return absl::OkStatus();
}

}  // namespace

int64_t NodesOf(const v1::JobSpec& spec) {
  return spec.layout().nodes() == 0 ? 1 : spec.layout().nodes();
}

std::string BackendName(v1::Backend b) {
  switch (b) {
    case v1::BACKEND_CPU:
      return "cpu";
    case v1::BACKEND_CUDA:
      return "cuda";
    default:
      return "unspecified";
  }
}

absl::StatusOr<BackendOptions> ToBackendOptions(const v1::JobSpec& spec) {
  BackendOptions o;
  switch (spec.backend()) {
    case v1::BACKEND_CPU:
      o.kind = BackendKind::kCpu;
      if (spec.device_memory_bytes() < 1) {
        return Bad("device_memory_bytes",
                   "the size of each rank's device arena in bytes (>= 1) for backend cpu",
                   absl::StrCat(spec.device_memory_bytes()));
      }
      break;
    case v1::BACKEND_CUDA:
      o.kind = BackendKind::kCuda;
      if (spec.device_memory_bytes() < 0) {
        return Bad("device_memory_bytes", ">= 0 (0: the whole device)",
                   absl::StrCat(spec.device_memory_bytes()));
      }
      break;
    default:
      return Bad("backend", "BACKEND_CPU or BACKEND_CUDA", v1::Backend_Name(spec.backend()).empty()
                                                            ? absl::StrCat(spec.backend())
                                                            : v1::Backend_Name(spec.backend()));
  }
  o.device_memory_bytes = spec.device_memory_bytes();
  if (spec.host_memory_bytes() < 0) {
    return Bad("host_memory_bytes", ">= 0 (each rank's host memory cap in bytes; 0: uncapped, the node's host memory)",
               absl::StrCat(spec.host_memory_bytes()));
  }
  o.host_memory_bytes = spec.host_memory_bytes();
  return o;
}

// schedule.ring_dtp -> the step's projection options (dense when unset).
absl::Status ConvertProjection(const v1::ScheduleSpec& s, const ModelConfig& m,
                               ProjectionOptions* out) {
  if (s.projection_case() != v1::ScheduleSpec::kRingDtp) return absl::OkStatus();
  const v1::RingDtpProjection& r = s.ring_dtp();
  out->kind = ProjectionOptions::Kind::kRingDtp;
  switch (r.mode()) {
    case v1::RingDtpProjection::MODE_UNSPECIFIED:
      out->mode.reset();
      break;
    case v1::RingDtpProjection::MODE_ACTIVATIONS:
      out->mode = RingDtpMode::kActivations;
      break;
    case v1::RingDtpProjection::MODE_WEIGHTS:
      out->mode = RingDtpMode::kWeights;
      break;
    default:
      return Bad("schedule.ring_dtp.mode", "MODE_UNSPECIFIED, MODE_ACTIVATIONS or MODE_WEIGHTS",
                 absl::StrCat(static_cast<int>(r.mode())));
  }
  PLATEAU_RETURN_IF_ERROR(CheckRange("schedule.ring_dtp.strip", r.strip(), 0, m.vocab_size));
  if (r.strip_auto() && r.strip() != 0) {
    return Bad("schedule.ring_dtp.strip", "0 (unset) beside strip_auto: true", absl::StrCat(r.strip()));
  }
  PLATEAU_RETURN_IF_ERROR(CheckRange("schedule.ring_dtp.row_tile", r.row_tile(), 0, kMaxDim));
  PLATEAU_RETURN_IF_ERROR(CheckRange("schedule.ring_dtp.chunk_rows", r.chunk_rows(), 0, kMaxDim));
  out->strip = r.strip() > 0 ? r.strip() : std::min<int64_t>(1024, m.vocab_size);
  out->row_tile = r.row_tile() > 0 ? r.row_tile() : 2048;
  out->chunk_rows = r.chunk_rows();
  return absl::OkStatus();
}

// schedule.sco and schedule.keep_attention -> the step's checkpoint options
// (every boundary on the device when unset). beta is capped like every byte count of the plan.
absl::Status ConvertCheckpoints(const v1::ScheduleSpec& s, CheckpointOptions* out) {
  out->keep_attention = s.keep_attention();
  if (s.checkpoints_case() != v1::ScheduleSpec::kSco) return absl::OkStatus();
  const int64_t beta = s.sco().host_budget_bytes();
  if (beta < 0 || !(static_cast<double>(beta) <= kMaxPlannedBytes)) {
    return Bad("schedule.sco.host_budget_bytes",
               absl::StrCat(">= 0 bytes of host memory per rank for checkpoint boundaries (at most ",
                            kMaxPlannedBytes, ")"),
               absl::StrCat(beta));
  }
  if (s.sco().host_budget_auto() && beta != 0) {
    return Bad("schedule.sco.host_budget_bytes", "0 (unset) beside host_budget_auto: true", absl::StrCat(beta));
  }
  out->kind = CheckpointOptions::Kind::kSco;
  out->host_budget_bytes = beta;
  return absl::OkStatus();
}

// A field this build does not know (a newer client's) would be stored and
// silently ignored: refused instead, naming where it sits.
absl::Status CheckNoUnknownFields(const google::protobuf::Message& m, const std::string& path) {
  const google::protobuf::Reflection* r = m.GetReflection();
  const google::protobuf::UnknownFieldSet& unknown = r->GetUnknownFields(m);
  if (!unknown.empty()) {
    return Bad(path.empty() ? "spec" : path, "only fields of this coordinator's plateau.v1.JobSpec",
               absl::StrCat("unknown field number ", unknown.field(0).number(),
                            " (a client built from a newer job.proto?)"));
  }
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    if (f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) continue;
    const std::string sub = path.empty() ? f->name() : absl::StrCat(path, ".", f->name());
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        PLATEAU_RETURN_IF_ERROR(CheckNoUnknownFields(r->GetRepeatedMessage(m, f, i), sub));
      }
    } else {
      PLATEAU_RETURN_IF_ERROR(CheckNoUnknownFields(r->GetMessage(m, f), sub));
    }
  }
  return absl::OkStatus();
}

// precision -> the step's. Any backend plans either (PlanJob); whether the
// backend computes it is CheckPrecisionRuns'.
absl::Status ConvertPrecision(const v1::JobSpec& spec, Precision* out) {
  switch (spec.precision()) {
    case v1::PRECISION_UNSPECIFIED:
    case v1::PRECISION_FP32:
      *out = Precision::kFp32;
      return absl::OkStatus();
    case v1::PRECISION_BF16:
      *out = Precision::kBf16Mixed;
      return absl::OkStatus();
    default:
      return Bad("precision", "PRECISION_UNSPECIFIED, PRECISION_FP32 or PRECISION_BF16",
                 absl::StrCat(static_cast<int>(spec.precision())));
  }
}

// bf16_attention -> the step's (and whether its tensor-core kernels may run
// on wgmma). Only under bf16 (it chooses how bf16 attention computes); the
// tensor-core kernels take head_dim 64 and 128 on cuda, so a job asking for
// them at another head_dim is refused here rather than by its first step.
absl::Status ConvertBf16Attention(const v1::JobSpec& spec, const ModelConfig& model,
                                  Bf16Attention* out, bool* wgmma) {
  *wgmma = spec.bf16_attention() != v1::BF16_ATTENTION_TENSOR_CORE_MMA_SYNC;
  switch (spec.bf16_attention()) {
    case v1::BF16_ATTENTION_AUTO:
      *out = Bf16Attention::kAuto;
      return absl::OkStatus();
    case v1::BF16_ATTENTION_TILES:
      *out = Bf16Attention::kTiles;
      break;
    case v1::BF16_ATTENTION_TENSOR_CORE:
    case v1::BF16_ATTENTION_TENSOR_CORE_MMA_SYNC:
      *out = Bf16Attention::kTensorCore;
      break;
    default:
      return Bad("bf16_attention",
                 "BF16_ATTENTION_AUTO, BF16_ATTENTION_TILES, BF16_ATTENTION_TENSOR_CORE or "
                 "BF16_ATTENTION_TENSOR_CORE_MMA_SYNC",
                 absl::StrCat(static_cast<int>(spec.bf16_attention())));
  }
  if (spec.precision() != v1::PRECISION_BF16) {
    return Bad("bf16_attention", "unset (BF16_ATTENTION_AUTO) unless precision is PRECISION_BF16",
               absl::StrCat(Bf16AttentionName(*out), " with precision ",
                            v1::Precision_Name(spec.precision())));
  }
  if (*out == Bf16Attention::kTensorCore && spec.backend() == v1::BACKEND_CUDA &&
      !TensorCoreHeadDim(model.head_dim())) {
    return Bad("bf16_attention",
               absl::StrCat(v1::Bf16Attention_Name(spec.bf16_attention()),
                            " on cuda only for head_dim (model.hidden / model.heads) 64 or 128"),
               absl::StrCat("head_dim ", model.head_dim()));
  }
  return absl::OkStatus();
}

// What bf16 attention computes in, for the plan's notes.
std::string AttentionArithmeticNote(const v1::JobSpec& spec, const StepOptions& step) {
  const int64_t d = step.model.head_dim();
  const bool cuda = spec.backend() == v1::BACKEND_CUDA;
  switch (step.bf16_attention) {
    case Bf16Attention::kTiles:
      return "tiles (fp32 products of the loaded values)";
    case Bf16Attention::kTensorCore:
      if (!cuda) return "tensor-core arithmetic (the cpu's scalar reference: slow)";
      return step.attention_wgmma ? "tensor cores (wgmma on an H100/H200 where its checks agree)"
                                  : "tensor cores, mma.sync only (no wgmma)";
    case Bf16Attention::kAuto:
      break;
  }
  if (cuda && TensorCoreHeadDim(d)) {
    return absl::StrCat("auto: tensor cores (head_dim ", d, ")");
  }
  if (cuda) return absl::StrCat("auto: tiles (head_dim ", d, " has no tensor-core kernel; 64 and 128 do)");
  return "auto: tiles";
}

// A job runs only where its precision is computed: under bf16 the step
// computes every schedule, on every shape but those CheckBf16Schedules
// lists (the step's own check at Create: one list; the error names the
// field). Refused at submit (ValidateJobSpec,
// AdmitJob), not by PlanJob, so that `plateauctl plan` shows what a bf16
// job would need. Both backends compute bf16 (the cpu's is an exact
// emulation of the CUDA kernels' arithmetic, attention on tensor cores
// aside: bf16_attention says which arithmetic, and the cpu computes either).
absl::Status CheckPrecisionRuns(const StepOptions& step) { return CheckBf16Schedules(step); }

absl::StatusOr<TrainerOptions> ToTrainerOptions(const v1::JobSpec& spec) {
  // 1,040 shard paths of 4,000 bytes (each path within its own limit) made
  // a 4 MB spec; a hundred of them took the coordinator from 33 MB to
  // 485 MB and one worker's Register 4.7 s under its lock.
  if (const size_t bytes = spec.ByteSizeLong(); bytes > kMaxJobSpecBytes) {
    size_t paths = 0;
    for (const std::string& p : spec.data().shards().paths()) paths += p.size();
    return Bad(
        paths > kMaxJobSpecBytes / 2 ? "data.shards.paths" : "spec",
        absl::StrCat("a spec of at most ", kMaxJobSpecBytes, " bytes serialized"),
        absl::StrCat(bytes, " bytes (", spec.data().shards().paths_size(), " shard paths of ", paths, " bytes)"));
  }
  PLATEAU_RETURN_IF_ERROR(CheckNoUnknownFields(spec, ""));
  if (spec.name().size() > 256) return Bad("name", "at most 256 bytes", absl::StrCat(spec.name().size(), " bytes"));
  PLATEAU_RETURN_IF_ERROR(CheckText("name", spec.name()));
  PLATEAU_RETURN_IF_ERROR(CheckPrintable("name", spec.name()));
  if (!spec.has_model()) return Bad("model", "the model's configuration", "none");
  TrainerOptions t;
  PLATEAU_RETURN_IF_ERROR(ConvertModel(spec.model(), &t.step.model));
  if (!spec.has_layout()) return Bad("layout", "layout.ranks and layout.batch", "none");
  const v1::LayoutSpec& l = spec.layout();
  PLATEAU_RETURN_IF_ERROR(CheckRange("layout.ranks", l.ranks(), 1, kMaxRanks));
  PLATEAU_RETURN_IF_ERROR(CheckRange("layout.batch", l.batch(), 1, kMaxDim));
  if (l.nodes() < 0 || l.nodes() > l.ranks() || l.ranks() % NodesOf(spec) != 0) {
    return Bad("layout.nodes", absl::StrCat("a divisor of layout.ranks = ", l.ranks(), " (0 means 1)"),
               absl::StrCat(l.nodes()));
  }
  t.step.layout = {l.ranks(), l.batch()};
  PLATEAU_RETURN_IF_ERROR(ValidateLayout(t.step.model, t.step.layout));
  PLATEAU_RETURN_IF_ERROR(CheckSize(t.step.model, t.step.layout));
  PLATEAU_RETURN_IF_ERROR(ConvertProjection(spec.schedule(), t.step.model, &t.step.projection));
  PLATEAU_RETURN_IF_ERROR(ConvertCheckpoints(spec.schedule(), &t.step.checkpoints));
  PLATEAU_RETURN_IF_ERROR(ConvertDispatch(spec.schedule(), &t.step.dispatch));
  PLATEAU_RETURN_IF_ERROR(ConvertOptimizerPlacement(spec.schedule(), &t.step.optimizer_placement));
  if (!spec.has_optimizer()) return Bad("optimizer", "optimizer.lr at least", "none");
  PLATEAU_RETURN_IF_ERROR(ConvertOptimizer(spec.optimizer(), &t.step.optimizer));
  PLATEAU_RETURN_IF_ERROR(ConvertData(spec.data(), t.step.model, t.step.layout, &t.data));
  PLATEAU_RETURN_IF_ERROR(CheckRange("steps", spec.steps(), 1, kMaxSteps));
  t.steps = spec.steps();
  PLATEAU_RETURN_IF_ERROR(ConvertLrSchedule(spec.optimizer(), spec.steps(), &t.step.optimizer));
  t.reschedule_on_resume = spec.optimizer().reschedule_on_resume();
  const v1::CheckpointSpec& c = spec.checkpoint();
  if (!c.directory().empty()) PLATEAU_RETURN_IF_ERROR(CheckPath("checkpoint.directory", c.directory()));
  PLATEAU_RETURN_IF_ERROR(CheckRange("checkpoint.every", c.every(), 0, kMaxSteps));
  if (c.every() > 0 && c.directory().empty()) {
    return Bad("checkpoint.directory", "a directory when checkpoint.every is set", "none");
  }
  PLATEAU_RETURN_IF_ERROR(CheckRange("checkpoint.keep_last", c.keep_last(), 0, kMaxSteps));
  if (c.keep_last() > 0 && c.directory().empty()) {
    return Bad("checkpoint.directory", "a directory when checkpoint.keep_last is set", "none");
  }
  t.checkpoint_dir = c.directory();
  t.checkpoint_every = c.every();
  t.checkpoint_keep_last = c.keep_last();
  t.resume = true;  // a restarted attempt continues from the newest checkpoint
  if (spec.has_memory_timeline_every()) {
    PLATEAU_RETURN_IF_ERROR(CheckRange("memory_timeline_every", spec.memory_timeline_every(), 0, kMaxSteps));
    t.memory_timeline_every = spec.memory_timeline_every();
  }
  // The validation loss: its held-out sequences come in whole batches.
  PLATEAU_RETURN_IF_ERROR(CheckRange("data.held_out_sequences", spec.data().held_out_sequences(), 0, kMaxDim));
  PLATEAU_RETURN_IF_ERROR(CheckRange("validation_every", spec.validation_every(), 0, kMaxSteps));
  t.data.held_out = spec.data().held_out_sequences();
  t.validation_every = spec.validation_every();
  if (t.validation_every > 0 && (t.data.held_out < 1 || t.data.held_out % t.step.layout.batch != 0)) {
    return Bad("data.held_out_sequences",
               absl::StrCat("a positive multiple of layout.batch = ", t.step.layout.batch,
                            " when validation_every is set (every held-out sequence once, in whole batches)"),
               absl::StrCat(t.data.held_out));
  }
  PLATEAU_RETURN_IF_ERROR(CheckRange("max_restarts", spec.max_restarts(), 0, 100));
  // Up to a week: a step that long is a hang by any measure.
  PLATEAU_RETURN_IF_ERROR(CheckRange("progress_timeout_s", spec.progress_timeout_s(), 0, 7 * 24 * 3600));
  // Up to a week: a worker expected to come (hardware being repaired) is
  // waited for that long at most; 0 is the coordinator's default.
  PLATEAU_RETURN_IF_ERROR(CheckRange("max_pending_s", spec.max_pending_s(), 0, 7 * 24 * 3600));
  // The service's fields (labels, queue, limit) are checked here with the
  // rest, so that SubmitJob, PlanJob and this validator agree on a spec.
  PLATEAU_RETURN_IF_ERROR(CheckLabels(spec.labels()));
  if (spec.priority() < -kMaxJobPriority || spec.priority() > kMaxJobPriority) {
    return Bad("priority", absl::StrCat("-", kMaxJobPriority, " to ", kMaxJobPriority, " (higher runs first; default 0)"),
               absl::StrCat(spec.priority()));
  }
  if (spec.max_duration_s() < 0 || spec.max_duration_s() > kMaxDurationS) {
    return Bad("max_duration_s", absl::StrCat("seconds from 0 (no wall-clock limit) to ", kMaxDurationS, " (a year)"),
               absl::StrCat(spec.max_duration_s()));
  }
  t.step.seed = spec.has_seed() ? spec.seed() : 1;
  PLATEAU_RETURN_IF_ERROR(ConvertPrecision(spec, &t.step.precision));
  PLATEAU_RETURN_IF_ERROR(
      ConvertBf16Attention(spec, t.step.model, &t.step.bf16_attention, &t.step.attention_wgmma));
  PLATEAU_RETURN_IF_ERROR(ToBackendOptions(spec).status());
  // The step's own checks on the whole combination (e.g. Ring-DTP needs a
  // vocabulary shard per rank), so that the service and the step agree.
  PLATEAU_RETURN_IF_ERROR(PlanMemory(t.step).status());
  return t;
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  PLATEAU_ASSIGN_OR_RETURN(TrainerOptions t, ToTrainerOptions(spec));
  return CheckPrecisionRuns(t.step);
}

absl::Status ValidateNewJobSpec(const v1::JobSpec& spec) {
  // A steps out of range is ToTrainerOptions' to name (AdmitJob's).
  if (spec.steps() < 1 || spec.steps() > kMaxSteps) return absl::OkStatus();
  LrSchedule s;
  s.warmup_steps = spec.optimizer().warmup_steps();
  s.total_steps = spec.steps();
  return ValidateNewWarmup(s, "optimizer");
}

v1::MemoryPlan PlanToProto(const v1::JobSpec& spec, const MemoryPlan& plan) {
  v1::MemoryPlan out;
  for (int i = 0; i < kNumLiveSets; ++i) {
    const std::string name(LiveSetName(static_cast<LiveSet>(i)));
    auto* ls = out.add_live_sets();
    ls->set_live_set(name);
    ls->set_bytes(plan.bytes[i]);
    auto* host = out.add_host_live_sets();
    host->set_live_set(name);
    host->set_bytes(plan.host_bytes[i]);
  }
  out.set_total_bytes(plan.total());
  out.set_launch_bytes(plan.launch_total());
  out.set_device_memory_bytes(spec.device_memory_bytes());
  out.set_host_total_bytes(plan.host_total());
  out.set_host_memory_bytes(spec.host_memory_bytes());
  const bool device_fits = spec.device_memory_bytes() == 0 || plan.total() <= spec.device_memory_bytes();
  const bool host_fits = spec.host_memory_bytes() == 0 || plan.host_total() <= spec.host_memory_bytes();
  out.set_fits(device_fits && host_fits);
  out.set_dispatch_balanced_bytes(plan.dispatch_balanced_bytes);
  const int64_t dispatch = plan.bytes[static_cast<int>(LiveSet::kDispatch)];
  out.add_notes(plan.dispatch_balanced_bytes == dispatch
                    ? absl::StrCat("dispatch: ", plan.dispatch_note)
                    : absl::StrCat("dispatch: ", plan.dispatch_note, "; ", Bytes(plan.dispatch_balanced_bytes),
                                   " when every rank receives its N*k rows"));
  if (spec.device_memory_bytes() == 0) {
    out.add_notes("device_memory_bytes 0: checked against the worker's device when scheduled");
  }
  if (spec.host_memory_bytes() == 0 && plan.host_total() > 0) {
    out.add_notes("host_memory_bytes 0: the host plan is checked against the worker's host memory when scheduled");
  }
  return out;
}

absl::StatusOr<v1::MemoryPlan> PlanJob(const v1::JobSpec& spec, const AutoContext& auto_context,
                                       const std::function<absl::Status()>& still_wanted) {
  PLATEAU_ASSIGN_OR_RETURN(TrainerOptions t, ToTrainerOptions(spec));
  // The `auto` settings first: everything below is planned at their values.
  v1::MemoryPlan chosen;
  Calibration calibration;
  PLATEAU_RETURN_IF_ERROR(ChooseSpecAutoSettings(spec, auto_context, &t.step, &chosen, &calibration));
  PLATEAU_ASSIGN_OR_RETURN(MemoryPlan plan, PlanMemory(t.step));
  v1::MemoryPlan out = PlanToProto(spec, plan);
  out.MergeFrom(chosen);
  out.set_tokens_per_rank(TokensPerRank(t.step.model, t.step.layout));
  out.set_parameters(ParameterCount(t.step.model));
  out.set_active_parameters(ActiveParameterCount(t.step.model));
  out.set_model_flops_per_step(ModelFlopsPerStep(t.step.model, t.step.layout.batch));
  if (t.step.precision == Precision::kBf16Mixed) {
    out.add_notes("precision bf16: planned with bf16 working weights and activations, fp32 master and moments");
    out.add_notes(absl::StrCat("bf16 attention: ", AttentionArithmeticNote(spec, t.step)));
  }
  if (t.step.checkpoints.keep_attention) {
    // What the checkpoints live set holds beside the boundaries.
    const ScoPools pools = CheckpointPools(t.step);
    out.add_notes(absl::StrCat("keep_attention: ", pools.records.boundaries, " attention records (each layer's output ",
                               "and log-sum-exp, fp32) of ", Bytes(pools.records.boundary_bytes), " in checkpoints",
                               t.step.checkpoints.kind == CheckpointOptions::Kind::kSco
                                   ? absl::StrCat(", ", pools.records.host_boundaries, " of them in SCO's host pool")
                                   : std::string(", on the device"),
                               "; the backward's recompute skips attention's forward"));
  }
  if (!t.checkpoint_dir.empty()) {
    // Plain heap between steps, beside the live sets (kernels/budget/budget.h).
    const ParamLayout layout = LayoutOf(t.step);
    out.add_notes(absl::StrCat("checkpoint: streamed; between steps rank 0 holds ",
                               Bytes(StreamStateHostBytes(t.step, layout, /*with_sink=*/true)),
                               " of host heap beside the plan (its optimizer shard and one gathered chunk), "
                               "the other ranks ", Bytes(StreamStateHostBytes(t.step, layout, false)),
                               "; a resume ", Bytes(LoadStreamedStateHostBytes(layout)), " on each rank"));
    // And on rank 0's disk: a file is 12 bytes a parameter (the fp32 weight,
    // m and v, whole whatever P) and a JSON header, about 100 bytes a tensor
    // (docs/MODEL.md "Checkpoints"). A save writes the new file before it
    // removes any old one, so keep_last K holds K + 1 at once. The total in
    // double: steps up to 2^40 saved every step times a large file is past
    // int64.
    int64_t file_bytes = 0;
    for (const WeightSpec& w : layout.weights()) file_bytes += 3 * static_cast<int64_t>(sizeof(float)) * w.numel();
    const int64_t every = t.checkpoint_every, keep = t.checkpoint_keep_last;
    const int64_t written = every > 0 ? t.steps / every + (t.steps % every != 0 ? 1 : 0) : 1;
    const int64_t at_once = keep > 0 ? std::min(written, keep + 1) : written;
    const double total = static_cast<double>(at_once) * static_cast<double>(file_bytes);
    out.add_notes(absl::StrCat(
        "checkpoint disk: each file ", Bytes(file_bytes), " of tensors (12 bytes a parameter) and a header of ~",
        100 * 3 * static_cast<int64_t>(layout.weights().size()), " bytes; a run from the start writes ", written,
        keep > 0 ? absl::StrCat(", at most ", at_once, " at once (keep_last ", keep, ")")
                 : std::string(", keeping every one (keep_last 0)"),
        ": ~",
        total < 9e18 ? Bytes(static_cast<int64_t>(total))
                     : absl::StrFormat("%.3g bytes (%.3g GiB)", total, total / 1073741824.0),
        " in ", t.checkpoint_dir));
  }
  // N_max against the device cap (and the host cap, when set). Without a
  // device cap the device is the worker's, unknown until scheduled.
  if (spec.device_memory_bytes() == 0) {
    out.add_notes("n_max: device_memory_bytes 0: no device cap to solve the largest batch and context against");
    return out;
  }
  // The `auto` settings are chosen again at each N the search plans (on the
  // same curve): a larger N may fit with smaller settings than the spec's N
  // chose (kernels/budget/auto_settings.h SolveNMaxAuto).
  const FitCaps caps{spec.device_memory_bytes(), spec.host_memory_bytes()};
  const AutoRequest request = AutoRequestOf(spec);
  // The searches plan up to fourteen axes (N_max's two, and each what-if
  // row's two) of dozens of shapes each: where a plan's time goes, so
  // where a caller gone stops it.
  const NMaxLimits limits = SpecLimits(still_wanted);
  PLATEAU_ASSIGN_OR_RETURN(NMax n_max, request.any() ? SolveNMaxAuto(t.step, request, calibration, caps, limits)
                                                     : SolveNMax(t.step, caps, limits));
  NMaxToProto(n_max, out.mutable_n_max());
  PLATEAU_ASSIGN_OR_RETURN(std::vector<WhatIfRow> rows, request.any()
                                                            ? WhatIfNMaxAuto(t.step, request, calibration, caps, limits)
                                                            : WhatIfNMax(t.step, caps, limits));
  for (const WhatIfRow& r : rows) {
    v1::WhatIfRow* row = out.add_what_if();
    row->set_schedules(r.schedules);
    for (const std::string& s : r.settings) row->add_settings(s);
    NMaxToProto(r.n_max, row->mutable_n_max());
  }
  return out;
}

absl::StatusOr<v1::MemoryPlan> AdmitPlan(const v1::JobSpec& spec, v1::MemoryPlan plan) {
  // Every host live set is launch-sized: a host plan over the cap is what
  // TrainingStep::Create refuses on every rank, so force_launch cannot help.
  const int64_t host_cap = spec.host_memory_bytes();
  if (host_cap > 0 && plan.host_total_bytes() > host_cap) {
    std::vector<std::string> host;
    for (const v1::LiveSetBytes& ls : plan.host_live_sets()) {
      if (ls.bytes() != 0) host.push_back(absl::StrCat(ls.live_set(), "=", ls.bytes()));
    }
    return DoesNotFitError("host_memory_bytes", absl::StrCat(
        "host_memory_bytes: the host plan does not fit: ", Bytes(plan.host_total_bytes()), " per rank (",
        absl::StrJoin(host, ", "), ") against a cap of ", Bytes(host_cap), "; short by ",
        Bytes(plan.host_total_bytes() - host_cap),
        ". Every host live set is allocated when the step starts, so force_launch does not apply (each rank "
        "would refuse the job at start); raise host_memory_bytes (0: the node's host memory) or lower the "
        "schedules' host budgets"));
  }
  const int64_t cap = spec.device_memory_bytes();
  if (cap == 0 || plan.total_bytes() <= cap) return plan;
  // The budget says what is launch-sized (launch_bytes): all but a dispatch
  // that follows the routing.
  const int64_t launch = plan.launch_bytes();
  const bool routing_dispatch = launch < plan.total_bytes();
  std::vector<std::string> all, launch_sized;
  for (const v1::LiveSetBytes& ls : plan.live_sets()) {
    if (ls.bytes() == 0) continue;
    all.push_back(absl::StrCat(ls.live_set(), "=", ls.bytes()));
    if (!(routing_dispatch && ls.live_set() == "dispatch")) launch_sized.push_back(all.back());
  }
  if (launch > cap) {
    return DoesNotFitError("device_memory_bytes", absl::StrCat(
        "device_memory_bytes: ", Bytes(cap), " per rank cannot hold the step's launch-sized state of ",
        Bytes(launch), " (", absl::StrJoin(launch_sized, ", "), "); short by ", Bytes(launch - cap)));
  }
  if (!spec.force_launch()) {
    return DoesNotFitError("device_memory_bytes", absl::StrCat(
        "device_memory_bytes: the plan does not fit: ", Bytes(plan.total_bytes()), " per rank (",
        absl::StrJoin(all, ", "), ") against a cap of ", Bytes(cap), "; short by ",
        Bytes(plan.total_bytes() - cap),
        ". Raise device_memory_bytes, or set force_launch: true to run anyway (the step fails with "
        "OUT_OF_MEMORY if routing reaches the planned worst case)"));
  }
  plan.add_notes(absl::StrCat("force_launch: the plan (", Bytes(plan.total_bytes()),
                              ") does not fit the cap of ", Bytes(cap),
                              "; launched anyway, the step fails with OUT_OF_MEMORY if it needs more"));
  return plan;
}

absl::StatusOr<v1::MemoryPlan> AdmitJob(const v1::JobSpec& spec, const AutoContext& auto_context,
                                        const std::function<absl::Status()>& still_wanted) {
  PLATEAU_ASSIGN_OR_RETURN(v1::MemoryPlan plan, PlanJob(spec, auto_context, still_wanted));
  if (spec.precision() == v1::PRECISION_BF16) {
    PLATEAU_ASSIGN_OR_RETURN(TrainerOptions t, ToTrainerOptions(spec));
    PLATEAU_RETURN_IF_ERROR(CheckPrecisionRuns(t.step));
  }
  // `auto` settings of which no value fits the spec's own cap: refused
  // with the chooser's reason (the cap, the plan at the smallest settings,
  // its largest live set), unless force_launch leaves the decision to
  // AdmitPlan. Against a worker's memory (the spec's cap 0) it is that
  // worker's misfit, which placement handles (another worker may fit).
  if (plan.has_auto_nothing_fits() && !plan.auto_nothing_fits().cap_of_the_worker() && !spec.force_launch()) {
    return DoesNotFitError(plan.auto_nothing_fits().cap(), plan.auto_nothing_fits().reason());
  }
  return AdmitPlan(spec, std::move(plan));
}

absl::StatusOr<v1::MemoryPlan> PlanAtEarlierAutoSettings(const v1::JobSpec& spec, const v1::MemoryPlan& earlier,
                                                         const AutoContext& context) {
  PLATEAU_ASSIGN_OR_RETURN(const v1::JobSpec resolved, ResolvedSpec(spec, earlier));
  // Against the spec's own caps, as a choice's plan is (the values were
  // chosen to fit those, which have not changed).
  PLATEAU_ASSIGN_OR_RETURN(v1::MemoryPlan plan, AdmitJob(resolved));
  // Against the workers' memory where the spec leaves a cap to them, by the
  // chooser's rule (kernels/budget/n_max.h Fits: each whole plan within its
  // cap), which force_launch does not relax.
  if (spec.device_memory_bytes() == 0 && context.device_memory_bytes > 0 &&
      plan.total_bytes() > context.device_memory_bytes) {
    return DoesNotFitError("device_memory_bytes",
                           absl::StrCat("device_memory_bytes: at those values the plan is ", Bytes(plan.total_bytes()),
                                        " per rank, over the workers' ", Bytes(context.device_memory_bytes)));
  }
  if (spec.host_memory_bytes() == 0 && context.host_memory_bytes > 0 &&
      plan.host_total_bytes() > context.host_memory_bytes) {
    return DoesNotFitError("host_memory_bytes", absl::StrCat("host_memory_bytes: at those values the host plan is ",
                                                             Bytes(plan.host_total_bytes()), " per rank, over the ",
                                                             Bytes(context.host_memory_bytes), " of the workers"));
  }
  *plan.mutable_auto_settings() = earlier.auto_settings();
  plan.set_calibration(earlier.calibration());
  plan.add_notes(absl::StrCat("auto: ", earlier.auto_settings_size(),
                              " setting(s) kept from the earlier attempt (they fit here), so that the resumed run is "
                              "bitwise the uninterrupted one; chosen on ",
                              earlier.calibration()));
  return plan;
}

absl::Status AutoFitsOnWorker(const v1::JobSpec& spec, const v1::WorkerCapabilities& worker, int64_t per_node) {
  const AutoRequest request = AutoRequestOf(spec);
  if (!request.any()) return absl::OkStatus();
  PLATEAU_ASSIGN_OR_RETURN(TrainerOptions t, ToTrainerOptions(spec));
  // Any curve: the fit is the caps' alone.
  const Calibration any = DefaultCalibration(CalibrationBackend::kCpu);
  FitCaps caps{spec.device_memory_bytes(), spec.host_memory_bytes()};
  // Nothing fits the spec's own caps: admission's decision (force_launch
  // admits it at the smallest settings), the same on every worker, so not
  // this worker's misfit.
  if (ChooseAutoSettings(t.step, request, any, caps).status().code() == absl::StatusCode::kResourceExhausted) {
    return absl::OkStatus();
  }
  if (caps.device_bytes == 0) caps.device_bytes = worker.device_memory_bytes();
  if (caps.host_bytes == 0) caps.host_bytes = worker.host_memory_bytes() / std::max<int64_t>(1, per_node);
  return ChooseAutoSettings(t.step, request, any, caps).status();
}

absl::StatusOr<AutoContext> PlacementAutoContext(
    const v1::JobSpec& spec, const std::vector<std::pair<std::string, v1::WorkerCapabilities>>& workers) {
  AutoContext context;
  const int64_t per_node = spec.layout().ranks() / std::max<int64_t>(1, NodesOf(spec));
  for (const auto& [id, caps] : workers) {
    const int64_t host = caps.host_memory_bytes() / std::max<int64_t>(1, per_node);
    if (caps.device_memory_bytes() > 0 &&
        (context.device_memory_bytes == 0 || caps.device_memory_bytes() < context.device_memory_bytes)) {
      context.device_memory_bytes = caps.device_memory_bytes();
    }
    if (host > 0 && (context.host_memory_bytes == 0 || host < context.host_memory_bytes)) {
      context.host_memory_bytes = host;
    }
  }
  PLATEAU_ASSIGN_OR_RETURN(TrainerOptions t, ToTrainerOptions(spec));
  const AutoRequest request = AutoRequestOf(spec);
  FitCaps caps{spec.device_memory_bytes(), spec.host_memory_bytes()};
  if (caps.device_bytes == 0) caps.device_bytes = context.device_memory_bytes;
  if (caps.host_bytes == 0) caps.host_bytes = context.host_memory_bytes;
  // The slowest calibration by the modelled step of its own choice.
  const std::pair<std::string, v1::WorkerCapabilities>* slowest = nullptr;
  double slowest_seconds = -1;
  std::vector<std::string> compared;
  for (const auto& w : workers) {
    if (!w.second.has_calibration()) continue;
    PLATEAU_ASSIGN_OR_RETURN(const Calibration c, CalibrationFromProto(w.second.calibration()));
    absl::StatusOr<AutoChoice> choice = ChooseAutoSettings(t.step, request, c, caps);
    // Nothing fits (RESOURCE_EXHAUSTED) is the same on every curve: PlanJob
    // says so whichever is taken.
    const double seconds = choice.ok() ? choice->seconds : 0;
    if (!choice.ok() && choice.status().code() != absl::StatusCode::kResourceExhausted) return choice.status();
    compared.push_back(absl::StrFormat("%s %.3g ms", w.first, seconds * 1e3));
    if (seconds > slowest_seconds) {
      slowest = &w;
      slowest_seconds = seconds;
    }
  }
  if (slowest == nullptr) return context;
  context.calibration = slowest->second.calibration();
  context.worker = slowest->second.name().empty() ? slowest->first
                                                  : absl::StrCat(slowest->first, " (", slowest->second.name(), ")");
  if (compared.size() > 1) {
    absl::StrAppend(&context.worker, ", the slowest of the job's workers by the modelled step (",
                    absl::StrJoin(compared, ", "), ")");
  }
  return context;
}

v1::JobSpec DemoJobSpec(int ranks, int64_t steps) {
  const TrainerOptions o = RecallDemoJob(ranks);
  v1::JobSpec s;
  s.set_name("recall-demo");
  const ModelConfig& m = o.step.model;
  v1::ModelSpec* ms = s.mutable_model();
  ms->set_vocab_size(m.vocab_size);
  ms->set_hidden(m.hidden);
  ms->set_layers(m.layers);
  ms->set_heads(m.heads);
  ms->set_kv_heads(m.kv_heads);
  ms->set_experts(m.experts);
  ms->set_top_k(m.top_k);
  ms->set_expert_ffn(m.expert_ffn);
  ms->set_seq_len(m.seq_len);
  s.mutable_layout()->set_ranks(ranks);
  s.mutable_layout()->set_nodes(1);
  s.mutable_layout()->set_batch(o.step.layout.batch);
  v1::PipelinedLlepDispatch* d = s.mutable_schedule()->mutable_pipelined_llep();
  d->set_chunk_tokens(o.step.dispatch.pipelined.chunk_tokens);
  d->set_min_piece(o.step.dispatch.pipelined.balance.min_piece);
  s.mutable_schedule()->mutable_dense();
  s.mutable_schedule()->mutable_sco()->set_host_budget_bytes(o.step.checkpoints.host_budget_bytes);
  v1::OffloadStreamAdamW* opt = s.mutable_schedule()->mutable_offload_stream_adamw();
  // The demo's `auto` setting: the bucket is chosen when the job is planned
  // (RecallDemoJob's fixed 16384 is not used here).
  opt->set_bucket_params_auto(true);
  opt->set_staging_slots(static_cast<int32_t>(o.step.optimizer_placement.staging_slots));
  s.mutable_optimizer()->set_lr(o.step.optimizer.lr);
  v1::RecallData* r = s.mutable_data()->mutable_recall();
  r->set_num_keys(o.data.recall.num_keys);
  r->set_num_values(o.data.recall.num_values);
  r->set_pairs(o.data.recall.pairs);
  r->set_queries(o.data.recall.queries);
  s.set_steps(steps);
  s.set_backend(v1::BACKEND_CPU);
  s.set_device_memory_bytes(int64_t{256} << 20);
  return s;
}

}  // namespace plateau
