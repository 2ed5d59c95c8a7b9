// plateau_rank: one rank of a job, started by the worker agent in its own
// process group. Reads the job spec, creates the backend and the world
// communicator (rendezvous through the coordinator's store), runs the
// training loop and reports each step as a plateau.v1.RankOutput JSON line
// on stdout; human-readable progress and errors go to stderr. Exit codes
// are worker/rank_protocol.h's (3: out of memory, naming the live set);
// the code is said (RankOutput.exiting) before the teardown, which the
// agent bounds (AgentOptions.teardown).
//
//   plateau_rank --coordinator=HOST:PORT --job_id=job-3 --attempt=0 --rank=1
//       --spec_file=PATH (binary plateau.v1.JobSpec) --kv_prefix=job-3/attempt-0
//       [--hostname=127.0.0.1] [--device_index=0]
//       [--token_file=PATH] [--tls_ca_file=PATH] [--tls_client_cert_file=PATH --tls_client_key_file=PATH]
//       (the agent's: how to reach the coordinator)
//       [--device_peak_flops=0] [--device_peak_bf16_flops=0]  (the agent's MFU peaks; 0: the table's)
//
// Devices: a CUDA rank is started with CUDA_VISIBLE_DEVICES naming its GPU
// alone and --device_index=0 (worker/device_slots.h); its backend and its
// NCCL communicator both use that device. The NCCL unique id meets the
// other ranks through the coordinator's store, like Gloo's addresses.
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/connection.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/model/precision.h"
#include "plateau/v1/worker.pb.h"
#include "proto/timestamps.h"
#include "worker/assignment.h"
#include "worker/calibration.h"
#include "worker/calibration_measure.h"
#include "worker/device_telemetry.h"
#include "worker/grpc_store.h"
#include "worker/job_spec.h"
#include "worker/live_set_proto.h"
#include "worker/memory_timeline_proto.h"
#include "worker/rank_communicator.h"
#include "worker/rank_lease.h"
#include "worker/rank_protocol.h"
#include "worker/trainer.h"

namespace plateau {
namespace {

std::string ToJsonLine(const v1::RankOutput& out) {
  std::string json;
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = false;
  if (!google::protobuf::util::MessageToJsonString(out, &json, opts).ok()) return "";
  return json;
}

void Emit(const v1::RankOutput& out) {
  std::string json = ToJsonLine(out);
  // A step whose memory timeline would not fit the agent's line is sent
  // without it (kernels/memory_timeline.h bounds it well below; this is the
  // guard, not the plan).
  if (json.size() + 1 > kMaxRankOutputLineBytes && out.has_step() && out.step().has_memory_timeline()) {
    std::fprintf(stderr, "memory timeline of step %lld left out: %zu bytes, over a report line's %zu\n",
                 static_cast<long long>(out.step().step()), json.size(), kMaxRankOutputLineBytes);
    v1::RankOutput without = out;
    without.mutable_step()->clear_memory_timeline();
    json = ToJsonLine(without);
  }
  if (json.empty()) return;
  std::printf("%s\n", json.c_str());
  std::fflush(stdout);
}

int ExitCodeFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kResourceExhausted:
      return kRankExitOutOfMemory;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
      return kRankExitInvalidJob;
    default:
      return kRankExitError;
  }
}

// Says that this rank's work is over and it exits with `code` once its
// teardown (the destructors after Main's return) is done; returns `code`.
// Its agent kills it if that teardown hangs (RankExiting).
int Exiting(int code) {
  v1::RankOutput out;
  out.mutable_exiting()->set_exit_code(code);
  Emit(out);
  return code;
}

int Fail(int64_t rank, const absl::Status& s) {
  v1::RankOutput out;
  v1::RankError* e = out.mutable_error();
  e->set_code(absl::StatusCodeToString(s.code()));
  e->set_message(std::string(s.message()));
  // The refused allocation travels as data (a payload of the status that
  // MemorySpace::Allocate made), never parsed back out of the message.
  if (std::optional<OutOfMemoryInfo> oom = OutOfMemoryInfoOf(s)) {
    e->set_live_set(std::string(LiveSetName(oom->live_set)));
    v1::OutOfMemory* o = e->mutable_out_of_memory();
    o->set_live_set(ToProto(oom->live_set));
    o->set_space(oom->space);
    o->set_bytes_requested(oom->requested);
    o->set_bytes_free(oom->free);
    o->set_cap_bytes(oom->cap);
  }
  Emit(out);
  std::fprintf(stderr, "rank %lld failed: %s\n", static_cast<long long>(rank), s.ToString().c_str());
  return Exiting(ExitCodeFor(s));
}

// plateau_rank --calibrate_dir=DIR --backend=cpu|cuda [--device_index=N]:
// the worker agent's calibration (worker/calibration.h), measured by the
// binary that trains, cached in DIR. Prints one line, "measured in X s" or
// "read from the cache"; exits 0, or 1 with the error on stderr.
int Calibrate(const std::string& dir, const std::string& backend_name, const std::string& device,
              const std::string& threads) {
  absl::StatusOr<BackendKind> kind = ParseBackendKind(backend_name);
  int index = 0, cpu_threads = 0;
  if (!kind.ok() || !absl::SimpleAtoi(device, &index) || !absl::SimpleAtoi(threads, &cpu_threads) || cpu_threads < 0) {
    std::fprintf(stderr,
                 "plateau_rank: --calibrate_dir needs --backend=cpu|cuda, an integer --device_index and "
                 "--calibrate_threads >= 0\n");
    return kRankExitUsage;
  }
  BackendOptions bo;
  bo.kind = *kind;
  bo.device_index = index;
  // CPU: the threads one rank's share of the node is (the agent passes
  // cores / slots: its ranks run at once, each with a pool of every core).
  bo.cpu_threads = cpu_threads;
  // Fixed, so that the backend's description (part of the cache's key)
  // does not change with a job's cap; the measurement needs under 48 MiB.
  if (bo.kind == BackendKind::kCpu) bo.device_memory_bytes = int64_t{64} << 20;
  auto backend = Backend::Create(bo);
  if (!backend.ok()) {
    std::fprintf(stderr, "plateau_rank: calibration: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  std::error_code ec;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  bool measured = false;
  // The binary and the libraries it computes with (a driver or BLAS
  // upgrade changes the rates as a rebuild does).
  std::vector<std::string> files = {self};
  for (std::string& lib : LoadedComputeLibraries()) files.push_back(std::move(lib));
  auto c = LoadOrMeasureCalibration(
      dir, bo.kind, (*backend)->Describe(), BinaryFingerprint(files), [&] { return MeasureCalibration(**backend); },
      &measured);
  if (!c.ok()) {
    std::fprintf(stderr, "plateau_rank: calibration: %s\n", c.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", measured ? absl::StrFormat("measured in %.2f s", c->measure_seconds()).c_str()
                               : "read from the cache");
  return 0;
}

// plateau_rank --probe_devices=N --backend=cuda: the agent's question
// when its --device_memory_bytes is `auto` (worker/agent_main.cc). Prints
// "device I: NAME, TOTAL bytes" for each of the first N GPUs this process
// sees, and fails (naming the device) if one cannot be opened: --devices
// larger than the GPUs the worker may use is said at start, not at a job's.
int ProbeDevices(const std::string& backend_name, const std::string& count) {
  absl::StatusOr<BackendKind> kind = ParseBackendKind(backend_name);
  int n = 0;
  if (!kind.ok() || *kind != BackendKind::kCuda || !absl::SimpleAtoi(count, &n) || n < 1) {
    std::fprintf(stderr, "plateau_rank: --probe_devices needs a count >= 1 and --backend=cuda\n");
    return kRankExitUsage;
  }
  for (int i = 0; i < n; ++i) {
    BackendOptions bo;
    bo.kind = *kind;
    bo.device_index = i;
    absl::StatusOr<std::unique_ptr<Backend>> backend = Backend::Create(bo);
    absl::StatusOr<DeviceView> view = backend.ok() ? (*backend)->QueryDevice() : backend.status();
    if (!view.ok()) {
      std::fprintf(stderr, "device %d: %s\n", i, view.status().ToString().c_str());
      return 1;
    }
    std::printf("device %d: %s, %lld bytes\n", i, view->name.c_str(), static_cast<long long>(view->total_bytes));
    std::fflush(stdout);  // in order with anything on stderr, which shares the agent's log
  }
  return 0;
}

int Main(int argc, char** argv) {
  // The agent's death takes its ranks with it: nothing is left orphaned.
  // An agent that died before the request is seen after it: the parent is
  // no longer the agent, whose pid it said (PLATEAU_AGENT_PID; without it,
  // run by hand, an orphan's parent is pid 1). Not pid 1 alone: an agent
  // that is a container's first process is pid 1 itself, and every rank
  // and calibration of it exited here at once.
  const char* agent = std::getenv("PLATEAU_AGENT_PID");
  int64_t agent_pid = 0;
  const bool agent_said = agent != nullptr && absl::SimpleAtoi(agent, &agent_pid);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (const pid_t parent = getppid(); agent_said ? parent != agent_pid : parent == 1) {
    // Said, for a --rank_binary wrapper that does not exec (a profiler, a
    // script): its ranks would otherwise fail without a word.
    std::fprintf(stderr,
                 "plateau_rank: my parent is pid %d, not the agent that started me (%s): it is gone, or "
                 "something between us did not exec; exiting\n",
                 static_cast<int>(parent), agent_said ? absl::StrCat("pid ", agent_pid).c_str() : "pid unknown");
    return kRankExitError;
  }
  std::map<std::string, std::string> f = {
      {"coordinator", ""},   {"job_id", ""},        {"attempt", "0"},           {"rank", ""},
      {"spec_file", ""},     {"kv_prefix", ""},     {"hostname", "127.0.0.1"},  {"device_index", "0"},
      {"calibrate_dir", ""}, {"backend", "cpu"},    {"device_peak_flops", "0"}, {"device_peak_bf16_flops", "0"},
      {"lease_fd", "-1"},    {"probe_devices", ""}, {"calibrate_threads", "0"}, {"allowed_paths", ""}};
  for (const char* name : kConnectionFileFlags) f[name] = "";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    size_t eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos || !f.count(arg.substr(2, eq - 2))) {
      std::fprintf(stderr, "plateau_rank: bad argument '%s' (started by plateau_worker)\n", arg.c_str());
      return kRankExitUsage;
    }
    f[arg.substr(2, eq - 2)] = arg.substr(eq + 1);
  }
  if (!f["calibrate_dir"].empty()) {
    return Calibrate(f["calibrate_dir"], f["backend"], f["device_index"], f["calibrate_threads"]);
  }
  if (!f["probe_devices"].empty()) return ProbeDevices(f["backend"], f["probe_devices"]);
  int64_t rank = -1, attempt = 0, device_index = 0;
  if (!absl::SimpleAtoi(f["rank"], &rank) || rank < 0 || !absl::SimpleAtoi(f["attempt"], &attempt) ||
      !absl::SimpleAtoi(f["device_index"], &device_index) || f["coordinator"].empty() ||
      f["spec_file"].empty() || f["kv_prefix"].empty()) {
    std::fprintf(stderr, "plateau_rank: --rank, --coordinator, --spec_file and --kv_prefix are required\n");
    return kRankExitUsage;
  }
  // The agent's lease (worker/rank_lease.h): this rank stops itself when
  // the lease is overdue and its agent has not stopped it. Run by hand (no
  // --lease_fd), nothing watches.
  int64_t lease_fd = -1;
  if (!absl::SimpleAtoi(f["lease_fd"], &lease_fd) || lease_fd < -1) {
    std::fprintf(stderr, "plateau_rank: --lease_fd must be a descriptor number or -1\n");
    return kRankExitUsage;
  }
  std::unique_ptr<RankLease> lease;
  if (lease_fd >= 0) {
    auto attached = RankLease::Attach(static_cast<int>(lease_fd));
    if (!attached.ok()) return Fail(rank, attached.status());
    lease = std::move(*attached);
    lease->Watch(kRankLeaseGrace, absl::Milliseconds(100), [rank](absl::Duration stopped, int64_t overdue_ns) {
      // Written only now (while stopped, the pipe's reader, the agent, may
      // have been the one not answering), and on a thread of its own, so
      // that the watchdog never waits on the pipe.
      std::thread([=] {
        std::fprintf(stderr,
                     "plateau_rank: rank %lld stopped itself for %s: its agent's lease was %s overdue and the "
                     "agent had not stopped it; resumed by the agent\n",
                     static_cast<long long>(rank),
                     absl::FormatDuration(absl::Trunc(stopped, absl::Milliseconds(1))).c_str(),
                     absl::FormatDuration(absl::Trunc(absl::Nanoseconds(overdue_ns), absl::Milliseconds(1))).c_str());
      }).detach();
    });
  }
  v1::JobSpec spec;
  {
    std::ifstream in(f["spec_file"], std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    if (!in || !spec.ParseFromString(bytes.str())) {
      return Fail(rank, absl::InvalidArgumentError(absl::StrCat("spec_file: cannot read ", f["spec_file"])));
    }
  }
  // The coordinator chooses the `auto` settings once for every rank
  // (worker/auto_spec.h): a rank choosing its own could disagree with its
  // peers and with the admitted plan.
  if (HasAutoSettings(spec)) {
    return Fail(rank, absl::FailedPreconditionError(
                          "schedule: the spec still leaves settings `auto`; the coordinator sends their chosen "
                          "values (MemoryPlan.auto_settings), a rank never chooses them"));
  }
  // The agent's --allowed_paths, checked here, before anything is opened
  // (the nearest the check can be to the opens; and not on the agent's
  // heartbeat thread, where a hung mount's stat would lapse its lease).
  absl::StatusOr<std::vector<std::string>> allowed = AllowedPaths(f["allowed_paths"]);
  // The worker's list, not the job's fault: an error, not INVALID.
  if (!allowed.ok()) return Fail(rank, absl::InternalError(allowed.status().message()));
  if (absl::Status s = CheckSpecPaths(spec, *allowed); !s.ok()) return Fail(rank, s);
  PeakOverrides peaks;
  if (!absl::SimpleAtod(f["device_peak_flops"], &peaks.fp32_flops) || peaks.fp32_flops < 0 ||
      !absl::SimpleAtod(f["device_peak_bf16_flops"], &peaks.bf16_flops) || peaks.bf16_flops < 0) {
    std::fprintf(stderr, "plateau_rank: --device_peak_flops and --device_peak_bf16_flops must be numbers >= 0\n");
    return kRankExitUsage;
  }
  auto trainer = ToTrainerOptions(spec);
  if (!trainer.ok()) return Fail(rank, trainer.status());
  // A restarted attempt fences the checkpoints of the one it replaces.
  if (!f["job_id"].empty()) {
    trainer->fence_job = f["job_id"];
    trainer->fence_attempt = attempt;
  }
  // Said once, by rank 0 (every rank resumes from the same checkpoint).
  if (rank == 0)
    trainer->say = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  auto bo = ToBackendOptions(spec);
  if (!bo.ok()) return Fail(rank, bo.status());
  bo->device_index = static_cast<int>(device_index);
  auto backend = Backend::Create(*bo);
  if (!backend.ok()) return Fail(rank, backend.status());
  ConnectionOptions coordinator;
  coordinator.address = f["coordinator"];
  coordinator.files = ConnectionFilesFromFlags(f);
  auto store = GrpcStore::Create(coordinator, static_cast<int>(rank));
  if (!store.ok()) return Fail(rank, store.status());
  // Gloo or NCCL by the spec's backend; either way the rendezvous (Gloo's
  // addresses, NCCL's unique id under "<kv_prefix>/world/nccl_unique_id")
  // goes through the coordinator's store.
  auto comm_options = ToCommunicatorOptions(spec);
  if (!comm_options.ok()) return Fail(rank, comm_options.status());
  CommunicatorOptions co = *std::move(comm_options);
  co.rank = static_cast<int>(rank);
  co.store = std::shared_ptr<KeyValueStore>(std::move(*store));
  co.prefix = f["kv_prefix"];
  co.hostname = f["hostname"];
  co.device_index = static_cast<int>(device_index);
  auto world = CreateCommunicator(co);
  if (!world.ok()) return Fail(rank, world.status());
  // The caps as the backend's spaces hold them (not as the spec asked):
  // what the job's log shows is what this rank enforces.
  const int64_t host_cap = (*backend)->host().cap_bytes();
  std::fprintf(stderr, "%s; host memory cap %s; joined the world of %d ranks\n",
               (*backend)->Describe().c_str(),
               host_cap == MemorySpace::kUncapped ? "none" : absl::StrCat(host_cap, " bytes").c_str(),
               (*world)->size());
  // The settings an `auto` field may stand for, as this rank runs them.
  const StepOptions& so = trainer->step;
  std::vector<std::string> settings;
  if (so.dispatch.kind == DispatchOptions::Kind::kPipelinedLlep) {
    settings.push_back(absl::StrCat("pipelined_llep.chunk_tokens=", so.dispatch.pipelined.chunk_tokens));
  }
  if (so.projection.kind == ProjectionOptions::Kind::kRingDtp) {
    settings.push_back(absl::StrCat("ring_dtp.strip=", so.projection.strip));
  }
  if (so.checkpoints.kind == CheckpointOptions::Kind::kSco) {
    settings.push_back(absl::StrCat("sco.host_budget_bytes=", so.checkpoints.host_budget_bytes));
  }
  if (so.optimizer_placement.kind == OptimizerPlacementOptions::Kind::kOffloadStream) {
    settings.push_back(absl::StrCat("offload_stream_adamw.bucket_params=", so.optimizer_placement.bucket_params));
  }
  if (!settings.empty()) std::fprintf(stderr, "settings: %s\n", absl::StrJoin(settings, " ").c_str());
  const int64_t log_every = std::max<int64_t>(1, spec.steps() / 20);
  int64_t ran = 0, last_step = 0;  // steps this run, and the last one's number
  auto on_step = [&](const StepReport& r) {
    ++ran;
    last_step = r.stats.step;
    v1::RankOutput out;
    v1::StepTelemetry* t = out.mutable_step();
    t->set_rank(static_cast<int>(rank));
    t->set_attempt(static_cast<int>(attempt));
    t->set_step(r.stats.step);
    t->set_total_steps(spec.steps());
    t->set_loss(r.stats.loss);
    t->set_grad_norm(r.stats.grad_norm);
    t->set_tokens(r.tokens);
    t->set_model_flops(r.model_flops);
    t->set_seconds(r.seconds);
    Now(t->mutable_end_time());
    t->set_lr(r.lr);
    if (r.has_validation) t->set_validation_loss(r.validation_loss);
    for (int i = 0; i < kNumLiveSets; ++i) {
      v1::LiveSetBytes* ls = t->add_peak();
      ls->set_live_set(std::string(LiveSetName(static_cast<LiveSet>(i))));
      ls->set_bytes(r.stats.device.peak[i]);
    }
    t->set_peak_total_bytes(r.stats.device.total_peak);
    for (int i = 0; i < kNumLiveSets; ++i) {
      v1::LiveSetBytes* ls = t->add_host_peak();
      ls->set_live_set(std::string(LiveSetName(static_cast<LiveSet>(i))));
      ls->set_bytes(r.stats.host.peak[i]);
    }
    t->set_host_peak_total_bytes(r.stats.host.total_peak);
    SetDeviceTelemetry((*backend)->QueryDevice(), r.model_flops, static_cast<int>(spec.layout().ranks()), r.seconds,
                       trainer->step.precision == Precision::kBf16Mixed, peaks, t);
    if (r.timeline != nullptr) {
      *t->mutable_memory_timeline() =
          MemoryTimelineToProto(*r.timeline, static_cast<int>(rank), r.stats.step, static_cast<int>(attempt),
                                (*backend)->device().cap_bytes(), (*backend)->host().cap_bytes());
    }
    Emit(out);
    if (!r.kernels.empty()) std::fprintf(stderr, "kernels: %s\n", r.kernels.c_str());
    if (rank == 0 && r.has_validation) {
      std::fprintf(stderr, "step %lld/%lld validation loss %.17g\n", static_cast<long long>(r.stats.step),
                   static_cast<long long>(spec.steps()), r.validation_loss);
    }
    if (rank == 0 && (r.stats.step % log_every == 0 || r.stats.step == 1)) {
      std::fprintf(stderr, "step %lld/%lld loss %.17g |g| %.3f lr %.4g %.0f tok/s\n",
                   static_cast<long long>(r.stats.step), static_cast<long long>(spec.steps()), r.stats.loss,
                   r.stats.grad_norm, r.lr, r.tokens / r.seconds);
    }
  };
  absl::Status s = RunTraining(*trainer, **backend, **world, on_step);
  if (!s.ok()) return Fail(rank, s);
  // A resumed run ran fewer than the job's steps (none, resumed at the last).
  if (ran == spec.steps()) {
    std::fprintf(stderr, "finished %lld steps\n", static_cast<long long>(spec.steps()));
  } else {
    std::fprintf(stderr, "finished: ran %lld of the job's %lld steps (resumed%s)\n", static_cast<long long>(ran),
                 static_cast<long long>(spec.steps()),
                 ran > 0 ? absl::StrCat(", steps ", last_step - ran + 1, " to ", last_step).c_str() : " at its last");
  }
  return Exiting(kRankExitOk);
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) { return plateau::Main(argc, argv); }
