// sgemm_bench: fp32 GEMM throughput through the Backend interface, the
// ceiling every later model-FLOP/s figure is measured against.
//
// Square sizes 512..4096 and training-shaped products (a token batch times a
// weight, a weight gradient X^T dY with a long inner dimension), on the CPU
// backend (OpenBLAS) and, when this build has it and a GPU is visible, on the
// CUDA backend (cuBLAS, plain FP32). Each shape: one warm-up, then the best
// (and median) of at least three timed runs; when one GEMM takes under
// ~50 ms, a timed run is a batch of back-to-back GEMMs lasting about that
// long, so launch and synchronisation overhead do not count. Every shape's
// result is spot-checked against double dot products on 256 entries (wrong =
// off by more than 2 k u sum|a b|, u = 2^-24).
//
// "others%" is the share of the machine's CPU time that other processes
// took while a shape ran: these cores are shared, and a row taken while
// others were busy understates the ceiling.
//
// On CUDA also the bf16 GEMM (GemmBf16: bf16 A and B, fp32 accumulation,
// one rounding to a bf16 C), the ceiling of a bf16 step: square 4096 and
// the same training shapes; and the expert groups' GEMMs both ways, as one
// GroupedGemmBf16 call (cuBLAS's grouped GEMM) and as one GemmBf16 each
// (cublasGemmEx): the one-by-one/grouped time ratio says whether the
// grouped call pays on this GPU (its kernels may not use the newest tensor
// core instructions). Each bf16 result, the grouped call's C and the one
// by one C alike, is spot-checked as the fp32 ones, plus one bf16 unit of
// |c| for C's rounding.
//
// --quick: two small shapes instead (128^3 and a 64 x 96 x 256 A^T
// product; bf16 128^3 and four 32 x 96 x 64 expert GEMMs), every code path
// in seconds: tools/device-check --emulated.
//
// Output: a table per backend, then one JSON line.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/status_macros.h"

namespace plateau::bench {
namespace {

struct Shape {
  const char* what;
  bool trans_a;
  int64_t m, n, k;
};

// The training-shaped ones are layer GEMMs at H = 1024 with 8192 tokens:
// forward X W (tokens x H x H), an FFN-sized product (4096 x 4096 x 1024),
// and the weight gradient X^T dY, whose inner dimension is the token count.
constexpr Shape kShapes[] = {
    {"square", false, 512, 512, 512},
    {"square", false, 1024, 1024, 1024},
    {"square", false, 2048, 2048, 2048},
    {"square", false, 4096, 4096, 4096},
    {"X W (tokens x H x H)", false, 8192, 1024, 1024},
    {"FFN-sized", false, 4096, 4096, 1024},
    {"dW = X^T dY", true, 1024, 1024, 8192},
};
constexpr Shape kQuickShapes[] = {
    {"square", false, 128, 128, 128},
    {"dW = X^T dY", true, 64, 96, 256},
};

struct Result {
  Shape shape;
  double gflop = 0;
  Timing timing;  // per GEMM
  int inner = 1;  // GEMMs per timed run
  double others_pct = 0;  // CPU time other processes took meanwhile
  int checked = 0;
  int wrong = 0;
  double max_err = 0;  // max |c - ref| / sum|a b| over the checked entries
};

// The spot checks' reference: entry (i, j) of op(A) B from the loaded
// values in double, and sum |a b| over k (what the fp32 sum's error bound
// scales with). A is m x k (k x m when trans_a), B k x n, row-major.
inline double Loaded(float v) { return v; }
inline double Loaded(Bf16 v) { return Bf16ToFloat(v); }
template <typename T>
void ReferenceEntry(const T* a, const T* b, bool trans_a, int64_t m, int64_t n, int64_t k,
                    int64_t i, int64_t j, double* ref, double* mag) {
  const int64_t a_cols = trans_a ? m : k;
  *ref = *mag = 0;
  for (int64_t p = 0; p < k; ++p) {
    const double prod =
        Loaded(trans_a ? a[p * a_cols + i] : a[i * a_cols + p]) * Loaded(b[p * n + j]);
    *ref += prod;
    *mag += std::abs(prod);
  }
}

// The next entry (i, j) of an m x n matrix the spot checks look at (an LCG
// in *x).
void NextEntry(uint64_t* x, int64_t m, int64_t n, int64_t* i, int64_t* j) {
  *x = *x * 6364136223846793005ull + 1442695040888963407ull;
  *i = static_cast<int64_t>((*x >> 33) % m);
  *j = static_cast<int64_t>((*x >> 13) % n);
}

absl::StatusOr<Result> RunShape(Backend& b, Stream& s, const Shape& sh) {
  Result r;
  r.shape = sh;
  r.gflop = 2.0 * sh.m * sh.n * sh.k / 1e9;
  const int64_t a_rows = sh.trans_a ? sh.k : sh.m;
  const int64_t a_cols = sh.trans_a ? sh.m : sh.k;
  std::vector<float> a(a_rows * a_cols), bm(sh.k * sh.n);
  FillRandom(a, 1 + sh.m);
  FillRandom(bm, 2 + sh.n);
  PLATEAU_ASSIGN_OR_RETURN(
      Buffer da, b.device().Allocate(LiveSet::kWeights, a.size() * 4));
  PLATEAU_ASSIGN_OR_RETURN(
      Buffer db, b.device().Allocate(LiveSet::kActivations, bm.size() * 4));
  PLATEAU_ASSIGN_OR_RETURN(
      Buffer dc, b.device().Allocate(LiveSet::kActivations, sh.m * sh.n * 4));
  PLATEAU_RETURN_IF_ERROR(b.Copy(s, da.data(), a.data(), a.size() * 4));
  PLATEAU_RETURN_IF_ERROR(b.Copy(s, db.data(), bm.data(), bm.size() * 4));
  PLATEAU_RETURN_IF_ERROR(s.Synchronize());

  GemmArgs g;
  g.trans_a = sh.trans_a;
  g.m = sh.m;
  g.n = sh.n;
  g.k = sh.k;
  g.a = da.as<float>();
  g.lda = a_cols;
  g.b = db.as<float>();
  g.ldb = sh.n;
  g.c = dc.as<float>();
  g.ldc = sh.n;

  CpuMeter meter;
  PLATEAU_ASSIGN_OR_RETURN(r.timing, TimeBatched(
                                         s, [&] { return b.Gemm(s, g); }, &r.inner));
  r.others_pct = meter.OthersPercent();

  // Spot check against double dot products.
  std::vector<float> c(sh.m * sh.n);
  PLATEAU_RETURN_IF_ERROR(b.Copy(s, c.data(), dc.data(), c.size() * 4));
  PLATEAU_RETURN_IF_ERROR(s.Synchronize());
  uint64_t x = 12345;
  for (int t = 0; t < 256; ++t) {
    int64_t i, j;
    NextEntry(&x, sh.m, sh.n, &i, &j);
    double ref, mag;
    ReferenceEntry(a.data(), bm.data(), sh.trans_a, sh.m, sh.n, sh.k, i, j, &ref, &mag);
    const double err = std::abs(c[i * sh.n + j] - ref);
    r.max_err = std::max(r.max_err, err / mag);
    if (!(err <= 2.0 * sh.k * std::ldexp(1.0, -24) * mag)) ++r.wrong;
    ++r.checked;
  }
  return r;
}

struct BackendRun {
  std::string describe;
  int threads = 1;  // CPU: OpenBLAS threads; CUDA: 1 (one GPU)
  std::vector<Result> results;
};

BackendRun RunBackend(Backend& b, int threads, bool quick) {
  BackendRun run;
  run.describe = b.Describe();
  run.threads = threads;
  auto stream = OrDie(b.CreateStream("compute"), "CreateStream");
  const std::vector<Shape> shapes =
      quick ? std::vector<Shape>(std::begin(kQuickShapes), std::end(kQuickShapes))
            : std::vector<Shape>(std::begin(kShapes), std::end(kShapes));
  for (const Shape& sh : shapes) {
    run.results.push_back(
        OrDie(RunShape(b, *stream, sh),
              absl::StrFormat("%dx%dx%d", sh.m, sh.n, sh.k)));
  }
  return run;
}

// ---- bf16 -------------------------------------------------------------------

// A bf16 GEMM shape, `count` times: one GEMM (count 1), or the expert
// groups' GEMMs (count E, each its own slice of A, B and C).
struct Bf16Shape {
  const char* what;
  bool trans_a;
  int64_t m, n, k;
  int count;
};

// The fp32 shapes' bf16 ceilings, and the expert groups of a layer at
// H = 1024, expert_ffn 2048, 8 experts with 1024 routed rows each (the
// first MLP GEMM, rows x H x F).
constexpr Bf16Shape kBf16Shapes[] = {
    {"square", false, 4096, 4096, 4096, 1},
    {"X W (tokens x H x H)", false, 8192, 1024, 1024, 1},
    {"dW = X^T dY", true, 1024, 1024, 8192, 1},
    {"experts (rows x H x F)", false, 1024, 2048, 1024, 8},
};
constexpr Bf16Shape kQuickBf16Shapes[] = {
    {"square", false, 128, 128, 128, 1},
    {"experts (rows x H x F)", false, 32, 96, 64, 4},
};

struct Bf16Result {
  Bf16Shape shape;
  double gflop = 0;   // all `count` GEMMs
  Timing timing;      // GemmBf16 (count 1) or one GroupedGemmBf16 call
  Timing one_by_one;  // GemmBf16 on each entry (count 1: the same as timing)
  int inner = 1;
  int checked = 0, wrong = 0;
};

std::vector<Bf16> RandomBf16(size_t n, uint64_t seed) {
  std::vector<float> f(n);
  FillRandom(f, seed);
  return ToBf16(f);
}

// 64 entries of each of the `count` C's against double dot products of
// the loaded bf16 values: off by at most 2 k u sum|a b| (the fp32 sum) plus
// one bf16 unit of |c| (its rounding). Adds to *checked and *wrong.
void CheckBf16(const Bf16Shape& sh, const std::vector<Bf16>& a, const std::vector<Bf16>& b,
               const std::vector<Bf16>& c, int* checked, int* wrong) {
  uint64_t x = 777;
  for (int e = 0; e < sh.count; ++e) {
    const Bf16* ae = a.data() + e * sh.m * sh.k;
    const Bf16* be = b.data() + e * sh.k * sh.n;
    const Bf16* ce = c.data() + e * sh.m * sh.n;
    for (int t = 0; t < 64; ++t) {
      int64_t i, j;
      NextEntry(&x, sh.m, sh.n, &i, &j);
      double ref, mag;
      ReferenceEntry(ae, be, sh.trans_a, sh.m, sh.n, sh.k, i, j, &ref, &mag);
      const double got = Bf16ToFloat(ce[i * sh.n + j]);
      const double tol =
          2.0 * sh.k * std::ldexp(1.0, -24) * mag + kBf16UnitRoundoff * std::abs(got);
      if (!(std::abs(got - ref) <= tol)) ++*wrong;
      ++*checked;
    }
  }
}

absl::StatusOr<Bf16Result> RunBf16Shape(Backend& be, Stream& s, const Bf16Shape& sh) {
  Bf16Result r;
  r.shape = sh;
  r.gflop = 2.0 * sh.m * sh.n * sh.k * sh.count / 1e9;
  const int64_t a_n = sh.m * sh.k, b_n = sh.k * sh.n, c_n = sh.m * sh.n;
  const std::vector<Bf16> a = RandomBf16(a_n * sh.count, 3 + sh.m);
  const std::vector<Bf16> b = RandomBf16(b_n * sh.count, 4 + sh.n);
  PLATEAU_ASSIGN_OR_RETURN(Buffer da, be.device().Allocate(LiveSet::kActivations, a.size() * 2));
  PLATEAU_ASSIGN_OR_RETURN(Buffer db, be.device().Allocate(LiveSet::kWeights, b.size() * 2));
  PLATEAU_RETURN_IF_ERROR(be.Copy(s, da.data(), a.data(), a.size() * 2));
  PLATEAU_RETURN_IF_ERROR(be.Copy(s, db.data(), b.data(), b.size() * 2));
  PLATEAU_RETURN_IF_ERROR(s.Synchronize());
  // The `count` GEMMs writing their C's into `dc`; checked once run.
  auto gemms_into = [&](Buffer& dc) {
    std::vector<GemmBf16Args> gemms;
    for (int e = 0; e < sh.count; ++e) {
      GemmBf16Args g;
      g.trans_a = sh.trans_a;
      g.m = sh.m;
      g.n = sh.n;
      g.k = sh.k;
      g.a = da.as<Bf16>() + e * a_n;
      g.lda = sh.trans_a ? sh.m : sh.k;
      g.b = db.as<Bf16>() + e * b_n;
      g.ldb = sh.n;
      g.c = dc.as<Bf16>() + e * c_n;
      g.ldc = sh.n;
      gemms.push_back(g);
    }
    return gemms;
  };
  auto check = [&](const Buffer& dc) -> absl::Status {
    std::vector<Bf16> c(c_n * sh.count);
    PLATEAU_RETURN_IF_ERROR(be.Copy(s, c.data(), dc.data(), c.size() * 2));
    PLATEAU_RETURN_IF_ERROR(s.Synchronize());
    CheckBf16(sh, a, b, c, &r.checked, &r.wrong);
    return absl::OkStatus();
  };
  // One GemmBf16 each: the single GEMM's figure (count 1), the baseline of
  // the grouped call (count > 1).
  PLATEAU_ASSIGN_OR_RETURN(Buffer dc1,
                           be.device().Allocate(LiveSet::kActivations, c_n * sh.count * 2));
  const std::vector<GemmBf16Args> singles = gemms_into(dc1);
  auto one_by_one = [&]() -> absl::Status {
    for (const GemmBf16Args& g : singles) PLATEAU_RETURN_IF_ERROR(be.GemmBf16(s, g));
    return absl::OkStatus();
  };
  int inner = 0;
  PLATEAU_ASSIGN_OR_RETURN(r.one_by_one, TimeBatched(s, one_by_one, &inner));
  PLATEAU_RETURN_IF_ERROR(check(dc1));
  if (sh.count == 1) {
    r.timing = r.one_by_one;
    r.inner = inner;
    return r;
  }
  PLATEAU_ASSIGN_OR_RETURN(Buffer dc,
                           be.device().Allocate(LiveSet::kActivations, c_n * sh.count * 2));
  const std::vector<GemmBf16Args> gemms = gemms_into(dc);
  PLATEAU_ASSIGN_OR_RETURN(r.timing,
                           TimeBatched(
                               s, [&] { return be.GroupedGemmBf16(s, gemms); }, &r.inner));
  PLATEAU_RETURN_IF_ERROR(check(dc));
  return r;
}

std::vector<Bf16Result> RunBf16(Backend& be, bool quick) {
  std::vector<Bf16Result> out;
  auto stream = OrDie(be.CreateStream("compute"), "CreateStream");
  const std::vector<Bf16Shape> shapes =
      quick ? std::vector<Bf16Shape>(std::begin(kQuickBf16Shapes), std::end(kQuickBf16Shapes))
            : std::vector<Bf16Shape>(std::begin(kBf16Shapes), std::end(kBf16Shapes));
  for (const Bf16Shape& sh : shapes) {
    out.push_back(OrDie(RunBf16Shape(be, *stream, sh),
                        absl::StrFormat("bf16 %d x %dx%dx%d", sh.count, sh.m, sh.n, sh.k)));
  }
  return out;
}

void PrintBf16Table(const char* title, const std::vector<Bf16Result>& results) {
  std::printf("\n%s bf16 (GemmBf16; the experts as one GroupedGemmBf16 call):\n", title);
  std::printf("%-24s %-22s %8s %10s %10s %12s %20s %7s\n", "shape", "count x m x n x k", "GFLOP",
              "best ms", "GFLOP/s", "one-by-one ms", "one-by-one/grouped", "wrong");
  for (const Bf16Result& r : results) {
    const Bf16Shape& sh = r.shape;
    const std::string dims =
        absl::StrFormat("%d x %dx%dx%d%s", sh.count, sh.m, sh.n, sh.k, sh.trans_a ? " (A^T)" : "");
    const bool grouped = sh.count > 1;
    std::printf(
        "%-24s %-22s %8.2f %10.3f %10.1f %12s %20s %3d/%d\n", sh.what, dims.c_str(), r.gflop,
        r.timing.best_s * 1e3, r.gflop / r.timing.best_s,
        grouped ? absl::StrFormat("%.3f", r.one_by_one.best_s * 1e3).c_str() : "",
        grouped ? absl::StrFormat("%.3f", r.one_by_one.best_s / r.timing.best_s).c_str() : "",
        r.wrong, r.checked);
  }
}

std::string Bf16Json(const std::vector<Bf16Result>& results) {
  std::string rows;
  double best = 0;
  for (const Bf16Result& r : results) {
    const Bf16Shape& sh = r.shape;
    const double gflops = r.gflop / r.timing.best_s;
    if (sh.count == 1) best = std::max(best, gflops);
    absl::StrAppend(
        &rows, rows.empty() ? "" : ",",
        absl::StrFormat("{\"what\":%s,\"count\":%d,\"m\":%d,\"n\":%d,\"k\":%d,\"trans_a\":%s,"
                        "\"best_ms\":%.4f,\"gflops\":%.2f,\"checked\":%d,\"wrong\":%d",
                        JsonString(sh.what), sh.count, sh.m, sh.n, sh.k,
                        sh.trans_a ? "true" : "false", r.timing.best_s * 1e3, gflops, r.checked,
                        r.wrong));
    if (sh.count > 1) {
      absl::StrAppend(
          &rows, absl::StrFormat(",\"one_by_one_ms\":%.4f,\"one_by_one_over_grouped\":%.4f",
                                 r.one_by_one.best_s * 1e3, r.one_by_one.best_s / r.timing.best_s));
    }
    absl::StrAppend(&rows, "}");
  }
  return absl::StrFormat("{\"best_gflops\":%.2f,\"results\":[%s]}", best, rows);
}

void PrintTable(const char* title, const BackendRun& run) {
  std::printf("\n%s: %s\n", title, run.describe.c_str());
  std::printf("%-22s %-22s %8s %10s %10s %9s %12s %7s %8s\n", "shape",
              "m x n x k", "GFLOP", "best ms", "median ms", "GFLOP/s",
              run.threads > 1 ? "GFLOP/s/core" : "", "wrong", "others%");
  for (const Result& r : run.results) {
    const std::string dims = absl::StrFormat(
        "%dx%dx%d%s", r.shape.m, r.shape.n, r.shape.k,
        r.shape.trans_a ? " (A^T)" : "");
    const double gflops = r.gflop / r.timing.best_s;
    std::printf("%-22s %-22s %8.2f %10.3f %10.3f %9.1f %12s %3d/%d %8.1f\n",
                r.shape.what, dims.c_str(), r.gflop, r.timing.best_s * 1e3,
                r.timing.median_s * 1e3, gflops,
                run.threads > 1
                    ? absl::StrFormat("%.1f", gflops / run.threads).c_str()
                    : "",
                r.wrong, r.checked, r.others_pct);
  }
}

std::string Json(const BackendRun& run) {
  double best = 0;
  std::string rows;
  for (const Result& r : run.results) {
    const double gflops = r.gflop / r.timing.best_s;
    best = std::max(best, gflops);
    absl::StrAppend(
        &rows, rows.empty() ? "" : ",",
        absl::StrFormat(
            "{\"m\":%d,\"n\":%d,\"k\":%d,\"trans_a\":%s,\"best_ms\":%.4f,"
            "\"median_ms\":%.4f,\"gflops\":%.2f,\"gflops_per_core\":%.2f,"
            "\"checked\":%d,\"wrong\":%d,\"max_err\":%.3g,"
            "\"others_pct\":%.1f}",
            r.shape.m, r.shape.n, r.shape.k, r.shape.trans_a ? "true" : "false",
            r.timing.best_s * 1e3, r.timing.median_s * 1e3, gflops,
            gflops / run.threads, r.checked, r.wrong, r.max_err,
            r.others_pct));
  }
  return absl::StrFormat(
      "{\"describe\":%s,\"threads\":%d,\"best_gflops\":%.2f,"
      "\"best_gflops_per_core\":%.2f,\"results\":[%s]}",
      JsonString(run.describe), run.threads, best, best / run.threads, rows);
}

int Main(int argc, char** argv) {
  bool quick = false;
  if (!QuickOnlyArgs(argc, argv, "sgemm_bench", &quick)) return 2;
  const double load = LoadAverage1m();
  std::printf("sgemm_bench  %s  (load average %.2f at start)\n", NowText().c_str(),
              load);
  std::printf("%s, core %s, %d threads; OPENBLAS_CORETYPE=%s "
              "OPENBLAS_L2_SIZE=%s OPENBLAS_NUM_THREADS=%s\n",
              openblas_get_config(), openblas_get_corename(),
              openblas_get_num_threads(), EnvOr("OPENBLAS_CORETYPE").c_str(),
              EnvOr("OPENBLAS_L2_SIZE").c_str(),
              EnvOr("OPENBLAS_NUM_THREADS").c_str());

  BackendOptions cpu_options;
  cpu_options.kind = BackendKind::kCpu;
  cpu_options.device_memory_bytes = int64_t{1} << 30;
  auto cpu = OrDie(Backend::Create(cpu_options), "cpu backend");
  // The backend runs its GEMMs as row blocks on its pool (one per core,
  // OpenBLAS single-threaded under it), so the pool's size is the thread
  // count the per-core rate divides by.
  const BackendRun cpu_run =
      RunBackend(*cpu, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())), quick);
  PrintTable("cpu", cpu_run);

  int wrong = 0;
  for (const Result& r : cpu_run.results) wrong += r.wrong;
  // bf16 on the CPU (an exact emulation, not a speed) only as a check of
  // the code paths.
  std::string cpu_bf16_json = "null", cuda_bf16_json = "null";
  if (quick) {
    const std::vector<Bf16Result> bf16 = RunBf16(*cpu, quick);
    PrintBf16Table("cpu", bf16);
    for (const Bf16Result& r : bf16) wrong += r.wrong;
    cpu_bf16_json = Bf16Json(bf16);
  }
  std::string cuda_json;
  BackendOptions cuda_options;
  cuda_options.kind = BackendKind::kCuda;
  auto cuda = Backend::Create(cuda_options);
  if (cuda.ok()) {
    const BackendRun cuda_run = RunBackend(**cuda, 1, quick);
    PrintTable("cuda", cuda_run);
    for (const Result& r : cuda_run.results) wrong += r.wrong;
    cuda_json = Json(cuda_run);
    const std::vector<Bf16Result> bf16 = RunBf16(**cuda, quick);
    PrintBf16Table("cuda", bf16);
    for (const Bf16Result& r : bf16) wrong += r.wrong;
    cuda_bf16_json = Bf16Json(bf16);
  } else {
    std::printf("\ncuda: skipped (%s)\n", cuda.status().ToString().c_str());
    cuda_json = absl::StrCat("{\"skipped\":",
                             JsonString(cuda.status().ToString()), "}");
  }

  std::printf(
      "{\"bench\":\"sgemm_bench\",\"time\":%s,\"load_avg_1m\":%.2f,\"openblas_coretype\":%s,"
      "\"cpu\":%s,\"cuda\":%s,\"cpu_bf16\":%s,\"cuda_bf16\":%s}\n",
      JsonString(NowText()).c_str(), load, JsonString(EnvOr("OPENBLAS_CORETYPE")).c_str(),
      Json(cpu_run).c_str(), cuda_json.c_str(), cpu_bf16_json.c_str(), cuda_bf16_json.c_str());
  return wrong == 0 ? 0 : 2;  // a wrong result fails the run
}

}  // namespace
}  // namespace plateau::bench

int main(int argc, char** argv) { return plateau::bench::Main(argc, argv); }
