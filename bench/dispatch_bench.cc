// PipelinedLLEP against its baselines, LLEP and standard EP (issue 12;
// DESIGN.md §1.1; the paper's §3.1, Table 6 and App. B.3), in one run, on the
// same inputs for every schedule: P rank threads, each with its own backend
// (on the CPU: a capped device arena) and a Gloo communicator over loopback.
//
// For each routing profile of the skew sweep:
//  1. Agreement and peaks: each schedule alone runs one Forward and one
//     Backward from zeroed outputs; the kDispatch peak of each phase (peaks
//     reset between them; PipelinedLLEP's launch-sized slots are held from
//     Create, so they count), max over ranks; the outputs and gradients
//     compared elementwise with LLEP's.
//  2. Time: Forward alone and Forward + Backward of every schedule (and
//     PipelinedLLEP's ForwardForBackward + Backward, what the step's
//     recompute and backward run),
//     interleaved rep by rep (the order rotating) after a warm-up, so each
//     sees the same machine; a rep's time is the slowest rank's, and the
//     figure is the median over reps. Ratios are LLEP's time over the
//     schedule's (above 1: faster than LLEP) and the schedule's peak over
//     LLEP's.
//  3. Received rows per chunk as a fraction of Eq. 1's P c k, with strided
//     and contiguous chunk membership.
//  4. At a tiny N: K = 1 (derived from the token budget, c >= N) against a
//     fixed K (c = ceil(N / K)), forward only.
// Then: forward time and peak against c on one profile, and which schedules
// complete one Forward + Backward under a fixed device cap (an out-of-memory
// is reported per profile, not a crash); and beside the times, what the
// backend adds to them: LLEP's per-call allocation (its buffer list
// allocated and first written, against written again) and the cost of one
// more chunk (from the tiny-N pair). Ends with one JSON line.
//
//   bazel run -c opt //bench:dispatch_bench
//   bazel run -c opt --config=cuda //bench:dispatch_bench -- --backend=cuda --ranks=1   # one GPU
//
// The defaults (E = 32, k = 4, H = F = 96, N = 16,384 = the paper's 65,536 /
// 4, c = ceil(N / 12), min_piece = 256) take a few minutes on 2 cores; the
// shape flags (--tokens, --hidden, --ffn, --experts, --top_k, --ranks,
// --chunk_tokens, --min_piece) scale it up on a larger machine. OpenBLAS runs
// one thread per rank (--blas_threads): P rank threads share the cores.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/dispatch/expert_dispatch.h"
#include "kernels/dispatch/llep.h"
#include "kernels/dispatch/llep_plan.h"
#include "kernels/dispatch/pipelined_llep.h"
#include "kernels/dispatch/routing_profiles.h"
#include "kernels/dispatch/standard_ep.h"
#include "kernels/dispatch/standard_ep_plan.h"
#include "kernels/kv_store.h"
#include "kernels/memory.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"
#include "kernels/model/step_options.h"
#include "kernels/status_macros.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

using bench::Median;
using bench::NowSeconds;

// ---------------------------------------------------------------------------
// Flags.

std::map<std::string, int64_t> flags = {
    {"ranks", 4},          // P
    {"experts", 32},       // E
    {"top_k", 4},          // k
    {"hidden", 96},        // H
    {"ffn", 96},           // F
    {"tokens", 16384},     // N per rank (the paper's 65,536 / 4)
    {"chunk_tokens", 0},   // c; 0: ceil(N / 12)
    {"min_piece", 256},    // LLEP's and PipelinedLLEP's smallest moved piece
    {"max_borrowed", 0},   // LLEP's and PipelinedLLEP's cap on borrowed experts; 0: none
    {"reps", 5},           // timed reps per schedule and phase
    {"warmup", 1},         // untimed reps before them
    {"cap_mb", 0},         // device cap of the out-of-memory test; 0: see CapBytes
    {"device_mb", 16384},  // device arena of the other runs (allocated on use)
    {"tiny_tokens", 128},  // N of the K = 1 against fixed-K test
    {"tiny_chunks", 10},   // the fixed K
    {"tiny_reps", 20},
    {"blas_threads", 1},   // OpenBLAS threads (process-wide): P rank threads share the cores
    {"timeout_s", 60},     // every collective's timeout
    {"seed", 1},
};
std::map<std::string, std::string> string_flags = {
    // 50%/4@4: 50%/4 with the hot tokens in 4 contiguous runs, where strided
    // and contiguous chunks differ.
    {"profiles", "balanced,50%/4,80%/16,80%/4,100%/1,50%/4@4"},
    {"curve", "auto"},             // c values of the curve; auto: N, N/4, N/8, ceil(N/10), N/16, N/32
    {"curve_profile", "80%/16"},   // the profile of the curve ("none" skips it)
    {"backend", "cpu"},            // cuda: every rank on a GPU of its own (--ranks GPUs)
};

int64_t F(const char* name) { return flags.at(name); }
constexpr double kAlpha = 1.1;  // LLEP's capacity factor (its default)
constexpr double kMiB = 1048576.0;

// "balanced", "h%/g" or "h%/g@b" (the hot tokens in b contiguous runs).
absl::StatusOr<RoutingProfile> ParseProfile(absl::string_view text) {
  if (text == "balanced") return BalancedRouting();
  std::vector<std::string> parts = absl::StrSplit(text, absl::ByAnyChar("%/@"), absl::SkipEmpty());
  double h = 0;
  int64_t g = 0, b = 0;
  const bool blocks = absl::StrContains(text, "@");
  if (parts.size() != (blocks ? 3u : 2u) || !absl::SimpleAtod(parts[0], &h) ||
      !absl::SimpleAtoi(parts[1], &g) || (blocks && !absl::SimpleAtoi(parts[2], &b))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--profiles: '", text, "' is neither 'balanced', 'h%/g' (e.g. 50%/4) nor 'h%/g@b' (e.g. "
        "50%/4@4: the hot tokens in 4 contiguous runs)"));
  }
  return HotBlockRouting(h, g, b);
}

// ---------------------------------------------------------------------------
// The shape and the schedules.

struct Shape {
  ModelConfig m;
  int P = 4;
  int64_t N = 0;  // tokens per rank
  int64_t c = 0;  // PipelinedLLEP's chunk_tokens
  LlepOptions balance;
};

enum Sched { kStd = 0, kLlep, kPipe, kPipeContig, kNumSched };
const char* const kSchedName[kNumSched] = {"standard EP", "LLEP", "PipelinedLLEP",
                                           "PipelinedLLEP contiguous"};
const char* const kSchedKey[kNumSched] = {"standard_ep", "llep", "pipelined_llep",
                                          "pipelined_llep_contiguous"};

PipelinedLlepOptions PipeOptions(const Shape& s, int64_t c, ChunkMembership membership) {
  PipelinedLlepOptions o;
  o.chunk_tokens = c;
  o.membership = membership;
  o.balance = s.balance;
  return o;
}

struct RankContext {
  Backend& be;
  Communicator& world;
  ModelKernels& kernels;
  Stream& compute;
  Stream& comm;
};

absl::StatusOr<std::unique_ptr<ExpertDispatch>> MakeSched(Sched which, const Shape& s, int64_t c,
                                                          int64_t max_tokens, RankContext& x) {
  switch (which) {
    case kStd:
      return std::unique_ptr<ExpertDispatch>(
          new StandardEp(s.m, x.be, x.kernels, x.world, x.compute, x.comm));
    case kLlep: {
      PLATEAU_ASSIGN_OR_RETURN(auto d,
                               Llep::Create(s.m, s.balance, x.be, x.kernels, x.world, x.compute, x.comm));
      return std::unique_ptr<ExpertDispatch>(std::move(d));
    }
    case kPipe:
    case kPipeContig: {
      const ChunkMembership mb =
          which == kPipe ? ChunkMembership::kStrided : ChunkMembership::kContiguous;
      PLATEAU_ASSIGN_OR_RETURN(auto d, PipelinedLlep::Create(s.m, PipeOptions(s, c, mb), max_tokens,
                                                             x.be, x.kernels, x.world, x.compute,
                                                             x.comm));
      return std::unique_ptr<ExpertDispatch>(std::move(d));
    }
    default:
      return absl::InternalError("no such schedule");
  }
}

// ---------------------------------------------------------------------------
// One rank's inputs: the same on every schedule, from (seed, rank, profile).

// Everything MakeInputs allocates on the device (for the cap).
int64_t InputBytes(const Shape& s, int64_t n) {
  const int64_t H = s.m.hidden, Fd = s.m.expert_ffn, K = s.m.top_k, Ep = s.m.experts / s.P;
  return 4 * (4 * n * H + 3 * n * K + 6 * Ep * H * Fd);
}

struct Inputs {
  int64_t n = 0;
  Buffer u, chosen, gates, dout, out, du, dgates, wg, wu, wd, gg, gu, gd;
  ExpertWeights w() const { return {wg.as<float>(), wu.as<float>(), wd.as<float>()}; }
  ExpertGrads g() { return {gg.as<float>(), gu.as<float>(), gd.as<float>()}; }
};

uint64_t Mix(uint64_t a, uint64_t b, uint64_t c) {
  return a * 0x9E3779B97F4A7C15ull ^ (b + 1) * 0xBF58476D1CE4E5B9ull ^ (c + 7) * 0x94D049BB133111EBull;
}

template <typename T>
absl::StatusOr<Buffer> Upload(RankContext& x, LiveSet set, const std::vector<T>& host) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer b, x.be.device().Allocate(set, host.size() * sizeof(T)));
  if (!host.empty()) {
    // From the caller's memory: complete when Copy returns (backend.h).
    PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.compute, b.data(), host.data(), b.bytes()));
  }
  return b;
}

absl::Status SetZero(RankContext& x, Buffer& b) {
  if (b.bytes() == 0) return absl::OkStatus();
  std::vector<char> zeros(b.bytes(), 0);
  return x.be.Copy(x.compute, b.data(), zeros.data(), b.bytes());
}

absl::StatusOr<Inputs> MakeInputs(RankContext& x, const Shape& s, int rank, int64_t n,
                                  const RoutingProfile& profile, uint64_t seed) {
  const int64_t H = s.m.hidden, Fd = s.m.expert_ffn, K = s.m.top_k, Ep = s.m.experts / s.P;
  Inputs in;
  in.n = n;
  PLATEAU_ASSIGN_OR_RETURN(Routes r, MakeRoutes(profile, s.m.experts, K, n, seed, rank));
  std::vector<float> v(n * H);
  bench::FillRandom(v, Mix(seed, rank, 1));
  PLATEAU_ASSIGN_OR_RETURN(in.u, Upload(x, LiveSet::kActivations, v));
  bench::FillRandom(v, Mix(seed, rank, 2));
  PLATEAU_ASSIGN_OR_RETURN(in.dout, Upload(x, LiveSet::kActivations, v));
  std::fill(v.begin(), v.end(), 0.0f);
  PLATEAU_ASSIGN_OR_RETURN(in.out, Upload(x, LiveSet::kActivations, v));
  PLATEAU_ASSIGN_OR_RETURN(in.du, Upload(x, LiveSet::kActivations, v));
  PLATEAU_ASSIGN_OR_RETURN(in.chosen, Upload(x, LiveSet::kActivations, r.chosen));
  PLATEAU_ASSIGN_OR_RETURN(in.gates, Upload(x, LiveSet::kActivations, r.gates));
  PLATEAU_ASSIGN_OR_RETURN(in.dgates,
                           Upload(x, LiveSet::kActivations, std::vector<float>(n * K, 0.0f)));
  // Expert e's weights depend on e alone, so rank p's slice [p Ep, (p+1) Ep)
  // is the same whatever P is. Scaled so that the outputs stay O(1).
  const int64_t mat = H * Fd;
  std::vector<float> wg(Ep * mat), wu(Ep * mat), wd(Ep * mat), one(mat);
  for (int64_t le = 0; le < Ep; ++le) {
    const uint64_t e = rank * Ep + le;
    const float sh = 1.0f / std::sqrt(static_cast<float>(H)),
                sf = 1.0f / std::sqrt(static_cast<float>(Fd));
    bench::FillRandom(one, Mix(seed, 1000 + e, 3));
    for (int64_t i = 0; i < mat; ++i) wg[le * mat + i] = one[i] * sh;
    bench::FillRandom(one, Mix(seed, 1000 + e, 4));
    for (int64_t i = 0; i < mat; ++i) wu[le * mat + i] = one[i] * sh;
    bench::FillRandom(one, Mix(seed, 1000 + e, 5));
    for (int64_t i = 0; i < mat; ++i) wd[le * mat + i] = one[i] * sf;
  }
  PLATEAU_ASSIGN_OR_RETURN(in.wg, Upload(x, LiveSet::kWeights, wg));
  PLATEAU_ASSIGN_OR_RETURN(in.wu, Upload(x, LiveSet::kWeights, wu));
  PLATEAU_ASSIGN_OR_RETURN(in.wd, Upload(x, LiveSet::kWeights, wd));
  std::fill(wg.begin(), wg.end(), 0.0f);
  PLATEAU_ASSIGN_OR_RETURN(in.gg, Upload(x, LiveSet::kGrads, wg));
  PLATEAU_ASSIGN_OR_RETURN(in.gu, Upload(x, LiveSet::kGrads, wg));
  PLATEAU_ASSIGN_OR_RETURN(in.gd, Upload(x, LiveSet::kGrads, wg));
  return in;
}

absl::Status Forward(ExpertDispatch& d, Inputs& in) {
  return d.Forward(in.u.as<float>(), in.chosen.as<int32_t>(), in.gates.as<float>(), in.n, in.w(),
                   in.out.as<float>());
}
absl::Status ForwardForBackward(ExpertDispatch& d, Inputs& in) {
  return d.ForwardForBackward(in.u.as<float>(), in.chosen.as<int32_t>(), in.gates.as<float>(),
                              in.n, in.w(), in.out.as<float>());
}
absl::Status Backward(ExpertDispatch& d, Inputs& in) {
  return d.Backward(in.dout.as<float>(), in.w(), in.du.as<float>(), in.dgates.as<float>(), in.g());
}

absl::Status Sync(RankContext& x) {
  PLATEAU_RETURN_IF_ERROR(x.compute.Synchronize());
  return x.comm.Synchronize();
}
absl::Status Barrier(RankContext& x) {
  PLATEAU_RETURN_IF_ERROR(x.world.Barrier(x.comm));
  return x.comm.Synchronize();
}

// ---------------------------------------------------------------------------
// A world of P rank threads (as kernels/testing/local_world.h, with the
// collectives' timeout a flag, and every rank's status kept: under a device
// cap one rank's out-of-memory makes its peers fail too, and the bench
// reports the rank that ran out).

absl::Status RunWorld(int P, int64_t device_bytes, const std::string& tag,
                      const std::function<absl::Status(int, RankContext&)>& fn,
                      std::vector<absl::Status>* statuses = nullptr) {
  auto store = FileStore::Create(FreshStoreDir(tag));
  if (!store.ok()) return store.status();
  std::shared_ptr<KeyValueStore> shared = std::move(*store);
  std::vector<absl::Status> status(P);
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> absl::Status {
        PLATEAU_ASSIGN_OR_RETURN(BackendKind kind, ParseBackendKind(string_flags["backend"]));
        BackendOptions bo = LocalWorldBackend(kind, device_bytes);
        if (kind == BackendKind::kCuda) bo.device_index = r;  // NCCL: one GPU per rank
        PLATEAU_ASSIGN_OR_RETURN(auto be, Backend::Create(bo));
        CommunicatorOptions co;
        co.backend = kind;
        co.device_index = bo.device_index;
        co.rank = r;
        co.size = P;
        co.store = shared;
        co.prefix = tag;
        co.timeout = absl::Seconds(F("timeout_s"));
        PLATEAU_ASSIGN_OR_RETURN(auto world, CreateCommunicator(co));
        PLATEAU_ASSIGN_OR_RETURN(auto compute, be->CreateStream("compute"));
        PLATEAU_ASSIGN_OR_RETURN(auto comm, be->CreateStream("comm"));
        PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(*be));
        RankContext x{*be, *world, *kernels, *compute, *comm};
        absl::Status s = fn(r, x);
        // Whatever failed, drain the streams before they and the buffers go.
        x.compute.Synchronize().IgnoreError();  // the error is s's or reported by s
        x.comm.Synchronize().IgnoreError();
        return s;
      }();
    });
  }
  for (auto& t : threads) t.join();
  if (statuses != nullptr) *statuses = status;
  for (int r = 0; r < P; ++r) {
    if (!status[r].ok()) {
      return absl::Status(status[r].code(), absl::StrCat("rank ", r, ": ", status[r].message()));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Results.

// Per rep, the slowest rank's seconds (filled by the rank threads).
struct RepTimes {
  // total: Forward + Backward. for_backward: ForwardForBackward + Backward,
  // what the step's recompute and backward run (PipelinedLLEP only; the
  // others' ForwardForBackward is their Forward).
  std::vector<double> fwd, total, for_backward;
  void Resize(int reps) {
    fwd.assign(reps, 0.0);
    total.assign(reps, 0.0);
    for_backward.assign(reps, 0.0);
  }
};

struct SchedResult {
  int64_t peak_fwd = 0, peak_bwd = 0;  // kDispatch, max over ranks
  RepTimes times;
  int64_t peak() const { return std::max(peak_fwd, peak_bwd); }
  double fwd_s() const { return Median(times.fwd); }
  double total_s() const { return Median(times.total); }
  double for_backward_s() const { return Median(times.for_backward); }
};

// What a run gave back, per rank (for the agreement check).
struct Outputs {
  std::vector<float> out, du, dgates, dw;
};

struct Diff {
  double out = 0, out_scale = 0, du = 0, dgates = 0, dw = 0;  // max |a - b|; du.. relative
};

struct CurvePoint {
  int64_t c = 0, chunks = 0, bound = 0, peak = 0, rows_per_chunk = 0;
  RepTimes pipe, llep;  // forward only
};

struct TinyResult {
  int64_t c_budget = 0, c_fixed = 0, k_budget = 0, k_fixed = 0;
  RepTimes llep, budget, fixed;  // forward only
};

struct ProfileResult {
  std::string name;
  SchedResult s[kNumSched];
  Diff diff[kNumSched];  // against LLEP
  // Realized sizes, max over ranks (and chunks).
  int64_t std_rows = 0;
  int64_t llep_rows = 0, llep_borrowed = 0, llep_lent = 0;
  int64_t pipe_chunks = 0, pipe_rows = 0, pipe_borrowed = 0, pipe_lent = 0;
  int64_t contig_rows = 0;
  double others_pct = -1;
  // LLEP's buffer list at its realized sizes, allocated and written once
  // (what each LLEP call pays on this backend, where freed memory goes back
  // to the OS) against writing the same buffers again (no first touch).
  RepTimes llep_alloc;  // fwd: allocate + first write; total: second write
  std::vector<CurvePoint> curve;
  TinyResult tiny;
};

void UpdateMax(std::mutex& mu, int64_t* dst, int64_t v) {
  std::lock_guard<std::mutex> l(mu);
  *dst = std::max(*dst, v);
}

Diff Compare(const std::vector<Outputs>& a, const std::vector<Outputs>& b) {
  Diff d;
  double du_scale = 0, dg_scale = 0, dw_scale = 0;
  auto scan = [](const std::vector<float>& x, const std::vector<float>& y, double* diff,
                 double* scale) {
    if (x.size() != y.size()) {
      *diff = INFINITY;
      return;
    }
    for (size_t i = 0; i < x.size(); ++i) {
      *diff = std::max(*diff, std::fabs(static_cast<double>(x[i]) - y[i]));
      *scale = std::max(*scale, std::fabs(static_cast<double>(y[i])));
    }
  };
  for (size_t p = 0; p < a.size(); ++p) {
    scan(a[p].out, b[p].out, &d.out, &d.out_scale);
    scan(a[p].du, b[p].du, &d.du, &du_scale);
    scan(a[p].dgates, b[p].dgates, &d.dgates, &dg_scale);
    scan(a[p].dw, b[p].dw, &d.dw, &dw_scale);
  }
  d.du = du_scale > 0 ? d.du / du_scale : d.du;
  d.dgates = dg_scale > 0 ? d.dgates / dg_scale : d.dgates;
  d.dw = dw_scale > 0 ? d.dw / dw_scale : d.dw;
  return d;
}

std::vector<int64_t> CurveValues(const Shape& s) {
  std::vector<int64_t> cs;
  if (string_flags["curve"] == "auto") {
    cs = {s.N, s.N / 4, s.N / 8, (s.N + 9) / 10, s.N / 16, s.N / 32};
  } else {
    for (absl::string_view t : absl::StrSplit(string_flags["curve"], ',', absl::SkipEmpty())) {
      int64_t c = 0;
      if (absl::SimpleAtoi(t, &c)) cs.push_back(c);
    }
  }
  cs.erase(std::remove_if(cs.begin(), cs.end(), [](int64_t c) { return c < 1; }), cs.end());
  std::sort(cs.rbegin(), cs.rend());
  cs.erase(std::unique(cs.begin(), cs.end()), cs.end());
  return cs;
}

// ---------------------------------------------------------------------------
// One profile: agreement and peaks, time, the curve (on one profile), the
// tiny N; all in one world.

absl::StatusOr<ProfileResult> RunProfile(const Shape& s, const RoutingProfile& profile,
                                         bool with_curve, std::string* backend_text) {
  ProfileResult res;
  res.name = profile.Name();
  const int P = s.P, reps = static_cast<int>(F("reps")), warmup = static_cast<int>(F("warmup"));
  const uint64_t seed = static_cast<uint64_t>(F("seed"));
  for (auto& r : res.s) r.times.Resize(reps);
  res.llep_alloc.Resize(reps);
  std::vector<std::vector<Outputs>> outputs(kNumSched, std::vector<Outputs>(P));
  const std::vector<int64_t> curve = with_curve ? CurveValues(s) : std::vector<int64_t>{};
  res.curve.resize(curve.size());
  for (CurvePoint& c : res.curve) {
    c.pipe.Resize(reps);
    c.llep.Resize(reps);
  }
  const int64_t tiny = F("tiny_tokens"), tiny_reps = F("tiny_reps");
  res.tiny.c_budget = std::max(s.c, tiny);
  res.tiny.c_fixed = (tiny + F("tiny_chunks") - 1) / F("tiny_chunks");
  res.tiny.llep.Resize(tiny_reps);
  res.tiny.budget.Resize(tiny_reps);
  res.tiny.fixed.Resize(tiny_reps);
  std::mutex mu;
  auto record = [&](RepTimes& t, int rep, double fwd, double total) {
    std::lock_guard<std::mutex> l(mu);
    t.fwd[rep] = std::max(t.fwd[rep], fwd);
    t.total[rep] = std::max(t.total[rep], total);
  };

  bench::CpuMeter meter;
  absl::Status st = RunWorld(
      P, F("device_mb") << 20, "dispatch-bench", [&](int p, RankContext& x) -> absl::Status {
        if (p == 0 && backend_text != nullptr) *backend_text = x.be.Describe();
        MemoryTracker& tracker = x.be.device().tracker();
        PLATEAU_ASSIGN_OR_RETURN(Inputs in, MakeInputs(x, s, p, s.N, profile, seed));

        // 1. Agreement and peaks, one schedule at a time.
        for (int k = 0; k < kNumSched; ++k) {
          const Sched which = static_cast<Sched>(k);
          PLATEAU_ASSIGN_OR_RETURN(auto d, MakeSched(which, s, s.c, s.N, x));
          for (Buffer* b : {&in.out, &in.du, &in.dgates, &in.gg, &in.gu, &in.gd}) {
            PLATEAU_RETURN_IF_ERROR(SetZero(x, *b));
          }
          PLATEAU_RETURN_IF_ERROR(Barrier(x));
          tracker.ResetPeaks();
          PLATEAU_RETURN_IF_ERROR(Forward(*d, in));
          PLATEAU_RETURN_IF_ERROR(Sync(x));
          UpdateMax(mu, &res.s[k].peak_fwd, tracker.peak(LiveSet::kDispatch));
          tracker.ResetPeaks();
          PLATEAU_RETURN_IF_ERROR(Backward(*d, in));
          PLATEAU_RETURN_IF_ERROR(Sync(x));
          UpdateMax(mu, &res.s[k].peak_bwd, tracker.peak(LiveSet::kDispatch));
          if (which == kStd) {
            UpdateMax(mu, &res.std_rows, static_cast<StandardEp&>(*d).received_rows());
          } else if (which == kLlep) {
            const LlepChunkSizes& z = static_cast<Llep&>(*d).sizes();
            UpdateMax(mu, &res.llep_rows, z.rows);
            UpdateMax(mu, &res.llep_borrowed, z.borrowed);
            UpdateMax(mu, &res.llep_lent, z.lent);
          } else {
            const auto& pl = static_cast<PipelinedLlep&>(*d);
            const LlepChunkSizes& z = pl.max_chunk_sizes();
            if (which == kPipe) {
              UpdateMax(mu, &res.pipe_chunks, pl.chunks());
              UpdateMax(mu, &res.pipe_rows, z.rows);
              UpdateMax(mu, &res.pipe_borrowed, z.borrowed);
              UpdateMax(mu, &res.pipe_lent, z.lent);
            } else {
              UpdateMax(mu, &res.contig_rows, z.rows);
            }
          }
          Outputs& o = outputs[k][p];
          const int64_t H = s.m.hidden, K = s.m.top_k;
          o.out.resize(in.n * H);
          o.du.resize(in.n * H);
          o.dgates.resize(in.n * K);
          const int64_t mat = in.gg.bytes() / sizeof(float);
          o.dw.resize(3 * mat);
          PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.compute, o.out.data(), in.out.data(), in.out.bytes()));
          PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.compute, o.du.data(), in.du.data(), in.du.bytes()));
          PLATEAU_RETURN_IF_ERROR(
              x.be.Copy(x.compute, o.dgates.data(), in.dgates.data(), in.dgates.bytes()));
          PLATEAU_RETURN_IF_ERROR(x.be.Copy(x.compute, o.dw.data(), in.gg.data(), in.gg.bytes()));
          PLATEAU_RETURN_IF_ERROR(
              x.be.Copy(x.compute, o.dw.data() + mat, in.gu.data(), in.gu.bytes()));
          PLATEAU_RETURN_IF_ERROR(
              x.be.Copy(x.compute, o.dw.data() + 2 * mat, in.gd.data(), in.gd.bytes()));
        }

        // 2. Time, interleaved: all four schedules alive, the order rotating
        // rep by rep. (Outputs and gradients keep accumulating: the same
        // work every rep.)
        {
          std::vector<std::unique_ptr<ExpertDispatch>> d;
          for (int k = 0; k < kNumSched; ++k) {
            PLATEAU_ASSIGN_OR_RETURN(auto one, MakeSched(static_cast<Sched>(k), s, s.c, s.N, x));
            d.push_back(std::move(one));
          }
          for (int rep = 0; rep < warmup + reps; ++rep) {
            for (int i = 0; i < kNumSched; ++i) {
              const int k = (i + rep) % kNumSched;
              PLATEAU_RETURN_IF_ERROR(Barrier(x));
              double t0 = NowSeconds();
              PLATEAU_RETURN_IF_ERROR(Forward(*d[k], in));
              PLATEAU_RETURN_IF_ERROR(Sync(x));
              const double fwd = NowSeconds() - t0;
              d[k]->Release();
              double total = 0;
              if (k != kPipeContig) {  // forward only: membership changes no backward step
                PLATEAU_RETURN_IF_ERROR(Barrier(x));
                t0 = NowSeconds();
                PLATEAU_RETURN_IF_ERROR(Forward(*d[k], in));
                PLATEAU_RETURN_IF_ERROR(Backward(*d[k], in));
                PLATEAU_RETURN_IF_ERROR(Sync(x));
                total = NowSeconds() - t0;
              }
              if (k == kPipe) {
                PLATEAU_RETURN_IF_ERROR(Barrier(x));
                t0 = NowSeconds();
                PLATEAU_RETURN_IF_ERROR(ForwardForBackward(*d[k], in));
                PLATEAU_RETURN_IF_ERROR(Backward(*d[k], in));
                PLATEAU_RETURN_IF_ERROR(Sync(x));
                const double fb = NowSeconds() - t0;
                if (rep >= warmup) {
                  std::lock_guard<std::mutex> l(mu);
                  double& slot = res.s[k].times.for_backward[rep - warmup];
                  slot = std::max(slot, fb);
                }
              }
              if (rep >= warmup) record(res.s[k].times, rep - warmup, fwd, total);
            }
          }
        }

        // LLEP's per-call allocation on this backend, its own realized sizes.
        {
          PLATEAU_ASSIGN_OR_RETURN(auto llep, MakeSched(kLlep, s, 0, s.N, x));
          PLATEAU_RETURN_IF_ERROR(Forward(*llep, in));
          PLATEAU_RETURN_IF_ERROR(Sync(x));
          const std::vector<DispatchBufferSpec> specs =
              LlepBuffers(s.m, P, static_cast<Llep&>(*llep).sizes());
          llep.reset();
          for (int rep = 0; rep < reps; ++rep) {
            std::vector<Buffer> bufs;
            PLATEAU_RETURN_IF_ERROR(Barrier(x));
            double t0 = NowSeconds();
            for (const DispatchBufferSpec& b : specs) {
              PLATEAU_ASSIGN_OR_RETURN(Buffer one, x.be.device().Allocate(LiveSet::kDispatch, b.bytes));
              PLATEAU_RETURN_IF_ERROR(
                  x.be.Fill(x.compute, one.as<float>(), b.bytes / sizeof(float), 0.0f));
              bufs.push_back(std::move(one));
            }
            PLATEAU_RETURN_IF_ERROR(Sync(x));
            const double first = NowSeconds() - t0;
            PLATEAU_RETURN_IF_ERROR(Barrier(x));
            t0 = NowSeconds();
            for (Buffer& one : bufs) {
              PLATEAU_RETURN_IF_ERROR(
                  x.be.Fill(x.compute, one.as<float>(), one.bytes() / sizeof(float), 1.0f));
            }
            PLATEAU_RETURN_IF_ERROR(Sync(x));
            record(res.llep_alloc, rep, first, NowSeconds() - t0);
          }
        }

        // 3. Forward time and peak against c, beside LLEP's forward.
        if (!curve.empty()) {
          PLATEAU_ASSIGN_OR_RETURN(auto llep, MakeSched(kLlep, s, 0, s.N, x));
          for (size_t i = 0; i < curve.size(); ++i) {
            CurvePoint& cp = res.curve[i];
            // Its peak alone (LLEP holds nothing between calls): the
            // launch-sized slots from Create, then one Forward.
            PLATEAU_RETURN_IF_ERROR(Barrier(x));
            tracker.ResetPeaks();
            PLATEAU_ASSIGN_OR_RETURN(auto pipe, MakeSched(kPipe, s, curve[i], s.N, x));
            PLATEAU_RETURN_IF_ERROR(Forward(*pipe, in));
            PLATEAU_RETURN_IF_ERROR(Sync(x));
            UpdateMax(mu, &cp.peak, tracker.peak(LiveSet::kDispatch));
            {
              const auto& pl = static_cast<PipelinedLlep&>(*pipe);
              UpdateMax(mu, &cp.chunks, pl.chunks());
              UpdateMax(mu, &cp.rows_per_chunk, pl.max_chunk_sizes().rows);
            }
            pipe->Release();
            for (int rep = 0; rep < warmup + reps; ++rep) {
              for (int j = 0; j < 2; ++j) {
                const bool is_pipe = (j + rep) % 2 == 1;
                ExpertDispatch& d = is_pipe ? *pipe : *llep;
                PLATEAU_RETURN_IF_ERROR(Barrier(x));
                const double t0 = NowSeconds();
                PLATEAU_RETURN_IF_ERROR(Forward(d, in));
                PLATEAU_RETURN_IF_ERROR(Sync(x));
                const double fwd = NowSeconds() - t0;
                d.Release();
                if (rep >= warmup) record(is_pipe ? cp.pipe : cp.llep, rep - warmup, fwd, 0);
              }
            }
            if (p == 0) {
              cp.c = curve[i];
              cp.bound = PipelinedLlep::BoundBytes(s.m, P, s.N,
                                                   PipeOptions(s, curve[i], ChunkMembership::kStrided));
            }
          }
        }

        // 4. Tiny N: K = 1 from the budget against a fixed K, forward only.
        {
          PLATEAU_ASSIGN_OR_RETURN(Inputs t, MakeInputs(x, s, p, tiny, profile, seed + 1));
          PLATEAU_ASSIGN_OR_RETURN(auto llep, MakeSched(kLlep, s, 0, tiny, x));
          PLATEAU_ASSIGN_OR_RETURN(auto budget, MakeSched(kPipe, s, res.tiny.c_budget, tiny, x));
          PLATEAU_ASSIGN_OR_RETURN(auto fixed, MakeSched(kPipe, s, res.tiny.c_fixed, tiny, x));
          ExpertDispatch* d[3] = {llep.get(), budget.get(), fixed.get()};
          RepTimes* times[3] = {&res.tiny.llep, &res.tiny.budget, &res.tiny.fixed};
          const int tiny_warmup = 3;
          for (int rep = 0; rep < tiny_warmup + tiny_reps; ++rep) {
            for (int i = 0; i < 3; ++i) {
              const int k = (i + rep) % 3;
              PLATEAU_RETURN_IF_ERROR(Barrier(x));
              const double t0 = NowSeconds();
              PLATEAU_RETURN_IF_ERROR(Forward(*d[k], t));
              PLATEAU_RETURN_IF_ERROR(Sync(x));
              const double fwd = NowSeconds() - t0;
              d[k]->Release();
              if (rep >= tiny_warmup) record(*times[k], rep - tiny_warmup, fwd, 0);
            }
          }
          UpdateMax(mu, &res.tiny.k_budget, static_cast<PipelinedLlep&>(*budget).chunks());
          UpdateMax(mu, &res.tiny.k_fixed, static_cast<PipelinedLlep&>(*fixed).chunks());
        }
        return absl::OkStatus();
      });
  res.others_pct = meter.OthersPercent();
  if (!st.ok()) return st;
  for (int k = 0; k < kNumSched; ++k) res.diff[k] = Compare(outputs[k], outputs[kLlep]);
  return res;
}

// ---------------------------------------------------------------------------
// Under a fixed device cap: LLEP, PipelinedLLEP, then standard EP, one
// Forward + Backward each, in one world (a rank that runs out stops there,
// and its peers fail on the next collective, so standard EP goes last).

struct CapOutcome {
  std::string text;  // "ok", "OOM", "not run", "error"
  std::string detail;
  int64_t peak = 0;        // kDispatch, max over ranks (completed runs)
  int64_t total_peak = 0;  // the whole device, max over ranks
};

// The default cap: a device sized for standard EP on balanced routing (each
// rank receives its N k routes' worth) with 25% headroom, plus the inputs.
int64_t CapBytes(const Shape& s) {
  if (F("cap_mb") > 0) return F("cap_mb") << 20;
  const int64_t routes = s.N * s.m.top_k;
  const int64_t bytes = InputBytes(s, s.N) + StandardEpPeakBytes(s.m, routes, routes) * 5 / 4;
  return (bytes + (1 << 20) - 1) / (1 << 20) * (1 << 20);
}

std::vector<CapOutcome> RunUnderCap(const Shape& s, const RoutingProfile& profile, int64_t cap) {
  const Sched order[3] = {kLlep, kPipe, kStd};
  const int P = s.P;
  // [schedule in `order`][rank]
  std::vector<std::vector<absl::Status>> status(3, std::vector<absl::Status>(
                                                       P, absl::CancelledError("not run")));
  std::vector<CapOutcome> out(kNumSched);
  std::mutex mu;
  std::vector<absl::Status> rank_status;
  // The per-schedule statuses below say what failed where; the world's
  // status only names a failure before the first schedule (the inputs).
  const absl::Status world = RunWorld(
      P, cap, "dispatch-bench-cap",
      [&](int p, RankContext& x) -> absl::Status {
        MemoryTracker& tracker = x.be.device().tracker();
        auto in = MakeInputs(x, s, p, s.N, profile, static_cast<uint64_t>(F("seed")));
        if (!in.ok()) return in.status();
        for (int i = 0; i < 3; ++i) {
          absl::Status r = [&]() -> absl::Status {
            PLATEAU_RETURN_IF_ERROR(Barrier(x));
            tracker.ResetPeaks();
            PLATEAU_ASSIGN_OR_RETURN(auto d, MakeSched(order[i], s, s.c, s.N, x));
            PLATEAU_RETURN_IF_ERROR(Forward(*d, *in));
            PLATEAU_RETURN_IF_ERROR(Backward(*d, *in));
            return Sync(x);
          }();
          {
            std::lock_guard<std::mutex> l(mu);
            status[i][p] = r;
            if (r.ok()) {
              CapOutcome& o = out[order[i]];
              o.peak = std::max(o.peak, tracker.peak(LiveSet::kDispatch));
              o.total_peak = std::max(o.total_peak, tracker.total_peak());
            }
          }
          if (!r.ok()) return r;
        }
        return absl::OkStatus();
      },
      &rank_status);
  for (int i = 0; i < 3; ++i) {
    CapOutcome& o = out[order[i]];
    int oom_rank = -1, err_rank = -1, run = 0;
    for (int p = 0; p < P; ++p) {
      if (absl::IsResourceExhausted(status[i][p]) && oom_rank < 0) oom_rank = p;
      if (!status[i][p].ok() && !absl::IsCancelled(status[i][p]) && err_rank < 0) err_rank = p;
      if (!absl::IsCancelled(status[i][p])) ++run;
    }
    if (oom_rank >= 0) {
      o.text = "OOM";
      const auto info = OutOfMemoryInfoOf(status[i][oom_rank]);
      o.detail = info ? absl::StrFormat("rank %d: %s asked %.1f MiB, %.1f MiB free", oom_rank,
                                        LiveSetName(info->live_set), info->requested / kMiB,
                                        info->free / kMiB)
                      : absl::StrCat("rank ", oom_rank, ": ", status[i][oom_rank].message());
    } else if (err_rank >= 0) {
      o.text = "error";
      o.detail = absl::StrCat("rank ", err_rank, ": ", status[i][err_rank].ToString());
    } else if (run < P) {
      o.text = "not run";
      o.detail = run == 0 && i == 0 ? world.ToString() : "an earlier schedule failed in this world";
    } else {
      o.text = "ok";
    }
  }
  out[kPipeContig].text = "-";
  return out;
}

// ---------------------------------------------------------------------------
// Reporting.

std::string MiB(int64_t b) { return absl::StrFormat("%.1f", b / kMiB); }
std::string Ms(double s) { return absl::StrFormat("%.1f", 1e3 * s); }

std::string JsonTimes(const RepTimes& t, bool total) {
  std::string s = "[";
  const std::vector<double>& v = total ? t.total : t.fwd;
  for (size_t i = 0; i < v.size(); ++i) absl::StrAppendFormat(&s, "%s%.5f", i ? "," : "", v[i]);
  return s + "]";
}

struct Range {
  double lo = INFINITY, hi = -INFINITY;
  void Add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  std::string Text() const {
    if (lo > hi) return "-";
    return absl::StrFormat("%.3f-%.3f", lo, hi);
  }
};

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  using namespace plateau;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string name =
        a.substr(0, 2) == "--" && eq != std::string::npos ? a.substr(2, eq - 2) : "";
    const std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (string_flags.count(name)) {
      string_flags[name] = value;
    } else if (!flags.count(name) || !absl::SimpleAtoi(value, &flags[name])) {
      std::fprintf(stderr,
                   "dispatch_bench: bad argument '%s' (flags: --name=value; see the top of "
                   "bench/dispatch_bench.cc)\n",
                   a.c_str());
      return 2;
    }
  }
  if (!ParseBackendKind(string_flags["backend"]).ok()) {
    std::fprintf(stderr, "dispatch_bench: --backend: expected cpu or cuda, got '%s'\n",
                 string_flags["backend"].c_str());
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress visible when piped
  // (A rank that runs out of memory under the cap closes its sockets while
  // its peers may still write to them: the communicator ignores SIGPIPE, so
  // their collective fails with an error the cap table reports.)
  openblas_set_num_threads(static_cast<int>(F("blas_threads")));

  Shape s;
  s.P = static_cast<int>(F("ranks"));
  s.m.experts = F("experts");
  s.m.top_k = F("top_k");
  s.m.hidden = F("hidden");
  s.m.expert_ffn = F("ffn");
  s.N = F("tokens");
  s.c = F("chunk_tokens") > 0 ? F("chunk_tokens") : (s.N + 11) / 12;
  s.balance.alpha = kAlpha;
  s.balance.min_piece = F("min_piece");
  s.balance.lambda = 1.0;
  s.balance.max_borrowed = F("max_borrowed");
  {
    absl::Status v = ValidateLlepShape(s.m, s.P);
    if (v.ok()) v = ValidatePipelinedLlepOptions(PipeOptions(s, s.c, ChunkMembership::kStrided));
    if (v.ok() && (s.N < 1 || F("tiny_tokens") < 1 || F("tiny_chunks") < 1 || F("reps") < 1 ||
                   F("warmup") < 0 || F("tiny_reps") < 1 || F("hidden") < 1 || F("ffn") < 1)) {
      v = absl::InvalidArgumentError(
          "--tokens, --tiny_tokens, --tiny_chunks, --reps, --tiny_reps, --hidden, --ffn must be "
          ">= 1 and --warmup >= 0");
    }
    if (!v.ok()) {
      std::fprintf(stderr, "dispatch_bench: %s\n", v.ToString().c_str());
      return 2;
    }
  }
  std::vector<RoutingProfile> profiles;
  for (absl::string_view t : absl::StrSplit(string_flags["profiles"], ',', absl::SkipEmpty())) {
    auto pr = ParseProfile(t);
    absl::Status v = pr.ok() ? ValidateRoutingProfile(*pr, s.m.experts, s.m.top_k, s.N) : pr.status();
    if (!v.ok()) {
      std::fprintf(stderr, "dispatch_bench: %s\n", v.ToString().c_str());
      return 2;
    }
    profiles.push_back(*pr);
  }
  const int64_t H = s.m.hidden, Fd = s.m.expert_ffn, E = s.m.experts, K = s.m.top_k;
  const int P = s.P;
  const int64_t Kc = PipelinedLlepChunks(s.N, s.c);

  const double load0 = bench::LoadAverage1m();
  std::printf("dispatch_bench %s; load average (1 min) %.2f at start\n", bench::NowText().c_str(),
              load0);
  std::printf("shape: P=%d rank threads, N=%lld tokens per rank, E=%lld experts (%lld per rank), "
              "k=%lld, H=%lld, F=%lld, fp32\n",
              P, (long long)s.N, (long long)E, (long long)(E / P), (long long)K, (long long)H,
              (long long)Fd);
  std::printf("LLEP: alpha=%.2f, lambda=1 (always balance), min_piece=%lld routes, "
              "max_borrowed=%lld (0: no cap)\n",
              kAlpha, (long long)s.balance.min_piece, (long long)s.balance.max_borrowed);
  std::printf("PipelinedLLEP: c=%lld tokens per source per chunk -> K=%lld chunks; Eq. 1: at most "
              "P c k = %lld rows per chunk\n",
              (long long)s.c, (long long)Kc, (long long)(P * s.c * K));

  // The bound, split: rows (and what scales with them) against the borrowed
  // experts' weights (B x 3HF weights and gradients, L x 3HF lent).
  const auto bound_list =
      PipelinedLlepBuffers(s.m, P, s.N, PipeOptions(s, s.c, ChunkMembership::kStrided));
  const LlepChunkSizes slot =
      PipelinedLlepSlotSizes(s.m, P, s.N, PipeOptions(s, s.c, ChunkMembership::kStrided));
  int64_t bound = 0, bound_weights = 0, bound_rows = 0, bound_counts = 0;
  for (const DispatchBufferSpec& b : bound_list) {
    bound += b.bytes;
    const std::string n = b.name;
    if (n == "borrowed_weights" || n == "borrowed_grads" || n == "lent") {
      bound_weights += b.bytes;
    } else if (n == "counts") {
      bound_counts += b.bytes;
    } else {
      bound_rows += b.bytes;
    }
  }
  std::printf("  bound %s MiB: rows %s MiB (%.0f%%: send/recv/x/t/ffn/index/token view for "
              "R=%lld rows, S=%lld routes), borrowed-expert weights %s MiB (%.0f%%: B=%lld "
              "borrowed x 2 + L=%lld lent, x 3HF), counts %s MiB\n",
              MiB(bound).c_str(), MiB(bound_rows).c_str(), 100.0 * bound_rows / bound,
              (long long)slot.rows, (long long)slot.routes, MiB(bound_weights).c_str(),
              100.0 * bound_weights / bound, (long long)slot.borrowed, (long long)slot.lent,
              MiB(bound_counts).c_str());
  std::printf("  (B <= min(E - E_p, P c k / min_piece[, max_borrowed]) = min(%lld, %lld%s); a "
              "rank lends L <= min(E_p (P - 1), P c k / min_piece[, min(E_p, max_borrowed) (P - "
              "1)]))\n",
              (long long)(E - E / P), (long long)(P * s.c * K / s.balance.min_piece),
              s.balance.max_borrowed > 0
                  ? absl::StrCat(", ", s.balance.max_borrowed).c_str()
                  : "");

  // Runs.
  std::vector<ProfileResult> results;
  std::string backend_text;
  for (const RoutingProfile& prof : profiles) {
    const bool curve = string_flags["curve_profile"] == prof.Name();
    std::printf("... %s%s\n", prof.Name().c_str(), curve ? " (and the c curve)" : "");
    auto r = RunProfile(s, prof, curve, results.empty() ? &backend_text : nullptr);
    if (!r.ok()) {
      std::fprintf(stderr, "dispatch_bench: %s: %s\n", prof.Name().c_str(),
                   r.status().ToString().c_str());
      return 1;
    }
    results.push_back(std::move(*r));
  }
  const int64_t cap = CapBytes(s);
  std::printf("... the device cap (%s MiB)\n", MiB(cap).c_str());
  std::vector<std::vector<CapOutcome>> caps;
  for (const RoutingProfile& prof : profiles) caps.push_back(RunUnderCap(s, prof, cap));
  const double load1 = bench::LoadAverage1m();

  std::printf("\nbackend: %s\n", backend_text.c_str());
  std::printf("load average (1 min) %.2f at start, %.2f at end; others%% = share of all CPU time "
              "other processes took during each profile's run\n",
              load0, load1);

  // Table: peaks and times.
  std::printf("\npeaks (kDispatch, max over ranks, forward or backward) and times (median of %lld "
              "reps after %lld warm-up, slowest rank):\n",
              (long long)F("reps"), (long long)F("warmup"));
  std::printf("%-9s | %9s %9s %9s %8s | %8s %8s %8s %7s | %8s %8s %8s %7s | %7s\n", "profile",
              "std MiB", "LLEP MiB", "Pipe MiB", "Pipe/LL", "std fwd", "LLEP fwd", "Pipe fwd",
              "speed", "std f+b", "LLEP f+b", "Pipe f+b", "speed", "others%");
  Range peak_ratio, fwd_speed, tot_speed;
  for (const ProfileResult& r : results) {
    const SchedResult &sd = r.s[kStd], &ll = r.s[kLlep], &pi = r.s[kPipe];
    const double pr = double(pi.peak()) / ll.peak();
    const double fs = ll.fwd_s() / pi.fwd_s(), ts = ll.total_s() / pi.total_s();
    peak_ratio.Add(pr);
    fwd_speed.Add(fs);
    tot_speed.Add(ts);
    std::printf("%-9s | %9s %9s %9s %7.3fx | %8s %8s %8s %6.3fx | %8s %8s %8s %6.3fx | %7.1f\n",
                r.name.c_str(), MiB(sd.peak()).c_str(), MiB(ll.peak()).c_str(),
                MiB(pi.peak()).c_str(), pr, Ms(sd.fwd_s()).c_str(), Ms(ll.fwd_s()).c_str(),
                Ms(pi.fwd_s()).c_str(), fs, Ms(sd.total_s()).c_str(), Ms(ll.total_s()).c_str(),
                Ms(pi.total_s()).c_str(), ts, r.others_pct);
  }
  std::printf("  times in ms; speed = LLEP's time / PipelinedLLEP's (>= 1: as fast or faster). "
              "PipelinedLLEP peak / LLEP peak %s (target <= 0.40; paper 0.41-0.43); forward speed "
              "%s, forward+backward speed %s (target >= 1.0; paper 1.01-1.10)\n",
              peak_ratio.Text().c_str(), fwd_speed.Text().c_str(), tot_speed.Text().c_str());
  // Table: the dispatch's share of a training step. The step runs Forward
  // in its forward pass, then per layer the recompute and Backward; the
  // recompute calls ForwardForBackward, which for PipelinedLLEP only plans
  // (its Backward replays the chunks), for LLEP is Forward.
  std::printf("\nin the step (forward pass, then recompute + backward; ms):\n");
  std::printf("%-9s | %9s %9s %7s | %9s %9s %7s\n", "profile", "LLEP f+b", "Pipe r+b",
              "speed", "LLEP step", "Pipe step", "speed");
  Range bwd_speed, step_speed;
  for (const ProfileResult& r : results) {
    const SchedResult &ll = r.s[kLlep], &pi = r.s[kPipe];
    const double ls = ll.fwd_s() + ll.total_s(), ps = pi.fwd_s() + pi.for_backward_s();
    bwd_speed.Add(ll.total_s() / pi.for_backward_s());
    step_speed.Add(ls / ps);
    std::printf("%-9s | %9s %9s %6.3fx | %9s %9s %6.3fx\n", r.name.c_str(),
                Ms(ll.total_s()).c_str(), Ms(pi.for_backward_s()).c_str(),
                ll.total_s() / pi.for_backward_s(), Ms(ls).c_str(), Ms(ps).c_str(), ls / ps);
  }
  std::printf("  r+b = ForwardForBackward + Backward (PipelinedLLEP: plan only, then the chunk "
              "replay; its GEMMs are 9, LLEP's f+b 9): speed %s; step = fwd + (LLEP: f+b, Pipe: "
              "r+b): speed %s\n",
              bwd_speed.Text().c_str(), step_speed.Text().c_str());

  double worst_others = 0;
  for (const ProfileResult& r : results) worst_others = std::max(worst_others, r.others_pct);
  if (worst_others > 10) {
    std::printf("  WARNING: other processes took up to %.0f%% of the CPU during these runs: the "
                "times are not reliable (the peaks are)\n",
                worst_others);
  }

  // Table: routes.
  std::printf("\nrows received (max over ranks; PipelinedLLEP: and over chunks) and experts "
              "moved:\n");
  std::printf("%-9s | %8s | %8s %4s %4s | %3s %8s %4s %4s | %9s %9s | %9s %7s\n", "profile",
              "std R_d", "LLEP R_d", "B", "L", "K", "Pipe R/c", "B", "L", "Eq.1 str", "Eq.1 con",
              "con fwd", "str/con");
  Range frac_str, frac_con;
  for (const ProfileResult& r : results) {
    const double eq1 = double(P * std::min(s.c, s.N) * K);
    const double fs = r.pipe_rows / eq1, fc = r.contig_rows / eq1;
    frac_str.Add(fs);
    frac_con.Add(fc);
    std::printf("%-9s | %8lld | %8lld %4lld %4lld | %3lld %8lld %4lld %4lld | %8.1f%% %8.1f%% | "
                "%9s %6.3fx\n",
                r.name.c_str(), (long long)r.std_rows, (long long)r.llep_rows,
                (long long)r.llep_borrowed, (long long)r.llep_lent, (long long)r.pipe_chunks,
                (long long)r.pipe_rows, (long long)r.pipe_borrowed, (long long)r.pipe_lent,
                100 * fs, 100 * fc, Ms(r.s[kPipeContig].fwd_s()).c_str(),
                r.s[kPipeContig].fwd_s() / r.s[kPipe].fwd_s());
  }
  std::printf("  B/L: experts a rank borrowed / (helper, expert) pairs it lent. Eq. 1 fraction = "
              "most rows a rank received in a chunk / (P c k) (paper, at P = 8: 12.5%% strided, "
              "17.1%% contiguous on 50%%/4; an even split at P = %d is %.1f%%). str/con = "
              "strided forward speed over contiguous (paper 1.03-1.35x). Each chunk is balanced by "
              "LLEP on its own loads, so the two memberships give the same rows wherever a "
              "chunk's overflow can move (pieces >= min_piece, helpers under max_borrowed): they "
              "differ on hot runs (h%%/g@b) when it cannot, e.g. at --min_piece=1024\n",
              P, 100.0 / P);

  // Table: agreement.
  std::printf("\nagreement with LLEP on the same inputs (one Forward + Backward from zero):\n");
  std::printf("%-9s | %-24s | %12s %12s | %10s %10s %10s\n", "profile", "schedule", "max|dout|",
              "max|out|", "du rel", "dgates rel", "dW rel");
  // A schedule that disagrees with LLEP beyond fp32 rounding (the tests
  // hold 1e-5 on values, 1e-4 on gradients; a broken one is off by O(1))
  // fails the run, rather than reporting the speed and peak of a wrong
  // result.
  constexpr double kOutTol = 1e-4, kGradTol = 1e-3;
  std::vector<std::string> disagree;
  for (const ProfileResult& r : results) {
    for (int k : {kStd, kPipe, kPipeContig}) {
      const Diff& d = r.diff[k];
      std::printf("%-9s | %-24s | %12.3e %12.3e | %10.2e %10.2e %10.2e\n", r.name.c_str(),
                  kSchedName[k], d.out, d.out_scale, d.du, d.dgates, d.dw);
      const double out_rel = d.out_scale > 0 ? d.out / d.out_scale : d.out;
      if (!(out_rel <= kOutTol && d.du <= kGradTol && d.dgates <= kGradTol && d.dw <= kGradTol)) {
        disagree.push_back(absl::StrCat(r.name, " ", kSchedName[k]));
      }
    }
  }
  std::printf(
      "  max|dout| = max over ranks and elements of |out - out_LLEP|; rel = max abs "
      "difference / max |LLEP's value|; the run fails past %.0e (out, relative) or %.0e "
      "(du, dgates, dW)\n",
      kOutTol, kGradTol);

  // Table: the cap.
  std::printf("\none Forward + Backward under a device cap of %s MiB per rank (%s)\n",
              MiB(cap).c_str(),
              F("cap_mb") > 0 ? "--cap_mb"
                              : "inputs + 1.25 x standard EP's peak at a balanced N k received "
                                "rows; set with --cap_mb");
  for (size_t i = 0; i < results.size(); ++i) {
    std::printf("%-9s |", results[i].name.c_str());
    for (int k : {kStd, kLlep, kPipe}) {
      const CapOutcome& o = caps[i][k];
      if (o.text == "ok") {
        std::printf(" %s ok (dispatch %s MiB, device %s MiB) |", kSchedName[k], MiB(o.peak).c_str(),
                    MiB(o.total_peak).c_str());
      } else {
        // Out of memory is the cap's verdict; any other error is a failure.
        if (o.text == "error")
          disagree.push_back(absl::StrCat(results[i].name, " ", kSchedName[k], " under the cap: ", o.detail));
        std::printf(" %s %s (%s) |", kSchedName[k], o.text.c_str(), o.detail.c_str());
      }
    }
    std::printf("\n");
  }

  // What the CPU backend adds to the times (not the schedules' own cost).
  std::printf("\nCPU-backend effects on the times (slowest rank, median):\n");
  std::printf("%-9s | %10s %10s %9s %9s | %10s %12s\n", "profile", "LLEP alloc", "rewrite",
              "extra ms", "% LLEP f", "chunk ms", "x K (Pipe)");
  for (const ProfileResult& r : results) {
    const double first = Median(r.llep_alloc.fwd), again = Median(r.llep_alloc.total);
    const TinyResult& t = r.tiny;
    const double per_chunk = t.k_fixed > t.k_budget ? (Median(t.fixed.fwd) - Median(t.budget.fwd)) /
                                                          double(t.k_fixed - t.k_budget)
                                                    : 0.0;
    std::printf("%-9s | %10s %10s %9s %8.0f%% | %10.2f %12s\n", r.name.c_str(),
                Ms(first).c_str(), Ms(again).c_str(), Ms(first - again).c_str(),
                100 * (first - again) / r.s[kLlep].fwd_s(), 1e3 * per_chunk,
                Ms(per_chunk * r.pipe_chunks).c_str());
  }
  std::printf("  LLEP alloc = allocating LLEP's buffer list at its realized sizes and writing it "
              "once; rewrite = writing it again. LLEP allocates per call (Plateau has no caching "
              "allocator: malloc here, cudaMalloc/cudaFree on CUDA), and on the CPU large blocks "
              "come back from the OS and are zeroed page by page on first touch; PipelinedLLEP "
              "allocates once in Create. chunk ms = the tiny-N "
              "forward's cost per extra chunk ((fixed K - budget K) / (K_f - K_b)): Gloo over "
              "loopback, P rank threads on these cores; x K = that cost at the main shape's K. "
              "Forward+backward: PipelinedLLEP's Backward recomputes each chunk's expert forward "
              "(B.1) where LLEP keeps its activations, so its GEMM work is 12/9 of LLEP's: a "
              "speed floor of 0.75x from arithmetic alone\n");

  // Table: the curve.
  for (const ProfileResult& r : results) {
    if (r.curve.empty()) continue;
    const double llep_peak = r.s[kLlep].peak();
    std::printf("\nPipelinedLLEP forward against c on %s (LLEP's forward beside it, interleaved; "
                "LLEP's peak %s MiB):\n",
                r.name.c_str(), MiB(r.s[kLlep].peak()).c_str());
    std::printf("%7s %4s | %9s %9s %8s | %9s %9s %7s | %8s\n", "c", "K", "bound MiB", "peak MiB",
                "Pipe/LL", "Pipe fwd", "LLEP fwd", "speed", "Eq.1 frac");
    for (const CurvePoint& cp : r.curve) {
      const double eq1 = double(P * std::min(cp.c, s.N) * K);
      std::printf("%7lld %4lld | %9s %9s %7.3fx | %9s %9s %6.3fx | %7.1f%%\n", (long long)cp.c,
                  (long long)cp.chunks, MiB(cp.bound).c_str(), MiB(cp.peak).c_str(),
                  cp.peak / llep_peak, Ms(Median(cp.pipe.fwd)).c_str(),
                  Ms(Median(cp.llep.fwd)).c_str(), Median(cp.llep.fwd) / Median(cp.pipe.fwd),
                  100 * cp.rows_per_chunk / eq1);
    }
  }

  // Table: tiny N.
  std::printf("\ntiny N = %lld tokens per rank, forward (median of %lld): K from the budget (c = "
              "%lld) against a fixed K (c = %lld):\n",
              (long long)F("tiny_tokens"), (long long)F("tiny_reps"),
              (long long)(results.empty() ? 0 : results[0].tiny.c_budget),
              (long long)(results.empty() ? 0 : results[0].tiny.c_fixed));
  std::printf("%-9s | %9s | %3s %9s | %3s %9s | %9s %9s %9s\n", "profile", "LLEP ms", "K",
              "Pipe ms", "K", "Pipe ms", "Kb/Kf", "Kb/LLEP", "Kf/LLEP");
  Range tiny_speed;
  for (const ProfileResult& r : results) {
    const TinyResult& t = r.tiny;
    const double l = Median(t.llep.fwd), b = Median(t.budget.fwd), f = Median(t.fixed.fwd);
    tiny_speed.Add(f / b);
    std::printf("%-9s | %9.2f | %3lld %9.2f | %3lld %9.2f | %8.3fx %8.3fx %8.3fx\n",
                r.name.c_str(), 1e3 * l, (long long)t.k_budget, 1e3 * b, (long long)t.k_fixed,
                1e3 * f, f / b, l / b, l / f);
  }
  std::printf("  Kb/Kf = the fixed K's time / the budget K's: %s (paper 1.60-2.96x); Kb/LLEP "
              "and Kf/LLEP = LLEP's time / each one's (paper: fixed ten chunks 0.45-0.48x)\n",
              tiny_speed.Text().c_str());

  // JSON.
  std::string js = absl::StrFormat(
      "{\"bench\":\"dispatch\",\"date\":%s,\"load_avg_1m_start\":%.2f,\"load_avg_1m_end\":%.2f,"
      "\"backend\":%s,\"ranks\":%d,\"tokens\":%d,\"experts\":%d,\"top_k\":%d,\"hidden\":%d,"
      "\"ffn\":%d,\"chunk_tokens\":%d,\"chunks\":%d,\"min_piece\":%d,\"max_borrowed\":%d,"
      "\"alpha\":%.2f,"
      "\"bound_bytes\":%d,\"bound_row_bytes\":%d,\"bound_weight_bytes\":%d,"
      "\"bound_count_bytes\":%d,\"slot_borrowed\":%d,\"slot_lent\":%d,\"cap_bytes\":%d,"
      "\"profiles\":[",
      bench::JsonString(bench::NowText()), load0, load1, bench::JsonString(backend_text), P, s.N, E,
      K, H, Fd, s.c, Kc, s.balance.min_piece, s.balance.max_borrowed, kAlpha, bound, bound_rows, bound_weights,
      bound_counts, slot.borrowed, slot.lent, cap);
  for (size_t i = 0; i < results.size(); ++i) {
    const ProfileResult& r = results[i];
    absl::StrAppendFormat(&js, "%s{\"profile\":%s,\"others_pct\":%.1f", i ? "," : "",
                          bench::JsonString(r.name), r.others_pct);
    for (int k = 0; k < kNumSched; ++k) {
      const SchedResult& x = r.s[k];
      absl::StrAppendFormat(&js,
                            ",\"%s\":{\"peak_fwd_bytes\":%d,\"peak_bwd_bytes\":%d,\"fwd_s\":%.5f,"
                            "\"fwd_bwd_s\":%.5f,\"fwd_reps\":%s,\"fwd_bwd_reps\":%s,"
                            "\"max_abs_out_diff_vs_llep\":%.3e,\"du_rel_diff\":%.3e,"
                            "\"dgates_rel_diff\":%.3e,\"dw_rel_diff\":%.3e,\"cap\":%s}",
                            kSchedKey[k], x.peak_fwd, x.peak_bwd, x.fwd_s(), x.total_s(),
                            JsonTimes(x.times, false), JsonTimes(x.times, true), r.diff[k].out,
                            r.diff[k].du, r.diff[k].dgates, r.diff[k].dw,
                            bench::JsonString(caps[i][k].text));
    }
    const double eq1 = double(P * std::min(s.c, s.N) * K);
    absl::StrAppendFormat(
        &js,
        ",\"peak_ratio\":%.4f,\"fwd_speed\":%.4f,\"fwd_bwd_speed\":%.4f,\"std_rows\":%d,"
        "\"llep_rows\":%d,\"llep_borrowed\":%d,\"llep_lent\":%d,\"pipe_rows_per_chunk\":%d,"
        "\"pipe_borrowed\":%d,\"pipe_lent\":%d,\"eq1_fraction_strided\":%.4f,"
        "\"eq1_fraction_contiguous\":%.4f,\"strided_over_contiguous_speed\":%.4f,"
        "\"pipe_for_backward_s\":%.5f,\"recompute_bwd_speed\":%.4f,\"step_speed\":%.4f",
        double(r.s[kPipe].peak()) / r.s[kLlep].peak(), r.s[kLlep].fwd_s() / r.s[kPipe].fwd_s(),
        r.s[kLlep].total_s() / r.s[kPipe].total_s(), r.std_rows, r.llep_rows, r.llep_borrowed,
        r.llep_lent, r.pipe_rows, r.pipe_borrowed, r.pipe_lent, r.pipe_rows / eq1,
        r.contig_rows / eq1, r.s[kPipeContig].fwd_s() / r.s[kPipe].fwd_s(),
        r.s[kPipe].for_backward_s(), r.s[kLlep].total_s() / r.s[kPipe].for_backward_s(),
        (r.s[kLlep].fwd_s() + r.s[kLlep].total_s()) /
            (r.s[kPipe].fwd_s() + r.s[kPipe].for_backward_s()));
    const TinyResult& t = r.tiny;
    absl::StrAppendFormat(&js,
                          ",\"tiny\":{\"tokens\":%d,\"llep_fwd_s\":%.6f,\"budget_chunks\":%d,"
                          "\"budget_fwd_s\":%.6f,\"fixed_chunks\":%d,\"fixed_fwd_s\":%.6f,"
                          "\"budget_over_fixed_speed\":%.4f}",
                          F("tiny_tokens"), Median(t.llep.fwd), t.k_budget, Median(t.budget.fwd),
                          t.k_fixed, Median(t.fixed.fwd), Median(t.fixed.fwd) / Median(t.budget.fwd));
    absl::StrAppendFormat(&js, ",\"llep_alloc_first_write_s\":%.5f,\"llep_rewrite_s\":%.5f",
                          Median(r.llep_alloc.fwd), Median(r.llep_alloc.total));
    if (!r.curve.empty()) {
      js += ",\"curve\":[";
      for (size_t j = 0; j < r.curve.size(); ++j) {
        const CurvePoint& cp = r.curve[j];
        absl::StrAppendFormat(&js,
                              "%s{\"c\":%d,\"chunks\":%d,\"bound_bytes\":%d,\"peak_bytes\":%d,"
                              "\"rows_per_chunk\":%d,\"pipe_fwd_s\":%.5f,\"llep_fwd_s\":%.5f}",
                              j ? "," : "", cp.c, cp.chunks, cp.bound, cp.peak, cp.rows_per_chunk,
                              Median(cp.pipe.fwd), Median(cp.llep.fwd));
      }
      js += "]";
    }
    js += "}";
  }
  js += "]}";
  std::printf("\n%s\n", js.c_str());
  if (!disagree.empty()) {
    std::fprintf(stderr, "dispatch_bench: FAILED: %s\n", absl::StrJoin(disagree, "; ").c_str());
    return 1;
  }
  return 0;
}
