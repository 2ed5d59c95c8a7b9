// SCO against on-device checkpointing (issue 13), in one run, at one shape,
// on the CPU backend (device = the capped arena, host = the host space):
//
// 1. Step time: the whole step (forward, backward with recomputation,
//    AdamW) with every boundary on the device and with SCO's pool holding
//    all it can (L - 1 boundaries), interleaved A/B so both see the same
//    machine; the ratio of medians (target <= 1.02x), the device<->host
//    copy time SCO adds (measured alone on the same backend) and how much
//    of it the step hides.
// 2. The device peak against the host budget beta: the plan's and the
//    measured kCheckpoints and total device peaks for j = 0 … L - 1 pooled
//    boundaries.
// 3. Capacity: at a fixed device cap, the largest tokens per rank N (batch
//    of seq_len sequences) whose step completes, without and with SCO
//    (target >= 1.35x), found by running steps (doubling, then bisection).
// Ends with one JSON line.
//
//   bazel run -c opt //bench:sco_bench -- --layers=24 --cap_mb=256
//   bazel run -c opt --config=cuda //bench:sco_bench -- --backend=cuda ...
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/budget/budget.h"
#include "kernels/checkpoints/checkpoints_plan.h"
#include "kernels/step/step.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

using bench::NowSeconds;

// --backend=cuda: the same runs on one GPU.
BackendKind backend_kind = BackendKind::kCpu;

std::map<std::string, int64_t> flags = {
    {"hidden", 64},  {"layers", 24},     {"heads", 4},   {"kv_heads", 2},   {"experts", 4},
    {"top_k", 2},    {"expert_ffn", 128}, {"vocab", 256}, {"seq_len", 128},  {"batch", 32},
    {"steps", 5},    {"cap_mb", 256},     {"device_mb", 4096}};

ModelConfig Model() { return bench::ModelFromFlags(flags, flags["layers"], flags["seq_len"]); }

CheckpointOptions Sco(int64_t host_boundaries, int64_t N) {
  CheckpointOptions c;
  c.kind = CheckpointOptions::Kind::kSco;
  c.host_budget_bytes = host_boundaries * N * flags["hidden"] * 4;
  return c;
}

StepOptions Options(int64_t batch, const CheckpointOptions& c) {
  StepOptions o;
  o.model = Model();
  o.layout = {1, batch};
  o.checkpoints = c;
  return o;
}

std::vector<int32_t> Tokens(int64_t n, uint32_t seed, int64_t vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Runs `steps` steps of each options in turn (A B A B …), after one warm-up
// step each; median seconds per step of each, and each one's last stats.
absl::Status Interleaved(const std::vector<StepOptions>& opts, int64_t steps, int64_t device_bytes,
                         std::vector<double>* median, std::vector<StepStats>* stats) {
  return RunLocalWorld(1, LocalWorldBackend(backend_kind, device_bytes), FreshStoreDir("sco-bench"), [&](int, Backend& be, Communicator& world) {
    std::vector<std::unique_ptr<TrainingStep>> runs;
    for (const StepOptions& o : opts) {
      auto s = TrainingStep::Create(o, be, world);
      if (!s.ok()) return s.status();
      runs.push_back(std::move(*s));
    }
    const int64_t N = TokensPerRank(opts[0].model, opts[0].layout);
    const auto tok = Tokens(N, 1, opts[0].model.vocab_size), tgt = Tokens(N, 2, opts[0].model.vocab_size);
    std::vector<std::vector<double>> times(opts.size());
    stats->resize(opts.size());
    for (int64_t s = 0; s <= steps; ++s) {
      for (size_t i = 0; i < runs.size(); ++i) {
        const double t0 = NowSeconds();
        auto st = runs[i]->Step(tok, tgt);
        if (!st.ok()) return st.status();
        if (s > 0) times[i].push_back(NowSeconds() - t0);
        const absl::Status finite = bench::CheckFiniteStep(st->loss, st->grad_norm, absl::StrCat("step ", s + 1));
        if (!finite.ok()) return finite;
        (*stats)[i] = *st;
        // Every step the same batch from the same weights: SCO only copies,
        // so its loss is the on-device step's, bit for bit (step_offload_test);
        // one that differs is a wrong result, not a time to report.
        if (i > 0 && st->loss != (*stats)[0].loss) {
          return absl::InternalError(
              absl::StrFormat("step %d: the loss with SCO is %.17g, on-device checkpointing's %.17g: not the same step",
                              s + 1, st->loss, (*stats)[0].loss));
        }
      }
    }
    median->clear();
    for (auto& t : times) {
      std::sort(t.begin(), t.end());
      median->push_back(t[t.size() / 2]);
    }
    return absl::OkStatus();
  });
}

// Seconds to copy `count` boundaries device -> host -> device on a copy
// stream (what SCO adds), best of 3.
double CopySeconds(int64_t boundary_bytes, int64_t count) {
  auto be = Backend::Create(LocalWorldBackend(backend_kind, boundary_bytes + (1 << 20))).value();
  auto s = be->CreateStream("copy").value();
  auto dev = be->device().Allocate(LiveSet::kWorkspace, boundary_bytes).value();
  auto host = be->host().Allocate(LiveSet::kWorkspace, boundary_bytes).value();
  be->Fill(*s, dev.as<float>(), boundary_bytes / 4, 1.0f).IgnoreError();  // not host memory on CUDA
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = NowSeconds();
    for (int64_t i = 0; i < count; ++i) {
      be->Copy(*s, host.data(), dev.data(), boundary_bytes).IgnoreError();
      be->Copy(*s, dev.data(), host.data(), boundary_bytes).IgnoreError();
    }
    s->Synchronize().IgnoreError();
    best = std::min(best, NowSeconds() - t0);
  }
  return best;
}

// Whether a step at `batch` sequences completes under a device cap.
bool Completes(int64_t batch, const CheckpointOptions& c, int64_t cap) {
  // Every boundary pooled: L of them is more than the L - 1 that can be
  // (2^30 boundaries overflowed int64 once N H >= 2^31).
  const StepOptions o = Options(
      batch, c.kind == CheckpointOptions::Kind::kSco ? Sco(Model().layers, TokensPerRank(Model(), {1, batch})) : c);
  absl::Status s = RunLocalWorld(1, LocalWorldBackend(backend_kind, cap), FreshStoreDir("sco-cap"), [&](int, Backend& be, Communicator& world) {
    auto step = TrainingStep::Create(o, be, world);
    if (!step.ok()) return step.status();
    const int64_t N = TokensPerRank(o.model, o.layout);
    auto st = (*step)->Step(Tokens(N, 1, o.model.vocab_size), Tokens(N, 2, o.model.vocab_size));
    return st.status();
  });
  // Out of memory is the cap's answer; any other failure is the bench's,
  // and a capacity ratio computed past it would be wrong.
  if (!s.ok() && s.code() != absl::StatusCode::kResourceExhausted) {
    std::fprintf(stderr, "sco_bench: FAILED: unexpected failure at batch %lld: %s\n", (long long)batch,
                 s.ToString().c_str());
    std::exit(1);
  }
  return s.ok();
}

// The largest batch (in sequences) that completes: doubling, then bisection.
int64_t LargestBatch(const CheckpointOptions& c, int64_t cap) {
  int64_t lo = 0, hi = 1;
  while (Completes(hi, c, cap)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (Completes(mid, c, cap) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  using namespace plateau;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool bad = false;
    if (bench::BackendArg(a, "sco_bench", &backend_kind, &bad)) {
      if (bad) return 2;
      continue;
    }
    const size_t eq = a.find('=');
    const std::string name = a.substr(0, 2) == "--" && eq != std::string::npos ? a.substr(2, eq - 2) : "";
    if (!flags.count(name) || !absl::SimpleAtoi(a.substr(eq + 1), &flags[name])) {
      std::fprintf(stderr, "sco_bench: bad argument '%s'\n", a.c_str());
      return 2;
    }
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress visible when piped
  const ModelConfig m = Model();
  const int64_t L = m.layers, batch = flags["batch"], N = batch * m.seq_len, H = m.hidden;
  const int64_t boundary = N * H * 4;
  std::printf("sco_bench %s; load %.2f\n", bench::NowText().c_str(), bench::LoadAverage1m());
  std::printf("model: H=%lld L=%lld heads=%lld/%lld E=%lld k=%lld F=%lld V=%lld T=%lld; 1 rank\n\n",
              (long long)H, (long long)L, (long long)m.heads, (long long)m.kv_heads, (long long)m.experts,
              (long long)m.top_k, (long long)m.expert_ffn, (long long)m.vocab_size, (long long)m.seq_len);

  // 1. Step time, interleaved.
  std::vector<double> median;
  std::vector<StepStats> stats;
  absl::Status s = Interleaved({Options(batch, {}), Options(batch, Sco(L - 1, N))}, flags["steps"],
                               flags["device_mb"] << 20, &median, &stats);
  if (!s.ok()) {
    std::fprintf(stderr, "sco_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  const double ratio = median[1] / median[0];
  const double copy_s = CopySeconds(boundary, L - 1);  // each pooled boundary out and back
  const double added = median[1] - median[0];
  const double hidden = copy_s > 0 ? std::clamp(1.0 - added / copy_s, 0.0, 1.0) : 1.0;
  std::printf("step at N = %lld tokens: on-device checkpoints %.3f s, SCO (%lld boundaries pooled) %.3f s: "
              "%.3fx\n",
              (long long)N, median[0], (long long)(L - 1), median[1], ratio);
  std::printf("  SCO's copies alone: %.3f s (%lld x %.2f MiB out and back); hidden by the step: %.0f%%\n",
              copy_s, (long long)(L - 1), boundary / 1048576.0, 100 * hidden);
  std::printf("  (both steps share one backend here, so their device peaks are in the curve below)\n\n");

  // 2. Device peak against beta.
  std::printf("%6s %12s %14s %14s %14s\n", "pooled", "beta MiB", "plan ckpt MiB", "meas ckpt MiB",
              "meas total MiB");
  std::string curve;
  std::vector<int64_t> pooled;
  for (int64_t j = 0; j < L - 1; j += std::max<int64_t>(1, (L - 1) / 6)) pooled.push_back(j);
  pooled.push_back(L - 1);
  int64_t first_total = 0, last_total = 0;
  for (int64_t j : pooled) {
    std::vector<double> med;
    std::vector<StepStats> st;
    const StepOptions o = Options(batch, Sco(j, N));
    s = Interleaved({o}, 1, flags["device_mb"] << 20, &med, &st);
    if (!s.ok()) {
      std::fprintf(stderr, "sco_bench: %s\n", s.ToString().c_str());
      return 1;
    }
    const MemoryPlan plan = PlanMemory(o).value();
    const int64_t planned = plan.bytes[static_cast<int>(LiveSet::kCheckpoints)];
    const int64_t measured = st[0].device.peak_of(LiveSet::kCheckpoints);
    std::printf("%6lld %12.2f %14.2f %14.2f %14.2f\n", (long long)j, o.checkpoints.host_budget_bytes / 1048576.0,
                planned / 1048576.0, measured / 1048576.0, st[0].device.total_peak / 1048576.0);
    if (j == 0) first_total = st[0].device.total_peak;
    last_total = st[0].device.total_peak;
    absl::StrAppendFormat(&curve, "%s{\"pooled\":%d,\"beta_bytes\":%d,\"planned_checkpoints\":%d,"
                                  "\"measured_checkpoints\":%d,\"measured_total\":%d}",
                          curve.empty() ? "" : ",", j, o.checkpoints.host_budget_bytes, planned, measured,
                          st[0].device.total_peak);
  }

  std::printf("device peak of the step: %.2f MiB on-device, %.2f MiB with %lld boundaries pooled: %.3fx\n",
              first_total / 1048576.0, last_total / 1048576.0, (long long)(L - 1),
              static_cast<double>(last_total) / first_total);

  // 3. Capacity at a fixed cap.
  const int64_t cap = flags["cap_mb"] << 20;
  const int64_t full_batch = LargestBatch({}, cap);
  const int64_t sco_batch = LargestBatch(Sco(1, 1), cap);  // SCO with its pool as large as it goes
  const double gain = full_batch > 0 ? static_cast<double>(sco_batch) / full_batch : 0;
  std::printf("\nlargest N at a %lld MiB device: on-device checkpoints %lld tokens, SCO %lld tokens: %.2fx\n",
              (long long)flags["cap_mb"], (long long)(full_batch * m.seq_len), (long long)(sco_batch * m.seq_len),
              gain);

  std::printf("\n{\"bench\":\"sco\",\"date\":%s,\"hidden\":%lld,\"layers\":%lld,\"seq_len\":%lld,\"tokens\":%lld,"
              "\"full_step_s\":%.4f,\"sco_step_s\":%.4f,\"time_ratio\":%.4f,\"copy_s\":%.4f,\"hidden_fraction\":%.3f,"
              "\"full_peak_bytes\":%lld,\"sco_peak_bytes\":%lld,\"curve\":[%s],\"cap_bytes\":%lld,"
              "\"full_largest_tokens\":%lld,\"sco_largest_tokens\":%lld,\"capacity_ratio\":%.3f}\n",
              bench::JsonString(bench::NowText()).c_str(), (long long)H, (long long)L, (long long)m.seq_len,
              (long long)N, median[0], median[1], ratio, copy_s, hidden, (long long)first_total,
              (long long)last_total, curve.c_str(), (long long)cap,
              (long long)(full_batch * m.seq_len), (long long)(sco_batch * m.seq_len), gain);
  return 0;
}
