// copy_bench: how fast bytes move, and whether moving them hides behind
// compute.
//
// 1. Host memcpy bandwidth from 64 KiB to 512 MiB (the CPU's own ceiling).
// 2. Copies through each backend's Copy on a copy stream: host -> device and
//    device -> host between the backend's host space (pinned on CUDA) and
//    its device space. On the CPU backend these are memcpys on the copy
//    stream's thread, so they should approach (1).
// 3. Overlap: a copy on the copy stream and a GEMM on the compute stream,
//    alone and together. overlap ratio = time(both) / (time(copy) +
//    time(gemm)): 1.0 means they ran one after the other, max/(sum) (the
//    "ideal" column) that the shorter hid completely behind the longer. The
//    copy is sized to take about as long as the GEMM, where overlap matters
//    most.
//
// GB/s = bytes copied / seconds, 1 GB = 1e9 bytes (a copy reads and writes
// each byte, so memory traffic is twice that). Each figure is the best of
// several timed runs after a warm-up; small sizes repeat the copy within a
// run so a run lasts at least ~20 ms. Copied bytes are checked after timing.
//
// "others%": the share of the machine's CPU time other processes took while
// a row ran (these cores are shared; such rows understate the ceiling).
//
// --quick: 64 KiB and 1 MiB copies and a 128^3 GEMM for the overlap, every
// code path in seconds: tools/device-check --emulated.
//
// Output: tables, then one JSON line.
#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/status_macros.h"

namespace plateau::bench {
namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;
// The sizes every table runs (--quick shortens it before any run).
std::vector<size_t> copy_sizes = {64 * kKiB, 256 * kKiB, 1 * kMiB,   4 * kMiB,
                                  16 * kMiB, 64 * kMiB,  256 * kMiB, 512 * kMiB};

std::string SizeText(size_t bytes) {
  return bytes >= kMiB ? absl::StrCat(bytes / kMiB, " MiB")
                       : absl::StrCat(bytes / kKiB, " KiB");
}

// Times `copy_once` (one copy of `bytes`, waited for by `finish`), repeated
// `inner` times per timed run so that a run lasts >= ~20 ms.
absl::StatusOr<double> BestGBps(size_t bytes,
                                const std::function<absl::Status()>& copy_once,
                                const std::function<absl::Status()>& finish) {
  const double t0 = NowSeconds();
  PLATEAU_RETURN_IF_ERROR(copy_once());
  PLATEAU_RETURN_IF_ERROR(finish());
  const double once = std::max(NowSeconds() - t0, 1e-7);
  const int inner = static_cast<int>(std::clamp(0.02 / once, 1.0, 10000.0));
  PLATEAU_ASSIGN_OR_RETURN(
      Timing t, TimeRuns(
                    [&]() -> absl::Status {
                      for (int i = 0; i < inner; ++i) {
                        PLATEAU_RETURN_IF_ERROR(copy_once());
                      }
                      return finish();
                    },
                    /*warmup=*/1, /*min_reps=*/3, /*min_total_s=*/0.1,
                    /*max_reps=*/8));
  return static_cast<double>(bytes) * inner / t.best_s / 1e9;
}

struct HostRow {
  size_t bytes;
  double gbps;
  double others_pct;  // CPU time other processes took meanwhile
};

std::vector<HostRow> HostMemcpy() {
  std::vector<HostRow> rows;
  const size_t max_bytes = copy_sizes.back();
  std::vector<char> src(max_bytes), dst(max_bytes);
  // Touch every page first, and never copy zeros.
  for (size_t i = 0; i < max_bytes; ++i) src[i] = static_cast<char>(i * 131);
  std::memset(dst.data(), 1, max_bytes);
  for (size_t bytes : copy_sizes) {
    CpuMeter meter;
    const double gbps = OrDie(
        BestGBps(
            bytes,
            [&]() {
              std::memcpy(dst.data(), src.data(), bytes);
              return absl::OkStatus();
            },
            [] { return absl::OkStatus(); }),
        "memcpy");
    if (std::memcmp(dst.data(), src.data(), bytes) != 0) {
      std::fprintf(stderr, "memcpy: copied bytes differ\n");
      std::exit(2);
    }
    rows.push_back({bytes, gbps, meter.OthersPercent()});
  }
  return rows;
}

struct CopyRow {
  size_t bytes;
  double h2d_gbps, d2h_gbps;
  double others_pct;
};

struct OverlapResult {
  size_t copy_bytes = 0;
  int64_t gemm_n = 0;
  double t_copy = 0, t_gemm = 0, t_both = 0;
  double others_pct = 0;
  double ratio() const { return t_both / (t_copy + t_gemm); }
  double ideal() const { return std::max(t_copy, t_gemm) / (t_copy + t_gemm); }
};

struct BackendResult {
  std::string describe;
  std::vector<CopyRow> copies;
  OverlapResult overlap;
  // CPU only: the overlap again on a backend whose pool (which runs the
  // GEMMs: OpenBLAS is single-threaded under it) has one thread fewer, so a
  // core is left for the copy stream (gemm_threads == 0: not measured).
  OverlapResult overlap_spare_core;
  int gemm_threads = 0, spare_gemm_threads = 0;
};

// A square GEMM of gemm_n on `compute` and a host->device copy on `copy`,
// alone and together; the copy is sized to last about as long as the GEMM.
absl::StatusOr<OverlapResult> RunOverlap(Backend& b, Stream& copy,
                                         Stream& compute, const Buffer& host,
                                         const Buffer& dev, int64_t gemm_n,
                                         double h2d_gbps) {
  OverlapResult ov;
  CpuMeter meter;
  ov.gemm_n = gemm_n;
  const int64_t n = gemm_n;
  std::vector<float> a(n * n);
  FillRandom(a, 7);
  PLATEAU_ASSIGN_OR_RETURN(Buffer da,
                           b.device().Allocate(LiveSet::kWeights, n * n * 4));
  PLATEAU_ASSIGN_OR_RETURN(
      Buffer dc, b.device().Allocate(LiveSet::kActivations, n * n * 4));
  PLATEAU_RETURN_IF_ERROR(b.Copy(compute, da.data(), a.data(), n * n * 4));
  PLATEAU_RETURN_IF_ERROR(compute.Synchronize());
  GemmArgs g;
  g.m = g.n = g.k = n;
  g.a = g.b = da.as<float>();
  g.c = dc.as<float>();
  g.lda = g.ldb = g.ldc = n;
  auto gemm = [&]() -> absl::Status {
    PLATEAU_RETURN_IF_ERROR(b.Gemm(compute, g));
    return compute.Synchronize();
  };
  PLATEAU_ASSIGN_OR_RETURN(Timing tg, TimeRuns(gemm, 1, 3, 0.1, 5));
  ov.t_gemm = tg.best_s;
  ov.copy_bytes = std::clamp<size_t>(
      static_cast<size_t>(ov.t_gemm * h2d_gbps * 1e9) / kMiB * kMiB, kMiB,
      std::min(host.bytes(), dev.bytes()));
  auto copy_only = [&]() -> absl::Status {
    PLATEAU_RETURN_IF_ERROR(b.Copy(copy, dev.data(), host.data(), ov.copy_bytes));
    return copy.Synchronize();
  };
  PLATEAU_ASSIGN_OR_RETURN(Timing tc, TimeRuns(copy_only, 1, 3, 0.1, 5));
  ov.t_copy = tc.best_s;
  auto both = [&]() -> absl::Status {
    PLATEAU_RETURN_IF_ERROR(b.Gemm(compute, g));
    PLATEAU_RETURN_IF_ERROR(b.Copy(copy, dev.data(), host.data(), ov.copy_bytes));
    PLATEAU_RETURN_IF_ERROR(compute.Synchronize());
    return copy.Synchronize();
  };
  PLATEAU_ASSIGN_OR_RETURN(Timing tb, TimeRuns(both, 1, 3, 0.1, 5));
  ov.t_both = tb.best_s;
  ov.others_pct = meter.OthersPercent();
  return ov;
}

absl::StatusOr<BackendResult> RunBackend(Backend& b, int64_t gemm_n) {
  BackendResult out;
  out.describe = b.Describe();
  PLATEAU_ASSIGN_OR_RETURN(auto copy, b.CreateStream("copy"));
  PLATEAU_ASSIGN_OR_RETURN(auto compute, b.CreateStream("compute"));
  const size_t max_bytes = copy_sizes.back();
  PLATEAU_ASSIGN_OR_RETURN(Buffer host,
                           b.host().Allocate(LiveSet::kCheckpoints, max_bytes));
  PLATEAU_ASSIGN_OR_RETURN(
      Buffer dev, b.device().Allocate(LiveSet::kCheckpoints, max_bytes));
  for (size_t i = 0; i < max_bytes; ++i) {
    host.as<char>()[i] = static_cast<char>(i * 131);
  }

  // Bandwidth per direction and size.
  for (size_t bytes : copy_sizes) {
    CopyRow row{bytes, 0, 0, 0};
    CpuMeter meter;
    auto sync = [&] { return copy->Synchronize(); };
    PLATEAU_ASSIGN_OR_RETURN(
        row.h2d_gbps,
        BestGBps(bytes,
                 [&] { return b.Copy(*copy, dev.data(), host.data(), bytes); },
                 sync));
    PLATEAU_ASSIGN_OR_RETURN(
        row.d2h_gbps,
        BestGBps(bytes,
                 [&] { return b.Copy(*copy, host.data(), dev.data(), bytes); },
                 sync));
    row.others_pct = meter.OthersPercent();
    out.copies.push_back(row);
  }
  // The round trips left the host bytes as they were; check the device's.
  std::vector<char> check(max_bytes);
  PLATEAU_RETURN_IF_ERROR(b.Copy(*copy, check.data(), dev.data(), max_bytes));
  PLATEAU_RETURN_IF_ERROR(copy->Synchronize());
  if (std::memcmp(check.data(), host.data(), max_bytes) != 0) {
    return absl::DataLossError("device bytes differ from the host's");
  }

  PLATEAU_ASSIGN_OR_RETURN(
      out.overlap, RunOverlap(b, *copy, *compute, host, dev, gemm_n,
                              out.copies.back().h2d_gbps));
  return out;
}

void PrintBackend(const char* title, const BackendResult& r) {
  std::printf("\n%s: %s\n", title, r.describe.c_str());
  std::printf("%-10s %14s %14s %8s\n", "size", "host->dev GB/s",
              "dev->host GB/s", "others%");
  for (const CopyRow& c : r.copies) {
    std::printf("%-10s %14.2f %14.2f %8.1f\n", SizeText(c.bytes).c_str(),
                c.h2d_gbps, c.d2h_gbps, c.others_pct);
  }
  auto print = [](const OverlapResult& o, const std::string& note) {
    std::printf("overlap: copy %s host->dev on 'copy' + sgemm %lldx%lldx%lld "
                "on 'compute'%s\n",
                SizeText(o.copy_bytes).c_str(), static_cast<long long>(o.gemm_n),
                static_cast<long long>(o.gemm_n),
                static_cast<long long>(o.gemm_n), note.c_str());
    std::printf("%10s %10s %10s %14s %8s %8s\n", "copy ms", "gemm ms",
                "both ms", "overlap ratio", "ideal", "others%");
    std::printf("%10.2f %10.2f %10.2f %14.3f %8.3f %8.1f\n", o.t_copy * 1e3,
                o.t_gemm * 1e3, o.t_both * 1e3, o.ratio(), o.ideal(),
                o.others_pct);
  };
  print(r.overlap, r.gemm_threads > 0
                       ? absl::StrFormat(" (pool of %d threads)", r.gemm_threads)
                       : std::string());
  if (r.gemm_threads > 0) {
    print(r.overlap_spare_core,
          absl::StrFormat(" (pool of %d threads: a core left for the copy)",
                          r.spare_gemm_threads));
  }
}

std::string Json(const BackendResult& r) {
  std::string rows;
  for (const CopyRow& c : r.copies) {
    absl::StrAppend(&rows, rows.empty() ? "" : ",",
                    absl::StrFormat("{\"bytes\":%d,\"h2d_gbps\":%.3f,"
                                    "\"d2h_gbps\":%.3f,\"others_pct\":%.1f}",
                                    c.bytes, c.h2d_gbps, c.d2h_gbps,
                                    c.others_pct));
  }
  auto overlap = [](const OverlapResult& o, int threads) {
    return absl::StrFormat(
        "{\"copy_bytes\":%d,\"gemm_n\":%d,\"gemm_threads\":%d,"
        "\"copy_ms\":%.3f,\"gemm_ms\":%.3f,\"both_ms\":%.3f,"
        "\"ratio\":%.4f,\"ideal\":%.4f,\"others_pct\":%.1f}",
        o.copy_bytes, o.gemm_n, threads, o.t_copy * 1e3, o.t_gemm * 1e3,
        o.t_both * 1e3, o.ratio(), o.ideal(), o.others_pct);
  };
  std::string json = absl::StrFormat(
      "{\"describe\":%s,\"copies\":[%s],\"overlap\":%s",
      JsonString(r.describe), rows, overlap(r.overlap, r.gemm_threads));
  if (r.gemm_threads > 0) {
    absl::StrAppend(&json, ",\"overlap_spare_core\":",
                    overlap(r.overlap_spare_core, r.spare_gemm_threads));
  }
  return json + "}";
}

int Main(int argc, char** argv) {
  bool quick = false;
  if (!QuickOnlyArgs(argc, argv, "copy_bench", &quick)) return 2;
  if (quick) copy_sizes = {64 * kKiB, 1 * kMiB};
  const int64_t cpu_gemm_n = quick ? 128 : 1024, cuda_gemm_n = quick ? 128 : 8192;
  const double load = LoadAverage1m();
  std::printf("copy_bench  %s  (load average %.2f at start)\n", NowText().c_str(),
              load);
  const std::vector<HostRow> host = HostMemcpy();
  std::printf("\nhost memcpy (one thread)\n%-10s %10s %8s\n", "size", "GB/s",
              "others%");
  double best_host = 0;
  std::string host_json;
  for (const HostRow& r : host) {
    std::printf("%-10s %10.2f %8.1f\n", SizeText(r.bytes).c_str(), r.gbps,
                r.others_pct);
    best_host = std::max(best_host, r.gbps);
    absl::StrAppend(&host_json, host_json.empty() ? "" : ",",
                    absl::StrFormat("{\"bytes\":%d,\"gbps\":%.3f,"
                                    "\"others_pct\":%.1f}",
                                    r.bytes, r.gbps, r.others_pct));
  }

  BackendOptions cpu_options;
  cpu_options.device_memory_bytes = int64_t{2} << 30;
  auto cpu = OrDie(Backend::Create(cpu_options), "cpu backend");
  // 1024^3 (--quick: 128^3): tens of milliseconds on a few cores.
  BackendResult cpu_result = OrDie(RunBackend(*cpu, cpu_gemm_n), "cpu");
  // The same GEMM with a core left for the copy stream: a second backend
  // whose pool has one thread fewer (the pool size fixes nothing else: the
  // GEMM's row blocks are the same, so is its result).
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (cores > 1) {
    BackendOptions spare_options = cpu_options;
    spare_options.cpu_threads = cores - 1;
    auto spare = OrDie(Backend::Create(spare_options), "cpu backend, a core spare");
    cpu_result.overlap_spare_core =
        OrDie(RunBackend(*spare, cpu_gemm_n), "cpu, a core spare").overlap;
    cpu_result.gemm_threads = cores;
    cpu_result.spare_gemm_threads = cores - 1;
  }
  PrintBackend("cpu", cpu_result);

  std::string cuda_json;
  BackendOptions cuda_options;
  cuda_options.kind = BackendKind::kCuda;
  auto cuda = Backend::Create(cuda_options);
  if (cuda.ok()) {
    // 8192^3 in fp32 (--quick: 128^3): tens of milliseconds on an H100/H200.
    const BackendResult r = OrDie(RunBackend(**cuda, cuda_gemm_n), "cuda");
    PrintBackend("cuda", r);
    cuda_json = Json(r);
  } else {
    std::printf("\ncuda: skipped (%s)\n", cuda.status().ToString().c_str());
    cuda_json = absl::StrCat("{\"skipped\":",
                             JsonString(cuda.status().ToString()), "}");
  }

  std::printf(
      "{\"bench\":\"copy_bench\",\"time\":%s,\"load_avg_1m\":%.2f,\"host_memcpy\":{\"best_gbps\":"
      "%.3f,\"sizes\":[%s]},\"cpu\":%s,\"cuda\":%s}\n",
      JsonString(NowText()).c_str(), load, best_host, host_json.c_str(),
      Json(cpu_result).c_str(), cuda_json.c_str());
  return 0;
}

}  // namespace
}  // namespace plateau::bench

int main(int argc, char** argv) { return plateau::bench::Main(argc, argv); }
