// plateauctl: the command line of the Plateau service.
//
//   plateauctl [--coordinator=HOST:PORT] [--output=text|json]
//       [--token_file=PATH] [--tls_ca_file=PATH] COMMAND ...
//
// Exit codes: 0 success (a job that SUCCEEDED); 1 the job FAILED;
// 2 bad usage or a refused request (e.g. an invalid spec); 3 the job was
// CANCELLED; 4 the coordinator could not be reached; 5 the memory plan does
// not fit the device or host cap (plan, submit).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/chart/png.h"
#include "client/client.h"
#include "client/plan_table.h"
#include "client/spec_file.h"
#include "proto/does_not_fit.h"
#include "timeline/memory_chart.h"
#include "timeline/png_chart.h"
#include "timeline/text_chart.h"
#include "google/protobuf/util/json_util.h"

namespace plateau {
namespace {

constexpr char kUsage[] = R"(usage: plateauctl [--coordinator=HOST:PORT] [--output=text|json]
                  [--token_file=PATH] [--tls_ca_file=PATH] COMMAND ...

commands
  submit SPEC [--validate-only] [--wait]   submit a job (text-format plateau.v1.JobSpec);
                                           prints its plan; --wait watches it to the end
  plan SPEC                                the memory plan per live set, nothing created
  get JOB                                  one job
  list [--state=S[,S...]] [--page_size=N] [--page_token=T] [--all]
  watch JOB [--from=INDEX]                 live progress to the end, one event per step of the
                                           whole job; exits with its outcome
  logs JOB [-f] [--from=INDEX]             log lines of every rank; -f follows
  cancel JOB
  delete JOB                               a finished job, its events, logs and series (a live one:
                                           cancel it first)
  workers                                  the registered workers: id, name, address, backend,
                                           slots, memory, last heartbeat, running jobs
  memory JOB [--rank=R] [--width=N]        the job's latest memory timeline (rank R, default
         [--png=FILE]                      0) as a terminal chart per memory space (or a PNG); the
                                           page http://METRICS/jobs/JOB/memory draws it

The coordinator defaults to $PLATEAU_COORDINATOR, else 127.0.0.1:7070.
--token_file (default $PLATEAU_TOKEN_FILE): a file holding the coordinator's bearer
token, sent on every call; --tls_ca_file (default $PLATEAU_TLS_CA_FILE): the PEM CA
that signed the coordinator's certificate, which turns TLS on.
Exit codes: 0 ok / SUCCEEDED, 1 FAILED, 2 usage or refused request, 3 CANCELLED,
4 coordinator unreachable, 5 the job's memory plan does not fit its device or
host cap (plan, submit: RESOURCE_EXHAUSTED).
)";

constexpr int kExitOk = 0, kExitFailed = 1, kExitUsage = 2, kExitCancelled = 3, kExitUnreachable = 4,
              kExitDoesNotFit = 5;

struct Options {
  std::string coordinator;
  std::string token_file, tls_ca_file;  // client/connection.h
  bool json = false;
  std::string command;
  std::vector<std::string> args;  // positional
  std::map<std::string, std::string> flags;
};

int Report(const absl::Status& s) {
  std::fprintf(stderr, "plateauctl: %s%s\n",
               s.code() == absl::StatusCode::kUnavailable ? ""
                                                          : absl::StrCat(absl::StatusCodeToString(s.code()), ": ").c_str(),
               std::string(s.message()).c_str());
  return s.code() == absl::StatusCode::kUnavailable ? kExitUnreachable : kExitUsage;
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = false;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::string MiB(int64_t b) { return absl::StrFormat("%.2f", b / 1048576.0); }

// The file's spec; a parse error names the file, line, column and field
// (client/spec_file.h).
absl::StatusOr<v1::JobSpec> ReadSpec(const std::string& path) {
  auto parsed = ReadSpecFile(path);
  if (!parsed.ok()) return parsed.status();
  v1::JobSpec spec = *std::move(parsed);
  // Paths are read on the worker's node: make relative ones absolute here.
  auto absolute = [](std::string* p) {
    if (!p->empty() && (*p)[0] != '/') *p = std::filesystem::absolute(*p).lexically_normal().string();
  };
  if (spec.data().has_text()) absolute(spec.mutable_data()->mutable_text()->mutable_path());
  if (spec.data().has_shards()) {
    for (std::string& p : *spec.mutable_data()->mutable_shards()->mutable_paths()) absolute(&p);
  }
  if (!spec.checkpoint().directory().empty()) absolute(spec.mutable_checkpoint()->mutable_directory());
  return spec;
}

// "fits", or "DOES NOT FIT (short by X MiB)", for `total` bytes against
// `cap` (0: uncapped, checked when scheduled).
std::string Fit(int64_t total, int64_t cap) {
  if (cap == 0 || total <= cap) return "fits";
  return absl::StrCat("DOES NOT FIT (short by ", MiB(total - cap), " MiB)");
}

void PrintPlan(const v1::MemoryPlan& p) {
  std::printf("memory plan per rank (device bytes per live set):\n");
  for (const v1::LiveSetBytes& ls : p.live_sets()) {
    std::printf("  %-12s %12lld  (%s MiB)\n", ls.live_set().c_str(), static_cast<long long>(ls.bytes()),
                MiB(ls.bytes()).c_str());
  }
  std::printf("  %-12s %12lld  (%s MiB) of a %s MiB device: %s\n", "total",
              static_cast<long long>(p.total_bytes()), MiB(p.total_bytes()).c_str(),
              p.device_memory_bytes() ? MiB(p.device_memory_bytes()).c_str() : "whole",
              Fit(p.total_bytes(), p.device_memory_bytes()).c_str());
  // Host lines only when there is something to say: a host term, or a cap.
  const int64_t host_cap = p.host_memory_bytes();
  const std::string cap =
      host_cap > 0 ? absl::StrCat("a host cap of ", host_cap, " bytes (", MiB(host_cap), " MiB)") : "no host cap";
  if (p.host_total_bytes() > 0) {
    std::printf("memory plan per rank (host bytes per live set; the others hold none):\n");
    for (const v1::LiveSetBytes& ls : p.host_live_sets()) {
      if (ls.bytes() == 0) continue;
      std::printf("  %-12s %12lld  (%s MiB)\n", ls.live_set().c_str(), static_cast<long long>(ls.bytes()),
                  MiB(ls.bytes()).c_str());
    }
    std::printf("  %-12s %12lld  (%s MiB) of %s: %s\n", "total", static_cast<long long>(p.host_total_bytes()),
                MiB(p.host_total_bytes()).c_str(), cap.c_str(), Fit(p.host_total_bytes(), host_cap).c_str());
  } else if (host_cap > 0) {
    std::printf("host memory per rank: none planned, of %s: fits\n", cap.c_str());
  }
  std::printf("  %lld tokens per rank, %lld parameters (%lld active), %.3g model FLOPs per step\n",
              static_cast<long long>(p.tokens_per_rank()), static_cast<long long>(p.parameters()),
              static_cast<long long>(p.active_parameters()), p.model_flops_per_step());
  for (const std::string& n : p.notes()) std::printf("  note: %s\n", n.c_str());
  std::printf("%s", FormatAutoSettings(p).c_str());
  std::printf("%s", FormatWhatIf(p).c_str());
}

std::string Time(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0) return "-";
  return absl::FormatTime("%H:%M:%S", absl::FromUnixSeconds(t.seconds()), absl::LocalTimeZone());
}

void PrintJob(const v1::Job& j) {
  std::printf("%s  %s%s\n", j.id().c_str(), v1::JobState_Name(j.state()).c_str(),
              j.spec().name().empty() ? "" : absl::StrCat("  (", j.spec().name(), ")").c_str());
  if (!j.state_reason().empty()) std::printf("  reason:   %s\n", j.state_reason().c_str());
  if (j.unschedulable()) {
    std::printf("  pending:  unschedulable since %s\n", Time(j.unschedulable_since()).c_str());
  }
  if (j.has_failure()) {
    const v1::Failure& f = j.failure();
    std::printf("  failure:  %s", v1::Failure::Kind_Name(f.kind()).c_str());
    if (!f.live_set().empty()) std::printf(" live_set=%s", f.live_set().c_str());
    if (f.kind() == v1::Failure::RANK_CRASHED || f.kind() == v1::Failure::OUT_OF_MEMORY ||
        f.kind() == v1::Failure::INVALID) {
      std::printf(" rank=%d exit_code=%d signal=%d", f.rank(), f.exit_code(), f.signal());
    }
    if (f.kind() == v1::Failure::RANK_HUNG) std::printf(" rank=%d", f.rank());
    if (!f.worker_id().empty()) std::printf(" worker=%s", f.worker_id().c_str());
    std::printf("\n");
  }
  const v1::Progress& p = j.progress();
  std::printf("  progress: step %lld/%lld, loss %.4f, %.0f tokens/s, %.4f TFLOP/s\n",
              static_cast<long long>(p.step()), static_cast<long long>(p.total_steps()), p.loss(),
              p.tokens_per_second(), p.model_flops_per_second() / 1e12);
  std::printf("  layout:   %lld ranks on %lld node(s), backend %s; attempt %d\n",
              static_cast<long long>(j.spec().layout().ranks()),
              static_cast<long long>(j.spec().layout().nodes() ? j.spec().layout().nodes() : 1),
              j.spec().backend() == v1::BACKEND_CUDA ? "cuda" : "cpu", j.attempt());
  std::printf("  times:    created %s, started %s, ended %s\n", Time(j.create_time()).c_str(),
              Time(j.start_time()).c_str(), Time(j.end_time()).c_str());
  std::printf("%s", FormatAutoSettings(j.plan()).c_str());
}

int ExitFor(v1::JobState s) {
  switch (s) {
    case v1::SUCCEEDED:
      return kExitOk;
    case v1::CANCELLED:
      return kExitCancelled;
    default:
      return kExitFailed;
  }
}

// The live progress view of `watch` and `submit --wait`.
int Watch(Client& client, const Options& o, const std::string& id, int64_t from) {
  auto job = client.GetJob(id);
  if (!job.ok()) return Report(job.status());
  const v1::MemoryPlan plan = job->plan();
  std::map<std::string, int64_t> planned;
  for (const auto& ls : plan.live_sets()) planned[ls.live_set()] = ls.bytes();
  const bool tty = !o.json && isatty(STDOUT_FILENO);
  const int64_t total = job->spec().steps();
  const int64_t every = std::max<int64_t>(1, total / 20);
  std::map<std::string, int64_t> peak, host_peak;  // largest over ranks and steps
  int64_t peak_total = 0, host_peak_total = 0;
  double first_loss = -1, last_loss = 0, tokens = 0, seconds = 0, flops = 0;
  int64_t last_step = 0;
  v1::JobState final_state = v1::JOB_STATE_UNSPECIFIED;
  v1::StateChange final_change;
  bool line_open = false;
  auto peaks_line = [&]() {
    std::vector<std::string> parts;
    for (const auto& ls : plan.live_sets()) {
      if (ls.bytes() == 0 && peak[ls.live_set()] == 0) continue;
      parts.push_back(absl::StrCat(ls.live_set(), " ", MiB(peak[ls.live_set()]), "/", MiB(ls.bytes())));
    }
    return absl::StrJoin(parts, "  ");
  };
  // Host lines only once the plan or a peak has a host term.
  auto show_host = [&] { return plan.host_total_bytes() > 0 || host_peak_total > 0; };
  auto host_peaks_line = [&]() {
    std::vector<std::string> parts;
    for (const auto& ls : plan.host_live_sets()) {
      if (ls.bytes() == 0 && host_peak[ls.live_set()] == 0) continue;
      parts.push_back(absl::StrCat(ls.live_set(), " ", MiB(host_peak[ls.live_set()]), "/", MiB(ls.bytes())));
    }
    return absl::StrJoin(parts, "  ");
  };
  absl::Status s = client.WatchJob(id, from, [&](const v1::JobEvent& e) {
    if (o.json) {
      std::printf("%s\n", Json(e).c_str());
      std::fflush(stdout);
    }
    if (e.has_state_change()) {
      const v1::StateChange& c = e.state_change();
      if (c.state() == v1::SUCCEEDED || c.state() == v1::FAILED || c.state() == v1::CANCELLED) {
        final_state = c.state();
        final_change = c;
      }
      if (!o.json) {
        if (line_open) std::printf("\n");
        line_open = false;
        std::printf("[%s] %s %s: %s\n", Time(e.time()).c_str(), id.c_str(),
                    v1::JobState_Name(c.state()).c_str(), c.reason().c_str());
        std::fflush(stdout);
      }
      return true;
    }
    // One event per step of the whole job (peaks already the maximum over
    // ranks); an older coordinator's database holds one per rank instead,
    // whose rank 0 stands for the step.
    v1::JobStepSummary t;
    if (e.has_job_step()) {
      t = e.job_step();
    } else if (e.has_step()) {
      const v1::StepTelemetry& r = e.step();
      t.set_step(r.step());
      t.set_loss(r.loss());
      t.set_tokens(r.tokens());
      t.set_model_flops(r.model_flops());
      t.set_seconds(r.seconds());
      *t.mutable_peak() = r.peak();
      t.set_peak_total_bytes(r.peak_total_bytes());
      *t.mutable_host_peak() = r.host_peak();
      t.set_host_peak_total_bytes(r.host_peak_total_bytes());
      if (r.rank() != 0) t.set_step(-1);  // peaks only
    } else {
      return true;
    }
    for (const auto& ls : t.peak()) peak[ls.live_set()] = std::max(peak[ls.live_set()], ls.bytes());
    peak_total = std::max(peak_total, t.peak_total_bytes());
    for (const auto& ls : t.host_peak()) host_peak[ls.live_set()] = std::max(host_peak[ls.live_set()], ls.bytes());
    host_peak_total = std::max(host_peak_total, t.host_peak_total_bytes());
    if (t.step() < 0) return true;
    if (first_loss < 0) first_loss = t.loss();
    last_loss = t.loss();
    last_step = t.step();
    tokens += t.tokens();
    seconds += t.seconds();
    flops += t.model_flops();
    if (o.json) return true;
    const bool show = tty || t.step() % every == 0 || t.step() == 1 || t.step() == total;
    if (!show) return true;
    const std::string line = absl::StrFormat(
        "step %5d/%d  loss %.4f  %6.0f tokens/s  %.4f TFLOP/s  peak/plan MiB: %s%s", t.step(), total, t.loss(),
        t.tokens() / t.seconds(), t.model_flops() / t.seconds() / 1e12, peaks_line(),
        show_host() ? absl::StrCat("  host: ", host_peaks_line()) : "");
    if (tty) {
      std::printf("\r\033[K%s", line.c_str());
      line_open = true;
    } else {
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
    return true;
  });
  if (line_open) std::printf("\n");
  if (!s.ok()) return Report(s);
  if (final_state == v1::JOB_STATE_UNSPECIFIED) {
    auto now = client.GetJob(id);
    if (!now.ok()) return Report(now.status());
    final_state = now->state();
  }
  if (!o.json) {
    std::printf("summary: %s %s", id.c_str(), v1::JobState_Name(final_state).c_str());
    if (final_change.has_failure()) {
      const v1::Failure& f = final_change.failure();
      std::printf(" (%s%s)", v1::Failure::Kind_Name(f.kind()).c_str(),
                  f.live_set().empty() ? "" : absl::StrCat(", live set ", f.live_set()).c_str());
    }
    std::printf("\n");
    if (first_loss >= 0 && seconds > 0) {
      std::printf("  loss %.17g -> %.17g over steps 1-%lld; %.0f tokens/s, %.4f TFLOP/s (model FLOPs)\n",
                  first_loss, last_loss, static_cast<long long>(last_step), tokens / seconds,
                  flops / seconds / 1e12);
      std::printf("  device peak per live set (largest over ranks) against the plan, MiB:\n");
      for (const auto& ls : plan.live_sets()) {
        const int64_t pk = peak[ls.live_set()];
        std::printf("    %-12s %9s / %9s%s\n", ls.live_set().c_str(), MiB(pk).c_str(), MiB(ls.bytes()).c_str(),
                    pk <= ls.bytes() ? ""
                    : ls.live_set() == "dispatch" ? "  above the balanced estimate (standard_ep has no bound)"
                                                  : "  OVER THE PLAN");
      }
      std::printf("    %-12s %9s / %9s of a %s MiB device\n", "total", MiB(peak_total).c_str(),
                  MiB(plan.total_bytes()).c_str(), MiB(plan.device_memory_bytes()).c_str());
      if (show_host()) {
        std::printf("  host peak per live set (largest over ranks) against the plan, MiB:\n");
        for (const auto& ls : plan.host_live_sets()) {
          const int64_t pk = host_peak[ls.live_set()];
          if (pk == 0 && ls.bytes() == 0) continue;
          std::printf("    %-12s %9s / %9s%s\n", ls.live_set().c_str(), MiB(pk).c_str(), MiB(ls.bytes()).c_str(),
                      pk <= ls.bytes() ? "" : "  OVER THE PLAN");
        }
        std::printf("    %-12s %9s / %9s %s\n", "total", MiB(host_peak_total).c_str(),
                    MiB(plan.host_total_bytes()).c_str(),
                    plan.host_memory_bytes() > 0
                        ? absl::StrCat("of a ", MiB(plan.host_memory_bytes()), " MiB host cap").c_str()
                        : "(no host cap)");
      }
    }
  }
  return ExitFor(final_state);
}

int Run(const Options& o) {
  ClientOptions co;
  co.address = o.coordinator;
  co.token_file = o.token_file;
  co.tls_ca_file = o.tls_ca_file;
  Client client(co);
  if (!client.status().ok()) return Report(client.status());
  auto need = [&](size_t n) {
    if (o.args.size() != n) {
      std::fprintf(stderr, "plateauctl %s: expected %zu argument(s), got %zu (see --help)\n", o.command.c_str(),
                   n, o.args.size());
      return false;
    }
    return true;
  };
  auto flag = [&](const std::string& name) { return o.flags.count(name) > 0; };
  for (const auto& [name, value] : o.flags) {
    static const std::map<std::string, std::set<std::string>> allowed = {
        {"submit", {"validate-only", "wait"}}, {"plan", {}}, {"get", {}},
        {"list", {"state", "page_size", "page_token", "all"}}, {"watch", {"from"}},
        {"logs", {"f", "follow", "from"}}, {"cancel", {}}, {"memory", {"rank", "width", "png"}},
        {"workers", {}}, {"delete", {}}};
    auto it = allowed.find(o.command);
    if (it == allowed.end()) {
      std::fprintf(stderr, "plateauctl: unknown command '%s' (see --help)\n", o.command.c_str());
      return kExitUsage;
    }
    if (!it->second.count(name)) {
      std::fprintf(stderr, "plateauctl %s: unknown flag --%s (see --help)\n", o.command.c_str(), name.c_str());
      return kExitUsage;
    }
  }
  int64_t from = 0;
  if (flag("from") && (!absl::SimpleAtoi(o.flags.at("from"), &from) || from < 0)) {
    std::fprintf(stderr, "plateauctl: --from: expected an event index >= 0\n");
    return kExitUsage;
  }
  if (o.command == "submit" || o.command == "plan") {
    if (!need(1)) return kExitUsage;
    auto spec = ReadSpec(o.args[0]);
    if (!spec.ok()) return Report(spec.status());
    if (o.command == "plan") {
      auto plan = client.PlanJob(*spec);
      if (!plan.ok()) return Report(plan.status());
      if (o.json) {
        std::printf("%s\n", Json(*plan).c_str());
      } else {
        PrintPlan(plan->plan());
      }
      // A plan that does not fit is an answer, but not a yes: scripts see it.
      return plan->plan().fits() ? kExitOk : kExitDoesNotFit;
    }
    auto resp = client.SubmitJob(*spec, flag("validate-only"));
    if (!resp.ok()) {
      const int rc = Report(resp.status());
      // Admission's refusal of a plan over a cap, or of `auto` settings of
      // which no value fits (worker/job_spec.h AdmitJob): by its type.
      const bool does_not_fit = DoesNotFitOf(resp.status()).has_value();
      return does_not_fit ? kExitDoesNotFit : rc;
    }
    if (o.json) {
      std::printf("%s\n", Json(*resp).c_str());
    } else {
      PrintPlan(resp->plan());
      if (flag("validate-only")) {
        std::printf("valid: nothing was created (--validate-only)\n");
      } else {
        std::printf("submitted %s: %s (%s)\n", resp->job().id().c_str(),
                    v1::JobState_Name(resp->job().state()).c_str(), resp->job().state_reason().c_str());
      }
    }
    std::fflush(stdout);
    if (flag("wait") && !flag("validate-only")) return Watch(client, o, resp->job().id(), 0);
    return kExitOk;
  }
  if (o.command == "get") {
    if (!need(1)) return kExitUsage;
    auto job = client.GetJob(o.args[0]);
    if (!job.ok()) return Report(job.status());
    if (o.json) {
      std::printf("%s\n", Json(*job).c_str());
    } else {
      PrintJob(*job);
    }
    return kExitOk;
  }
  if (o.command == "list") {
    if (!need(0)) return kExitUsage;
    v1::ListJobsRequest req;
    if (flag("state")) {
      for (absl::string_view s : absl::StrSplit(o.flags.at("state"), ',')) {
        v1::JobState st;
        if (!v1::JobState_Parse(absl::AsciiStrToUpper(s), &st) || st == v1::JOB_STATE_UNSPECIFIED) {
          std::fprintf(stderr, "plateauctl list: --state: '%s' is not a job state (PENDING, RUNNING, ...)\n",
                       std::string(s).c_str());
          return kExitUsage;
        }
        req.add_states(st);
      }
    }
    if (flag("page_size")) {
      int32_t n = 0;
      if (!absl::SimpleAtoi(o.flags.at("page_size"), &n)) {
        std::fprintf(stderr, "plateauctl list: --page_size: expected an integer\n");
        return kExitUsage;
      }
      req.set_page_size(n);
    }
    if (flag("page_token")) req.set_page_token(o.flags.at("page_token"));
    v1::ListJobsResponse all;
    do {
      auto page = client.ListJobs(req);
      if (!page.ok()) return Report(page.status());
      for (const v1::Job& j : page->jobs()) *all.add_jobs() = j;
      all.set_next_page_token(page->next_page_token());
      req.set_page_token(page->next_page_token());
    } while (flag("all") && !req.page_token().empty());
    if (o.json) {
      std::printf("%s\n", Json(all).c_str());
      return kExitOk;
    }
    std::printf("%-10s %-11s %-16s %-12s %s\n", "JOB", "STATE", "NAME", "STEP", "REASON");
    for (const v1::Job& j : all.jobs()) {
      std::printf("%-10s %-11s %-16s %-12s %s\n", j.id().c_str(), v1::JobState_Name(j.state()).c_str(),
                  j.spec().name().substr(0, 16).c_str(),
                  absl::StrCat(j.progress().step(), "/", j.spec().steps()).c_str(), j.state_reason().c_str());
    }
    if (!all.next_page_token().empty()) {
      std::printf("more: --page_token=%s (or --all)\n", all.next_page_token().c_str());
    }
    return kExitOk;
  }
  if (o.command == "watch") {
    if (!need(1)) return kExitUsage;
    return Watch(client, o, o.args[0], from);
  }
  if (o.command == "logs") {
    if (!need(1)) return kExitUsage;
    absl::Status s = client.GetJobLogs(o.args[0], flag("f") || flag("follow"), from, [&](const v1::LogEntry& l) {
      if (o.json) {
        std::printf("%s\n", Json(l).c_str());
      } else if (l.rank() < 0) {
        std::printf("[agent] %s\n", l.line().c_str());
      } else {
        std::printf("[rank %d] %s\n", l.rank(), l.line().c_str());
      }
      std::fflush(stdout);
      return true;
    });
    return s.ok() ? kExitOk : Report(s);
  }
  if (o.command == "memory") {
    if (!need(1)) return kExitUsage;
    int rank = 0, width = 64;
    if (flag("rank") && (!absl::SimpleAtoi(o.flags.at("rank"), &rank) || rank < 0)) {
      std::fprintf(stderr, "plateauctl memory: --rank: expected a rank number >= 0, got '%s'\n",
                   o.flags.at("rank").c_str());
      return kExitUsage;
    }
    if (flag("width") && (!absl::SimpleAtoi(o.flags.at("width"), &width) || width < 10 || width > 1000)) {
      std::fprintf(stderr, "plateauctl memory: --width: expected 10 to 1000 columns, got '%s'\n",
                   o.flags.at("width").c_str());
      return kExitUsage;
    }
    auto timeline = client.GetMemoryTimeline(o.args[0]);
    if (!timeline.ok()) return Report(timeline.status());
    if (o.json) {
      std::printf("%s\n", Json(*timeline).c_str());
      return kExitOk;
    }
    auto charts = MemoryCharts(*timeline, rank);
    if (!charts.ok()) return Report(charts.status());
    if (flag("png")) {
      const std::string& path = o.flags.at("png");
      if (path.empty()) {
        std::fprintf(stderr, "plateauctl memory: --png: expected a file name to write, got ''\n");
        return kExitUsage;
      }
      absl::Status written = chart::WritePng(MemoryChartsCanvas(*charts), path);
      if (!written.ok()) return Report(written);
      std::printf("wrote %s (%zu panel(s): %s)\n", path.c_str(), charts->size(),
                  charts->size() > 1 ? "device, host" : "device");
      return kExitOk;
    }
    for (size_t i = 0; i < charts->size(); ++i) {
      std::printf("%s%s", i > 0 ? "\n" : "", TerminalChart((*charts)[i], width).c_str());
    }
    return kExitOk;
  }
  if (o.command == "workers") {
    if (!need(0)) return kExitUsage;
    auto workers = client.ListWorkers();
    if (!workers.ok()) return Report(workers.status());
    if (o.json) {
      std::printf("%s\n", Json(*workers).c_str());
      return kExitOk;
    }
    std::printf("%-10s %-16s %-15s %-7s %-10s %-12s %-12s %-10s %s\n", "WORKER", "NAME", "ADDRESS", "BACKEND",
                "SLOTS", "DEVICE MiB", "HOST MiB", "HEARTBEAT", "JOBS");
    const absl::Time now = absl::Now();
    for (const v1::WorkerInfo& w : workers->workers()) {
      const absl::Time beat = absl::FromUnixSeconds(w.last_heartbeat().seconds()) +
                              absl::Nanoseconds(w.last_heartbeat().nanos());
      std::string jobs = absl::StrJoin(w.running_jobs(), ",");
      if (w.state() != "attached") jobs = absl::StrCat("(", w.state(), ") ", jobs);
      std::printf("%-10s %-16s %-15s %-7s %-10s %-12s %-12s %-10s %s\n", w.id().c_str(), w.name().substr(0, 16).c_str(),
                  w.address().substr(0, 15).c_str(), w.backend() == v1::BACKEND_CUDA ? "cuda" : "cpu",
                  absl::StrCat(w.slots_free(), "/", w.slots_total(), " free").c_str(),
                  MiB(w.device_memory_bytes()).c_str(),
                  w.host_memory_bytes() > 0 ? MiB(w.host_memory_bytes()).c_str() : "-",
                  absl::StrFormat("%.1fs ago", absl::ToDoubleSeconds(now - beat)).c_str(),
                  jobs.empty() ? "-" : jobs.c_str());
    }
    return kExitOk;
  }
  if (o.command == "delete") {
    if (!need(1)) return kExitUsage;
    absl::Status s = client.DeleteJob(o.args[0]);
    if (!s.ok()) return Report(s);
    if (o.json) {
      std::printf("{\"job_id\":\"%s\",\"deleted\":true}\n", o.args[0].c_str());
    } else {
      std::printf("%s deleted\n", o.args[0].c_str());
    }
    return kExitOk;
  }
  if (o.command == "cancel") {
    if (!need(1)) return kExitUsage;
    auto job = client.CancelJob(o.args[0]);
    if (!job.ok()) return Report(job.status());
    if (o.json) {
      std::printf("%s\n", Json(*job).c_str());
    } else {
      std::printf("%s %s: %s\n", job->id().c_str(), v1::JobState_Name(job->state()).c_str(),
                  job->state_reason().c_str());
    }
    return kExitOk;
  }
  std::fprintf(stderr, "plateauctl: unknown command '%s' (see --help)\n", o.command.c_str());
  return kExitUsage;
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  plateau::Options o;
  const char* env = std::getenv("PLATEAU_COORDINATOR");
  o.coordinator = env && *env ? env : "127.0.0.1:7070";
  const char* token = std::getenv("PLATEAU_TOKEN_FILE");
  o.token_file = token ? token : "";
  const char* ca = std::getenv("PLATEAU_TLS_CA_FILE");
  o.tls_ca_file = ca ? ca : "";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h" || arg == "help") {
      std::fputs(plateau::kUsage, stdout);
      return 0;
    }
    if (arg == "-f") arg = "--f";
    if (arg.rfind("--", 0) == 0) {
      const size_t eq = arg.find('=');
      const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      const std::string value = eq == std::string::npos ? "" : arg.substr(eq + 1);
      if (name == "coordinator") {
        o.coordinator = value;
      } else if (name == "token_file") {
        o.token_file = value;
      } else if (name == "tls_ca_file") {
        o.tls_ca_file = value;
      } else if (name == "output") {
        if (value != "json" && value != "text") {
          std::fprintf(stderr, "plateauctl: --output: expected text or json, got '%s'\n", value.c_str());
          return plateau::kExitUsage;
        }
        o.json = value == "json";
      } else {
        o.flags[name] = value;
      }
    } else if (o.command.empty()) {
      o.command = arg;
    } else {
      o.args.push_back(arg);
    }
  }
  if (o.command.empty()) {
    std::fputs(plateau::kUsage, stderr);
    return plateau::kExitUsage;
  }
  return plateau::Run(o);
}
