// plateau_train: runs a training job of P rank processes on this machine.
//
// Without --rank it is the launcher: it starts P copies of itself, each a
// rank (in its own process group), with a fresh rendezvous directory, waits
// for them, and forwards Ctrl-C. With --rank it is one rank: CPU backend with
// a capped device arena, Gloo over loopback, the baseline MoE step on the
// chosen data, checkpoints, and a progress line every --log_every steps
// (rank 0). The service's worker agent starts plateau_rank processes the
// same way, with rendezvous through the coordinator (docs/SERVICE.md).
//
//   plateau_train --ranks=2 --steps=200                 # synthetic recall task
//   plateau_train --data=text:README.md --vocab=256     # byte-level text
//   plateau_train --data=shards:a.bin,b.bin --vocab=50257
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "kernels/budget/budget.h"
#include "kernels/communicator.h"
#include "kernels/kv_store.h"
#include "kernels/status_macros.h"
#include "worker/trainer.h"

extern char** environ;

namespace plateau {
namespace {

struct Flags {
  int64_t ranks = 2, rank = -1, steps = 200, batch = 32, log_every = 10;
  int64_t device_mb = 256, host_mb = 0, checkpoint_every = 0, keep_attention = 0;
  std::string store_dir, data = "recall", checkpoint_dir, projection = "dense", ring_mode = "auto";
  std::string checkpoints = "full", dispatch = "standard_ep", optimizer_placement = "device";
  TrainerOptions trainer;
};

constexpr char kUsage[] = R"(usage: plateau_train [--name=value ...]

Runs a training job of --ranks rank processes on this machine (CPU backend,
Gloo over loopback) and prints progress from rank 0.

job        --ranks=2 --steps=200 --batch=32 (sequences per step)
           --seed=1 (weight initialisation) --device_mb=256 (each rank's device arena)
           --host_mb=0 (each rank's host memory cap; 0: uncapped)
           --log_every=10
model      --vocab (0: the data's) --hidden=64 --layers=2 --heads=4 --kv_heads=2
           --experts=4 --top_k=2 --expert_ffn=128 --seq_len=32
           --rope_theta=10000 --norm_eps=1e-5 --init_std=0.02
optimizer  AdamW, constant learning rate: --lr=0.006 --beta1=0.9 --beta2=0.95
           --eps=1e-8 --weight_decay=0 --max_grad_norm=1 (0: no clipping)
data       --data=recall | text:<file> | shards:<file>[,<file>...]
           --recall_keys=8 --recall_values=8 --recall_pairs=4 --recall_queries=4
           --data_seed=1 (the recall task's generator; text and shards are read in order)
projection --projection=dense | ring_dtp  --ring_mode=auto|activations|weights
           --ring_strip=16 (vocabulary columns per strip) --ring_chunk_rows=0 (0: one pass)
boundaries --checkpoints=full | sco (the earliest layer boundaries in a host pool)
           --sco_host_budget_bytes=0 (beta: host bytes per rank for the pool)
           --keep_attention=0 (1: keep each layer's attention output for the
           backward, beside the boundaries; its recompute skips attention's forward)
dispatch   --dispatch=standard_ep | llep | pipelined_llep
           --chunk_tokens=4096 (pipelined_llep: tokens per source rank per chunk)
           --llep_min_piece=1024 (llep, pipelined_llep: smallest piece moved to a helper)
           --llep_max_borrowed=0 (llep, pipelined_llep: most experts a rank borrows per
           layer call / chunk; 0: no cap)
optimizer  --optimizer_placement=device | cpu_offload | offload_stream
state      --bucket_params=100000000 --staging_slots=2 (offload_stream)
checkpoint --checkpoint_dir=<dir> (resumes from its newest step-N.safetensors)
           --checkpoint_every=0 (0: only at the end)
           --checkpoint_keep_last=0 (the newest K kept, older ones removed
           after each save; 0: every one)
)";

// A float flag and the values it accepts: lo and hi, each excluded when
// *_open (hi = INFINITY: no upper bound); the value must be finite. Parsed
// as the float nearest the decimal given.
struct FloatFlag {
  float* value;
  float lo;
  bool lo_open;
  float hi;
  bool hi_open;

  bool Accepts(float v) const {
    return std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
  std::string Range() const {
    if (std::isinf(hi)) return absl::StrCat("a finite number ", lo_open ? "> " : ">= ", lo);
    return absl::StrCat("a number in ", lo_open ? "(" : "[", lo, ", ", hi, hi_open ? ")" : "]");
  }
};

absl::StatusOr<Flags> Parse(int argc, char** argv) {
  Flags f;
  f.trainer = RecallDemoJob(f.ranks);  // defaults: the demo job's model, data and optimizer
  // ... but the four baseline schedules, as the usage says: each flag below
  // turns one on. (The demo job's own schedules were kept here while the
  // flags that name a baseline set nothing, so `--checkpoints=full` ran SCO,
  // `--dispatch=standard_ep` PipelinedLLEP and `--optimizer_placement=device`
  // OffloadStreamAdamW.)
  const StepOptions baselines;
  f.trainer.step.dispatch = baselines.dispatch;
  f.trainer.step.projection = baselines.projection;
  f.trainer.step.checkpoints = baselines.checkpoints;
  f.trainer.step.optimizer_placement = baselines.optimizer_placement;
  ModelConfig& m = f.trainer.step.model;
  m.vocab_size = 0;  // 0: the data's vocabulary
  std::map<std::string, int64_t*> ints = {{"ranks", &f.ranks},
                                          {"rank", &f.rank},
                                          {"steps", &f.steps},
                                          {"batch", &f.batch},
                                          {"log_every", &f.log_every},
                                          {"device_mb", &f.device_mb},
                                          {"host_mb", &f.host_mb},
                                          {"checkpoint_every", &f.checkpoint_every},
                                          {"checkpoint_keep_last", &f.trainer.checkpoint_keep_last},
                                          {"vocab", &m.vocab_size},
                                          {"hidden", &m.hidden},
                                          {"layers", &m.layers},
                                          {"heads", &m.heads},
                                          {"kv_heads", &m.kv_heads},
                                          {"experts", &m.experts},
                                          {"top_k", &m.top_k},
                                          {"expert_ffn", &m.expert_ffn},
                                          {"seq_len", &m.seq_len}};
  std::map<std::string, std::string*> strings = {
      {"store_dir", &f.store_dir}, {"data", &f.data}, {"checkpoint_dir", &f.checkpoint_dir},
      {"projection", &f.projection}, {"ring_mode", &f.ring_mode}, {"checkpoints", &f.checkpoints},
      {"dispatch", &f.dispatch}, {"optimizer_placement", &f.optimizer_placement}};
  DispatchOptions& dispatch = f.trainer.step.dispatch;
  int64_t llep_min_piece = dispatch.llep.min_piece;
  ints["chunk_tokens"] = &dispatch.pipelined.chunk_tokens;
  ints["llep_min_piece"] = &llep_min_piece;
  int64_t llep_max_borrowed = dispatch.llep.max_borrowed;
  ints["llep_max_borrowed"] = &llep_max_borrowed;
  OptimizerPlacementOptions& placement = f.trainer.step.optimizer_placement;
  ints["bucket_params"] = &placement.bucket_params;
  ints["staging_slots"] = &placement.staging_slots;
  ints["sco_host_budget_bytes"] = &f.trainer.step.checkpoints.host_budget_bytes;
  ints["keep_attention"] = &f.keep_attention;
  ProjectionOptions& proj = f.trainer.step.projection;
  proj.strip = 16;  // small default for the small demo vocabulary
  ints["ring_strip"] = &proj.strip;
  ints["ring_chunk_rows"] = &proj.chunk_rows;
  RecallTask& task = f.trainer.data.recall;
  // Two seeds, independent of each other: changing one leaves the other's
  // stream as it was (docs/MODEL.md, "Data" and "Initialisation").
  std::map<std::string, uint64_t*> seeds = {{"seed", &f.trainer.step.seed},
                                            {"data_seed", &task.seed}};
  OptimizerConfig& opt = f.trainer.step.optimizer;
  // Every documented constant, with the range a JobSpec accepts
  // (worker/job_spec.cc), so that a plateau_train run can also be submitted
  // as a job; checked here so that the error names the flag the user typed
  // and no rank is started for a bad value.
  std::map<std::string, FloatFlag> floats = {
      {"lr", {&opt.lr, 0.0f, true, 1e3f, false}},
      {"beta1", {&opt.beta1, 0.0f, false, 1.0f, true}},
      {"beta2", {&opt.beta2, 0.0f, false, 1.0f, true}},
      {"eps", {&opt.eps, 0.0f, true, 1.0f, false}},
      {"weight_decay", {&opt.weight_decay, 0.0f, false, 1.0f, false}},
      {"max_grad_norm", {&opt.max_grad_norm, 0.0f, false, INFINITY, true}},
      {"rope_theta", {&m.rope_theta, 1.0f, true, 1e12f, false}},
      {"norm_eps", {&m.norm_eps, 0.0f, true, 1.0f, false}},
      {"init_std", {&m.init_std, 0.0f, true, 1.0f, false}}};
  ints["recall_keys"] = &task.num_keys;
  ints["recall_values"] = &task.num_values;
  ints["recall_pairs"] = &task.pairs;
  ints["recall_queries"] = &task.queries;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("argument '", arg,
                                                     "': expected --name=value (see --help)"));
    }
    std::string name = arg.substr(2, eq - 2), value = arg.substr(eq + 1);
    if (auto it = ints.find(name); it != ints.end()) {
      if (!absl::SimpleAtoi(value, it->second)) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": expected an integer, got '", value, "'"));
      }
    } else if (auto st = strings.find(name); st != strings.end()) {
      *st->second = value;
    } else if (auto sd = seeds.find(name); sd != seeds.end()) {
      if (!absl::SimpleAtoi(value, sd->second)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": expected an integer from 0 to 2^64-1, got '", value, "'"));
      }
    } else if (auto fl = floats.find(name); fl != floats.end()) {
      float v = 0.0f;
      if (!absl::SimpleAtof(value, &v) || !fl->second.Accepts(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": expected ", fl->second.Range(), ", got '", value, "'"));
      }
      *fl->second.value = v;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
  }
  if (f.ranks < 1 || f.ranks > 16) return absl::InvalidArgumentError("--ranks: expected 1 to 16");
  if (f.keep_attention != 0 && f.keep_attention != 1) {
    return absl::InvalidArgumentError(absl::StrCat("--keep_attention: expected 0 or 1, got ", f.keep_attention));
  }
  f.trainer.step.checkpoints.keep_attention = f.keep_attention == 1;
  // MiB that fit in int64 bytes.
  constexpr int64_t kMaxMb = std::numeric_limits<int64_t>::max() >> 20;
  if (f.device_mb < 1 || f.device_mb > kMaxMb) {
    return absl::InvalidArgumentError(absl::StrCat("--device_mb: expected 1 to ", kMaxMb, ", got ", f.device_mb));
  }
  if (f.host_mb < 0 || f.host_mb > kMaxMb) {
    return absl::InvalidArgumentError(
        absl::StrCat("--host_mb: expected 0 (uncapped) to ", kMaxMb, ", got ", f.host_mb));
  }
  if (f.log_every < 1) return absl::InvalidArgumentError("--log_every: expected >= 1");
  if (f.checkpoints == "sco") {
    f.trainer.step.checkpoints.kind = CheckpointOptions::Kind::kSco;
    if (f.trainer.step.checkpoints.host_budget_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--sco_host_budget_bytes: expected >= 0, got ",
                                                     f.trainer.step.checkpoints.host_budget_bytes));
    }
  } else if (f.checkpoints != "full") {
    return absl::InvalidArgumentError(
        absl::StrCat("--checkpoints: expected full or sco, got '", f.checkpoints, "'"));
  }
  dispatch.llep.min_piece = dispatch.pipelined.balance.min_piece = llep_min_piece;
  dispatch.llep.max_borrowed = dispatch.pipelined.balance.max_borrowed = llep_max_borrowed;
  if (f.dispatch == "llep") {
    dispatch.kind = DispatchOptions::Kind::kLlep;
  } else if (f.dispatch == "pipelined_llep") {
    dispatch.kind = DispatchOptions::Kind::kPipelinedLlep;
  } else if (f.dispatch != "standard_ep") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dispatch: expected standard_ep, llep or pipelined_llep, got '", f.dispatch, "'"));
  }
  if (f.optimizer_placement == "cpu_offload") {
    placement.kind = OptimizerPlacementOptions::Kind::kCpuOffload;
  } else if (f.optimizer_placement == "offload_stream") {
    placement.kind = OptimizerPlacementOptions::Kind::kOffloadStream;
  } else if (f.optimizer_placement != "device") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--optimizer_placement: expected device, cpu_offload or offload_stream, got '", f.optimizer_placement, "'"));
  }
  if (f.projection == "ring_dtp") {
    proj.kind = ProjectionOptions::Kind::kRingDtp;
  } else if (f.projection != "dense") {
    return absl::InvalidArgumentError(
        absl::StrCat("--projection: expected dense or ring_dtp, got '", f.projection, "'"));
  }
  if (f.ring_mode == "activations") {
    proj.mode = RingDtpMode::kActivations;
  } else if (f.ring_mode == "weights") {
    proj.mode = RingDtpMode::kWeights;
  } else if (f.ring_mode != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--ring_mode: expected auto, activations or weights, got '", f.ring_mode, "'"));
  }
  f.trainer.step.layout = {f.ranks, f.batch};
  f.trainer.steps = f.steps;
  f.trainer.checkpoint_dir = f.checkpoint_dir;
  f.trainer.checkpoint_every = f.checkpoint_every;
  if (f.trainer.checkpoint_keep_last < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint_keep_last: expected >= 0 (0: keep every checkpoint), got ", f.trainer.checkpoint_keep_last));
  }
  DataOptions& d = f.trainer.data;
  if (f.data == "recall") {
    d.kind = DataOptions::Kind::kRecall;
    if (m.vocab_size == 0) m.vocab_size = d.recall.vocab_size();
  } else if (f.data.rfind("text:", 0) == 0) {
    d.kind = DataOptions::Kind::kText;
    d.paths = {f.data.substr(5)};
    if (m.vocab_size == 0) m.vocab_size = 256;
  } else if (f.data.rfind("shards:", 0) == 0) {
    d.kind = DataOptions::Kind::kShards;
    d.paths = absl::StrSplit(f.data.substr(7), ',');
    if (m.vocab_size == 0) {
      return absl::InvalidArgumentError("--vocab: token shards need the vocabulary size");
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--data: expected recall, text:<file> or shards:<file>[,<file>...], got '", f.data, "'"));
  }
  return f;
}

std::string Peaks(const MemoryStats& s) {
  std::string out;
  for (int i = 0; i < kNumLiveSets; ++i) {
    if (s.peak[i] == 0) continue;
    absl::StrAppend(&out, out.empty() ? "" : " ", LiveSetName(static_cast<LiveSet>(i)), "=",
                    absl::StrFormat("%.2fMiB", s.peak[i] / 1048576.0));
  }
  return out;
}

absl::Status RunRank(const Flags& f) {
  BackendOptions bo;
  bo.device_memory_bytes = f.device_mb << 20;
  bo.host_memory_bytes = f.host_mb << 20;
  PLATEAU_ASSIGN_OR_RETURN(auto backend, Backend::Create(bo));
  CommunicatorOptions co;
  co.rank = static_cast<int>(f.rank);
  co.size = static_cast<int>(f.ranks);
  PLATEAU_ASSIGN_OR_RETURN(co.store, FileStore::Create(f.store_dir));
  co.prefix = "plateau_train";
  PLATEAU_ASSIGN_OR_RETURN(auto world, CreateCommunicator(co));
  double first = -1, last = 0, tokens = 0, seconds = 0, flops = 0;
  int64_t ran = 0;  // steps this run (fewer than f.steps after a resume)
  MemoryStats peak, host_peak;
  auto on_step = [&](const StepReport& r) {
    if (first < 0) first = r.stats.loss;
    ++ran;
    if (f.rank == 0 && !r.kernels.empty()) std::printf("kernels: %s\n", r.kernels.c_str());
    last = r.stats.loss;
    tokens += r.tokens;
    seconds += r.seconds;
    flops += r.model_flops;
    peak.KeepPeaks(r.stats.device);
    host_peak.KeepPeaks(r.stats.host);
    if (f.rank == 0 && (r.stats.step % f.log_every == 0 || r.stats.step == f.steps || r.stats.step == 1)) {
      // The loss in full: %.17g reads back as the same double, so a run can
      // be compared with an independent rebuild of the model step by step.
      // Host peaks only when the schedules keep something there.
      std::printf("step %5lld/%lld  loss %.17g  |g| %.3f  %.0f tok/s  %.2f GFLOP/s  peak %s%s\n",
                  static_cast<long long>(r.stats.step), static_cast<long long>(f.steps), r.stats.loss,
                  r.stats.grad_norm, r.tokens / r.seconds, r.model_flops / r.seconds / 1e9,
                  Peaks(r.stats.device).c_str(),
                  r.stats.host.total_peak > 0 ? absl::StrCat("  host ", Peaks(r.stats.host)).c_str() : "");
      std::fflush(stdout);
    }
  };
  TrainerOptions trainer = f.trainer;
  if (f.rank == 0) {
    trainer.say = [](const std::string& line) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    };
  }
  PLATEAU_RETURN_IF_ERROR(RunTraining(trainer, *backend, *world, on_step));
  if (f.rank == 0 && first >= 0) {
    std::printf(
        "summary: loss %.17g -> %.17g over %lld steps%s; %.0f tok/s, %.2f GFLOP/s (model), %.1f s;\n"
        "         device peaks per live set (rank 0): %s (total %.2f MiB of the %lld MiB arena)\n",
        first, last, static_cast<long long>(ran),
        ran == f.steps ? "" : absl::StrCat(" (this run, resumed; the job's ", f.steps, ")").c_str(), tokens / seconds,
        flops / seconds / 1e9, seconds, Peaks(peak).c_str(), peak.total_peak / 1048576.0,
        static_cast<long long>(f.device_mb));
    if (host_peak.total_peak > 0 || f.host_mb > 0) {
      std::printf("         host peaks per live set (rank 0): %s (total %.2f MiB; %s)\n",
                  host_peak.total_peak > 0 ? Peaks(host_peak).c_str() : "none",
                  host_peak.total_peak / 1048576.0,
                  f.host_mb > 0 ? absl::StrCat("host memory cap ", f.host_mb, " MiB").c_str() : "uncapped");
    }
  }
  return absl::OkStatus();
}

std::vector<pid_t> g_children;
void Forward(int sig) {
  for (pid_t p : g_children) kill(-p, sig);
}

int Launch(const Flags& f, int argc, char** argv) {
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) {
    std::fprintf(stderr, "plateau_train: cannot find own binary: %s\n", ec.message().c_str());
    return 1;
  }
  // The ranks' rendezvous directory: a new one (mkdtemp), never one a
  // killed launcher of a reused pid left behind with stale addresses.
  std::string dir = (std::filesystem::temp_directory_path() / "plateau-train-XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) {
    std::fprintf(stderr, "plateau_train: cannot make a temporary directory (%s): %s\n", dir.c_str(),
                 std::strerror(errno));
    return 1;
  }
  signal(SIGINT, Forward);
  signal(SIGTERM, Forward);
  for (int64_t r = 0; r < f.ranks; ++r) {
    std::vector<std::string> args = {self};
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(absl::StrCat("--rank=", r));
    args.push_back(absl::StrCat("--store_dir=", dir));
    std::vector<char*> cargv;
    for (auto& a : args) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);  // its own process group
    posix_spawnattr_setpgroup(&attr, 0);
    pid_t pid;
    int rc = posix_spawn(&pid, self.c_str(), nullptr, &attr, cargv.data(), environ);
    posix_spawnattr_destroy(&attr);
    if (rc != 0) {
      std::fprintf(stderr, "plateau_train: cannot start rank %lld\n", static_cast<long long>(r));
      Forward(SIGTERM);
      return 1;
    }
    g_children.push_back(pid);
  }
  int failures = 0;
  for (size_t i = 0; i < g_children.size(); ++i) {
    int status = 0;
    while (waitpid(g_children[i], &status, 0) < 0 && errno == EINTR) {
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    ++failures;
    if (WIFSIGNALED(status)) {
      std::fprintf(stderr, "plateau_train: rank %zu killed by signal %d\n", i, WTERMSIG(status));
    } else {
      std::fprintf(stderr, "plateau_train: rank %zu exited with code %d\n", i, WEXITSTATUS(status));
    }
    Forward(SIGTERM);  // one rank failing fails the job; the rest would hang
  }
  std::filesystem::remove_all(dir, ec);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  auto flags = plateau::Parse(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "plateau_train: %s\n", std::string(flags.status().message()).c_str());
    return 2;
  }
  if (flags->rank < 0) {
    // Refuse an inconsistent job once, before starting any rank.
    // The layout and every schedule's options, named as in a job spec.
    absl::Status valid = plateau::ValidateStepShape(flags->trainer.step);
    if (!valid.ok()) {
      std::fprintf(stderr, "plateau_train: %s\n", std::string(valid.message()).c_str());
      return 2;
    }
    return plateau::Launch(*flags, argc, argv);
  }
  absl::Status s = plateau::RunRank(*flags);
  if (!s.ok()) {
    std::fprintf(stderr, "[rank %lld] %s\n", static_cast<long long>(flags->rank), s.ToString().c_str());
    return 1;
  }
  return 0;
}
