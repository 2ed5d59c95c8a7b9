// Checkpoints, streamed against their baseline, in one run. P ranks
// (threads of this process, each with its CPU backend and the Gloo world)
// save and load one model's state both ways, alternating:
//  - baseline: GatherState (the whole state on every rank), rank 0 writes
//    it with WriteSafetensors; every rank reads the whole file
//    (ReadSafetensors) and LoadState cuts its shard;
//  - streamed: the trainer's WriteCheckpointFile (every rank gathers, rank
//    0 writes runs in place) and ReadCheckpointFile (each rank reads its
//    own shard) (worker/trainer.h).
// Per way: wall time (slowest rank, median of --reps) and the most the
// process heap held above its start (all P ranks together: a counting
// operator new, kernels/testing/heap_counter.h), with the budget's bound
// for the streamed save and load beside it (exit 1 past it by more than 64
// KiB a rank). The two files must be the same bytes, and each load must give
// back the saved state (the state is zeroed before each, untimed).
//
//   bazel build -c opt //bench:checkpoint_bench
//   bazel-out/k8-opt/bin/bench/checkpoint_bench [--ranks=4] [--layers=4]
//       [--hidden=512] [--experts=8] [--expert_ffn=512] [--vocab=32000]
//       [--precision=fp32|bf16] [--reps=3]
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_util.h"
#include "kernels/budget/budget.h"
#include "kernels/status_macros.h"
#include "kernels/step/step.h"
#include "kernels/testing/heap_counter.h"
#include "kernels/testing/local_world.h"
#include "worker/safetensors.h"
#include "worker/trainer.h"

namespace plateau::bench {
namespace {

struct Way {
  std::vector<double> save_s, load_s;
  int64_t save_heap = 0, load_heap = 0;  // the most over the reps
};

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int Main(int argc, char** argv) {
  std::map<std::string, int64_t> flags = {{"ranks", 4},       {"layers", 4},      {"hidden", 512},
                                          {"heads", 8},       {"kv_heads", 2},    {"experts", 8},
                                          {"top_k", 2},       {"expert_ffn", 512}, {"vocab", 32000},
                                          {"seq_len", 64},    {"reps", 3}};
  Precision precision = Precision::kFp32;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    bool bad = false;
    if (PrecisionArg(arg, "checkpoint_bench", &precision, &bad)) {
      if (bad) return 2;
      continue;
    }
    const size_t eq = arg.find('=');
    int64_t v = 0;
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos || !flags.count(arg.substr(2, eq - 2)) ||
        !absl::SimpleAtoi(arg.substr(eq + 1), &v) || v < 1) {
      std::fprintf(stderr, "checkpoint_bench: bad argument '%s' (flags: --name=positive integer, --precision)\n",
                   arg.c_str());
      return 2;
    }
    flags[arg.substr(2, eq - 2)] = v;
  }
  const int P = static_cast<int>(flags["ranks"]);
  StepOptions o;
  o.model = ModelFromFlags(flags, flags["layers"], flags["seq_len"]);
  o.layout = {P, P};
  o.precision = precision;
  const ParamLayout layout = LayoutOf(o);
  int64_t params = 0;
  for (const WeightSpec& w : layout.weights()) params += w.numel();
  const int64_t bound_save = StreamStateHostBytes(o, layout, true) + (P - 1) * StreamStateHostBytes(o, layout, false);
  const int64_t bound_load = P * LoadStreamedStateHostBytes(layout);
  const std::string dir = FreshStoreDir("checkpoint_bench_files");
  std::filesystem::create_directories(dir);
  const std::string base_path = dir + "/baseline.safetensors", streamed_path = dir + "/streamed.safetensors";
  const std::map<std::string, std::string> metadata = {{"step", "0"}, {"format", "plateau-checkpoint-v1"}};
  auto plan = OrDie(PlanMemory(o), "PlanMemory");
  std::printf("checkpoint_bench: P = %d ranks (threads), %lld parameters (%.1f MiB of state, 3 x 4 B each), %s\n",
              P, static_cast<long long>(params), 12.0 * params / 1048576.0,
              precision == Precision::kBf16Mixed ? "bf16 mixed" : "fp32");

  Way baseline, streamed;
  HeapWindow window(P, /*timeout_s=*/3600);  // rank 0 writes the whole file meanwhile
  std::mutex mu;
  bool same_bytes = false, baseline_back = true, streamed_back = true;
  const int reps = static_cast<int>(flags["reps"]);
  const absl::Status world = RunLocalWorld(
      P, plan.total() + (int64_t{64} << 20), FreshStoreDir("checkpoint_bench"),
      [&](int r, Backend& be, Communicator& comm) -> absl::Status {
        PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<TrainingStep> step, TrainingStep::Create(o, be, comm));
        PLATEAU_ASSIGN_OR_RETURN(const ModelState truth, step->GatherState());
        // Loaded before each load (untimed), so that a load that leaves
        // anything out is seen: every value zero.
        ModelState zero = truth;
        for (StateFamily f : {StateFamily::kWeights, StateFamily::kM, StateFamily::kV}) {
          for (std::vector<float>& t : zero.family(f)) std::fill(t.begin(), t.end(), 0.0f);
        }
        // After each load: the saved state back, or this way failed.
        auto check_back = [&](bool* same) -> absl::Status {
          PLATEAU_ASSIGN_OR_RETURN(ModelState back, step->GatherState());
          std::lock_guard<std::mutex> lock(mu);
          *same = *same && back.weights == truth.weights && back.m == truth.m && back.v == truth.v;
          return absl::OkStatus();
        };
        auto timed = [&](std::vector<double>* times, int64_t* heap, const std::function<absl::Status()>& fn) {
          window.Begin();
          const double t0 = NowSeconds();
          const absl::Status s = fn();
          const double t = NowSeconds() - t0;
          const int64_t above = window.End();  // the slowest rank's end, for every rank
          const double wall = NowSeconds() - t0;
          std::lock_guard<std::mutex> lock(mu);
          if (r == 0) {
            times->push_back(std::max(t, wall));
            *heap = std::max(*heap, above);
          }
          return s;
        };
        for (int rep = 0; rep < reps; ++rep) {
          PLATEAU_RETURN_IF_ERROR(timed(&baseline.save_s, &baseline.save_heap, [&]() -> absl::Status {
            PLATEAU_ASSIGN_OR_RETURN(ModelState st, step->GatherState());
            if (r != 0) return absl::OkStatus();
            std::vector<TensorView> views;
            for (size_t i = 0; i < layout.weights().size(); ++i) {
              const WeightSpec& w = layout.weights()[i];
              views.push_back({w.name, w.shape, st.weights[i].data()});
              views.push_back({"optimizer.m." + w.name, w.shape, st.m[i].data()});
              views.push_back({"optimizer.v." + w.name, w.shape, st.v[i].data()});
            }
            return WriteSafetensors(base_path, views, metadata);
          }));
          PLATEAU_RETURN_IF_ERROR(timed(&streamed.save_s, &streamed.save_heap, [&] {
            return WriteCheckpointFile(*step, streamed_path, metadata, /*writer=*/r == 0);
          }));
          PLATEAU_RETURN_IF_ERROR(step->LoadState(zero));
          PLATEAU_RETURN_IF_ERROR(timed(&baseline.load_s, &baseline.load_heap, [&]() -> absl::Status {
            PLATEAU_ASSIGN_OR_RETURN(SafetensorsFile f, ReadSafetensors(base_path));
            ModelState st;
            for (const WeightSpec& w : layout.weights()) {
              st.weights.push_back(std::move(f.tensors.at(w.name).data));
              st.m.push_back(std::move(f.tensors.at("optimizer.m." + w.name).data));
              st.v.push_back(std::move(f.tensors.at("optimizer.v." + w.name).data));
            }
            return step->LoadState(st);
          }));
          PLATEAU_RETURN_IF_ERROR(check_back(&baseline_back));
          PLATEAU_RETURN_IF_ERROR(step->LoadState(zero));
          PLATEAU_RETURN_IF_ERROR(timed(&streamed.load_s, &streamed.load_heap, [&] {
            return ReadCheckpointFile(streamed_path, *step,
                                      [](std::map<std::string, std::string>) -> absl::StatusOr<int64_t> { return 0; });
          }));
          PLATEAU_RETURN_IF_ERROR(check_back(&streamed_back));
        }
        if (r == 0) same_bytes = FileBytes(base_path) == FileBytes(streamed_path);
        return absl::OkStatus();
      });
  if (!world.ok() || window.broken()) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", world.ok() ? "a rank left the meetings" : world.ToString().c_str());
    return 1;
  }
  const double mib = 1048576.0;
  auto row = [&](const char* what, const Way& w) {
    std::printf("  %-9s save %8.3f s, heap %9.1f MiB | load %8.3f s, heap %9.1f MiB\n", what, Median(w.save_s),
                w.save_heap / mib, Median(w.load_s), w.load_heap / mib);
  };
  row("baseline", baseline);
  row("streamed", streamed);
  std::printf("  bound     save heap %9.1f MiB (StreamStateHostBytes, all ranks) | load heap %9.1f MiB\n",
              bound_save / mib, bound_load / mib);
  std::printf("  streamed / baseline: save time %.2fx, save heap %.3fx; load time %.2fx, load heap %.3fx; "
              "files identical: %s; state back: %s\n",
              Median(streamed.save_s) / Median(baseline.save_s),
              static_cast<double>(streamed.save_heap) / baseline.save_heap,
              Median(streamed.load_s) / Median(baseline.load_s),
              static_cast<double>(streamed.load_heap) / baseline.load_heap, same_bytes ? "yes" : "NO",
              baseline_back && streamed_back ? "yes (both ways)" : baseline_back ? "NO (streamed)" : "NO (baseline)");
  std::printf(
      "{\"bench\":\"checkpoint\",\"date\":%s,\"ranks\":%d,\"params\":%lld,\"precision\":\"%s\",\"reps\":%d,"
      "\"baseline\":{\"save_s\":%.4f,\"save_heap\":%lld,\"load_s\":%.4f,\"load_heap\":%lld},"
      "\"streamed\":{\"save_s\":%.4f,\"save_heap\":%lld,\"load_s\":%.4f,\"load_heap\":%lld},"
      "\"bound\":{\"save_heap\":%lld,\"load_heap\":%lld},\"identical\":%s,\"state_back\":%s}\n",
      JsonString(NowText()).c_str(), P, static_cast<long long>(params),
      precision == Precision::kBf16Mixed ? "bf16" : "fp32", reps, Median(baseline.save_s),
      static_cast<long long>(baseline.save_heap), Median(baseline.load_s), static_cast<long long>(baseline.load_heap),
      Median(streamed.save_s), static_cast<long long>(streamed.save_heap), Median(streamed.load_s),
      static_cast<long long>(streamed.load_heap), static_cast<long long>(bound_save),
      static_cast<long long>(bound_load), same_bytes ? "true" : "false",
      baseline_back && streamed_back ? "true" : "false");
  std::filesystem::remove_all(dir);
  // The bookkeeping beside the bound (the reader's header, Gloo's): 64 KiB
  // a rank, as stream_state_test allows in all.
  const int64_t slack = P * (int64_t{64} << 10);
  return same_bytes && baseline_back && streamed_back && streamed.save_heap <= bound_save + slack &&
                 streamed.load_heap <= bound_load + slack
             ? 0
             : 1;
}

}  // namespace
}  // namespace plateau::bench

int main(int argc, char** argv) { return plateau::bench::Main(argc, argv); }
