// Ring-DTP against the dense projection, in the same run, at a scaled
// version of the paper's shape (N = 16,384, H = 7,168, V = 200,000, fp32)
// divided by --scale in every dimension (H/V and N/V as in the paper).
//
// For each P: the projection live set's peak, the forward time and the
// forward+backward time of both, and their ratios; then the peaks at
// several N to show Ring-DTP's staying flat while the dense one grows with
// N x V. Times are the slowest rank's, best of --reps. Ends with a JSON line.
//
//   bazel run -c opt //bench:ring_dtp_bench -- --scale=8 --ranks=2,4
//   bazel run -c opt --config=cuda //bench:ring_dtp_bench -- --backend=cuda --ranks=1 --flat_ranks=1  # one GPU
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/model/config.h"
#include "kernels/model/model_kernels.h"
#include "kernels/projection/dense_projection.h"
#include "kernels/projection/ring_dtp.h"
#include "kernels/status_macros.h"
#include "kernels/testing/local_world.h"

namespace plateau {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Measure {
  double fwd_s = 1e30, total_s = 1e30;  // best over reps, slowest rank
  int64_t peak = 0;                    // projection live set, max over ranks
};

struct Shape {
  int64_t N, H, V, S, row_tile, chunk_rows;
};

// The vocabulary weight W [V x H], made once per process (MakeWeights) and
// shared read-only by every rank of every Run: each comparison (dense
// against Ring-DTP, every P, every N of the peak table) sees the same W, and
// at --scale=2 (V x H = 358M values) drawing it per rank and per Run from a
// normal distribution took ~5 s of one host thread each time, 20-25 s of a
// run before any GPU work. Uniform in [-a, a) with a = 0.02 sqrt(3): the
// standard deviation of the 0.02-scaled normal it replaces, so the logits'
// scale (x ~ N(0, 1) times W over H) is unchanged; neither arm's speed nor
// its peak depends on the values.
std::vector<float> MakeWeights(const Shape& sh) {
  std::vector<float> w(sh.V * sh.H);
  bench::FillRandom(w, 7);
  const float a = 0.02f * std::sqrt(3.0f);
  for (float& v : w) v *= a;
  return w;
}

// Runs `reps` forward (+ backward) calls of the dense projection or of
// Ring-DTP on P rank threads; returns times and the projection peak. `hw`:
// W on the host (MakeWeights at sh's V and H).
absl::StatusOr<std::pair<Measure, Measure>> Run(const Shape& sh, const std::vector<float>& hw, int P, int reps,
                                                bool timed, BackendKind backend) {
  Measure dense, ring;
  std::mutex mu;
  std::vector<double> dense_fwd(reps, 0), dense_tot(reps, 0), ring_fwd(reps, 0), ring_tot(reps, 0);
  absl::Status st = RunLocalWorld(
      P, LocalWorldBackend(backend, backend == BackendKind::kCpu ? int64_t{20} << 30 : 0), FreshStoreDir("ringbench"),
      [&](int p, Backend& be, Communicator& world) -> absl::Status {
        PLATEAU_ASSIGN_OR_RETURN(auto compute, be.CreateStream("compute"));
        PLATEAU_ASSIGN_OR_RETURN(auto comm, be.CreateStream("comm"));
        PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(be));
        const int64_t N = sh.N, H = sh.H, V = sh.V;
        const int64_t begin = VocabShardBegin(V, P, p);
        auto f = [&](LiveSet set, int64_t n) { return be.device().Allocate(set, n * 4); };
        PLATEAU_ASSIGN_OR_RETURN(Buffer x, f(LiveSet::kActivations, N * H));
        PLATEAU_ASSIGN_OR_RETURN(Buffer dx, f(LiveSet::kActivations, N * H));
        PLATEAU_ASSIGN_OR_RETURN(Buffer y, f(LiveSet::kActivations, N));
        PLATEAU_ASSIGN_OR_RETURN(Buffer w, f(LiveSet::kWeights, V * H));  // dense: W replicated
        PLATEAU_ASSIGN_OR_RETURN(Buffer dw, f(LiveSet::kGrads, V * H));
        PLATEAU_ASSIGN_OR_RETURN(Buffer stats, be.device().Allocate(LiveSet::kWorkspace, 16));
        {
          // Generated on the host and copied in (on CUDA the buffers are
          // not host memory); W is the process's (MakeWeights), the same on
          // every rank.
          std::mt19937 rng(1000 + p);
          std::normal_distribution<float> nd(0.0f, 1.0f);
          std::vector<float> hx(N * H);
          std::vector<int32_t> hy(N);
          for (float& v : hx) v = nd(rng);
          for (int32_t& v : hy) v = static_cast<int32_t>(rng() % V);
          if (static_cast<int64_t>(hw.size()) != V * H) {
            return absl::InternalError(
                absl::StrCat("W on the host has ", hw.size(), " values, expected V x H = ", V * H));
          }
          PLATEAU_RETURN_IF_ERROR(be.Copy(*compute, x.data(), hx.data(), hx.size() * sizeof(float)));
          PLATEAU_RETURN_IF_ERROR(be.Copy(*compute, w.data(), hw.data(), hw.size() * sizeof(float)));
          PLATEAU_RETURN_IF_ERROR(be.Copy(*compute, y.data(), hy.data(), hy.size() * sizeof(int32_t)));
          PLATEAU_RETURN_IF_ERROR((*compute).Synchronize());
        }
        double* s = stats.as<double>();
        const float* wshard = w.as<float>() + begin * H;
        float* dwshard = dw.as<float>() + begin * H;
        auto sync = [&]() -> absl::Status {
          PLATEAU_RETURN_IF_ERROR((*compute).Synchronize());
          return (*comm).Synchronize();
        };
        auto barrier = [&]() -> absl::Status {
          PLATEAU_RETURN_IF_ERROR(world.Barrier(*comm));
          return (*comm).Synchronize();
        };
        const float scale = 1.0f / static_cast<float>(N * P);
        // The mean loss over every rank's tokens after one Forward from zero
        // stats: both arms must give the same one (fp32 rounding), or the
        // run fails rather than report a wrong result's speed.
        auto global_loss = [&](const std::function<absl::Status()>& forward) -> absl::StatusOr<double> {
          const double zero[2] = {0, 0};
          PLATEAU_RETURN_IF_ERROR(be.Copy(*compute, s, zero, sizeof(zero)));
          PLATEAU_RETURN_IF_ERROR(forward());
          PLATEAU_RETURN_IF_ERROR(sync());
          PLATEAU_RETURN_IF_ERROR(world.AllReduce(*comm, s, s, 2, DataType::kFloat64, ReduceOp::kSum));
          double h[2] = {0, 0};
          PLATEAU_RETURN_IF_ERROR(be.Copy(*comm, h, s, sizeof(h)));
          PLATEAU_RETURN_IF_ERROR(sync());
          return h[1] > 0 ? h[0] / h[1] : 0.0;
        };
        double dense_loss = 0;
        // Dense baseline.
        {
          be.device().tracker().ResetPeaks();
          PLATEAU_ASSIGN_OR_RETURN(auto dense_p, DenseProjection::Create(be, *kernels, *compute, N, H, V));
          for (int r = 0; r < reps; ++r) {
            PLATEAU_RETURN_IF_ERROR(barrier());
            double t0 = Now();
            PLATEAU_RETURN_IF_ERROR(dense_p->Forward(x.as<float>(), w.as<float>(),
                                                     y.as<int32_t>(), s));
            PLATEAU_RETURN_IF_ERROR(sync());
            double t1 = Now();
            PLATEAU_RETURN_IF_ERROR(dense_p->Backward(x.as<float>(), w.as<float>(),
                                                      y.as<int32_t>(), scale, dx.as<float>(),
                                                      dw.as<float>()));
            PLATEAU_RETURN_IF_ERROR(sync());
            double t2 = Now();
            std::lock_guard<std::mutex> l(mu);
            dense_fwd[r] = std::max(dense_fwd[r], t1 - t0);
            dense_tot[r] = std::max(dense_tot[r], t2 - t0);
          }
          std::lock_guard<std::mutex> l(mu);
          dense.peak = std::max(dense.peak, be.device().tracker().peak(LiveSet::kProjection));
        }
        {
          PLATEAU_ASSIGN_OR_RETURN(auto dense_p, DenseProjection::Create(be, *kernels, *compute, N, H, V));
          PLATEAU_ASSIGN_OR_RETURN(dense_loss, global_loss([&] {
                                     return dense_p->Forward(x.as<float>(), w.as<float>(), y.as<int32_t>(), s);
                                   }));
        }
        // Ring-DTP.
        {
          be.device().tracker().ResetPeaks();
          RingDtpConfig c{N, H, V, sh.S, RingDtp::ChooseMode(N, V, P), sh.row_tile, sh.chunk_rows};
          PLATEAU_ASSIGN_OR_RETURN(auto ring_p, RingDtp::Create(c, be, *kernels, world, *compute, *comm));
          for (int r = 0; r < reps; ++r) {
            PLATEAU_RETURN_IF_ERROR(barrier());
            double t0 = Now();
            PLATEAU_RETURN_IF_ERROR(ring_p->Forward(x.as<float>(), wshard, y.as<int32_t>(), s));
            PLATEAU_RETURN_IF_ERROR(sync());
            double t1 = Now();
            PLATEAU_RETURN_IF_ERROR(ring_p->Backward(x.as<float>(), wshard, y.as<int32_t>(), scale,
                                                     dx.as<float>(), dwshard));
            PLATEAU_RETURN_IF_ERROR(sync());
            double t2 = Now();
            std::lock_guard<std::mutex> l(mu);
            ring_fwd[r] = std::max(ring_fwd[r], t1 - t0);
            ring_tot[r] = std::max(ring_tot[r], t2 - t0);
          }
          std::lock_guard<std::mutex> l(mu);
          ring.peak = std::max(ring.peak, be.device().tracker().peak(LiveSet::kProjection));
        }
        {
          RingDtpConfig c{N, H, V, sh.S, RingDtp::ChooseMode(N, V, P), sh.row_tile, sh.chunk_rows};
          PLATEAU_ASSIGN_OR_RETURN(auto ring_p, RingDtp::Create(c, be, *kernels, world, *compute, *comm));
          PLATEAU_ASSIGN_OR_RETURN(const double ring_loss, global_loss([&] {
                                     return ring_p->Forward(x.as<float>(), wshard, y.as<int32_t>(), s);
                                   }));
          if (!(std::abs(ring_loss - dense_loss) <= 1e-5 * std::abs(dense_loss))) {
            return absl::InternalError(absl::StrFormat(
                "Ring-DTP's loss %.9g is not the dense projection's %.9g (P = %d)", ring_loss, dense_loss, P));
          }
        }
        return absl::OkStatus();
      });
  if (!st.ok()) return st;
  if (timed) {
    dense.fwd_s = *std::min_element(dense_fwd.begin(), dense_fwd.end());
    dense.total_s = *std::min_element(dense_tot.begin(), dense_tot.end());
    ring.fwd_s = *std::min_element(ring_fwd.begin(), ring_fwd.end());
    ring.total_s = *std::min_element(ring_tot.begin(), ring_tot.end());
  }
  return std::make_pair(dense, ring);
}

}  // namespace
}  // namespace plateau

int main(int argc, char** argv) {
  using namespace plateau;
  // --flat_ranks: P of the peak-against-N table (0: skip it).
  int64_t scale = 8, reps = 2, strip = 1024, row_tile = 1024, chunks = 2, flat_ranks = 2;
  std::string ranks = "2,4";
  BackendKind backend = BackendKind::kCpu;  // --backend=cuda: one GPU per rank
  std::map<std::string, int64_t*> flags = {{"scale", &scale},       {"reps", &reps},     {"strip", &strip},
                                           {"row_tile", &row_tile}, {"chunks", &chunks}, {"flat_ranks", &flat_ranks}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool bad = false;
    if (bench::BackendArg(a, "ring_dtp_bench", &backend, &bad)) {
      if (bad) return 2;
      continue;
    }
    size_t eq = a.find('=');
    std::string name = eq == std::string::npos ? a : a.substr(2, eq - 2);
    std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (name == "ranks") {
      ranks = value;
    } else if (!flags.count(name) || !absl::SimpleAtoi(value, flags[name])) {
      std::fprintf(stderr, "ring_dtp_bench: bad argument '%s'\n", a.c_str());
      return 2;
    }
  }
  Shape sh{16384 / scale, 7168 / scale, 200000 / scale, strip, row_tile, 0};
  sh.chunk_rows = (sh.N + chunks - 1) / chunks;
  // Every Run below has this V and H (the peak table changes only N).
  const std::vector<float> hw = MakeWeights(sh);
  std::printf("ring_dtp_bench: paper shape / %lld: N=%lld H=%lld V=%lld fp32; strip S=%lld, row tile %lld, "
              "activation passes of %lld rows\n",
              (long long)scale, (long long)sh.N, (long long)sh.H, (long long)sh.V, (long long)sh.S,
              (long long)sh.row_tile, (long long)sh.chunk_rows);
  std::printf("\n%3s %-11s %14s %14s %10s %10s %10s\n", "P", "mode", "dense peak MiB", "ring peak MiB",
              "peak x", "fwd x", "fwd+bwd x");
  std::string json = "{\"bench\":\"ring_dtp\",\"runs\":[";
  bool first = true;
  for (absl::string_view pv : absl::StrSplit(ranks, ',')) {
    int P = 0;
    if (!absl::SimpleAtoi(pv, &P)) return 2;
    auto r = Run(sh, hw, P, static_cast<int>(reps), true, backend);
    if (!r.ok()) {
      std::fprintf(stderr, "ring_dtp_bench: %s\n", r.status().ToString().c_str());
      return 1;
    }
    const auto& [d, g] = *r;
    const double peak_x = double(g.peak) / d.peak, fwd_x = g.fwd_s / d.fwd_s, tot_x = g.total_s / d.total_s;
    std::printf("%3d %-11s %14.1f %14.1f %10.3f %10.3f %10.3f   (dense %.2fs/%.2fs, ring %.2fs/%.2fs)\n", P,
                std::string(RingDtpModeName(RingDtp::ChooseMode(sh.N, sh.V, P))).c_str(),
                d.peak / 1048576.0, g.peak / 1048576.0, peak_x, fwd_x, tot_x, d.fwd_s, d.total_s,
                g.fwd_s, g.total_s);
    std::fflush(stdout);
    absl::StrAppendFormat(&json,
                          "%s{\"ranks\":%d,\"N\":%d,\"H\":%d,\"V\":%d,\"peak_ratio\":%.4f,"
                          "\"fwd_time_ratio\":%.4f,\"time_ratio\":%.4f,\"dense_peak_bytes\":%d,"
                          "\"ring_peak_bytes\":%d}",
                          first ? "" : ",", P, sh.N, sh.H, sh.V, peak_x, fwd_x, tot_x, d.peak, g.peak);
    first = false;
  }
  json += "],\"flat_in_n\":[";
  if (flat_ranks > 0) {
    std::printf("\npeak as N grows (P = %lld, passes of %lld rows):\n%8s %14s %14s\n", (long long)flat_ranks,
                (long long)sh.chunk_rows, "N", "dense MiB", "ring MiB");
  }
  first = true;
  for (int64_t mult : {1, 2, 4}) {
    if (flat_ranks <= 0) break;
    Shape s2 = sh;
    s2.N = sh.N * mult / 2;
    auto r = Run(s2, hw, static_cast<int>(flat_ranks), 1, false, backend);
    if (!r.ok()) {
      std::fprintf(stderr, "ring_dtp_bench: %s\n", r.status().ToString().c_str());
      return 1;
    }
    std::printf("%8lld %14.1f %14.1f\n", (long long)s2.N, r->first.peak / 1048576.0,
                r->second.peak / 1048576.0);
    std::fflush(stdout);
    absl::StrAppendFormat(&json, "%s{\"N\":%d,\"dense_peak_bytes\":%d,\"ring_peak_bytes\":%d}",
                          first ? "" : ",", s2.N, r->first.peak, r->second.peak);
    first = false;
  }
  json += "]}";
  std::printf("\n%s\n", json.c_str());
  return 0;
}
