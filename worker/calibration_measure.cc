#include "worker/calibration_measure.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <functional>
#include <memory>

#include "kernels/budget/auto_settings.h"
#include "kernels/memory.h"
#include "kernels/status_macros.h"
#include "kernels/stream.h"
#include "worker/calibration.h"

namespace plateau {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The fastest of `runs` runs of `op` on `stream`, each timed from enqueue to
// done: a busy machine only ever makes a run slower.
absl::StatusOr<double> Fastest(int runs, Stream& stream, const std::function<absl::Status()>& op) {
  double best = 0;
  for (int r = 0; r < runs; ++r) {
    const Clock::time_point t = Clock::now();
    PLATEAU_RETURN_IF_ERROR(op());
    PLATEAU_RETURN_IF_ERROR(stream.Synchronize());
    const double s = Since(t);
    if (r == 0 || s < best) best = s;
  }
  // A clock tick of 0 would make a rate infinite.
  return std::max(best, 1e-9);
}

}  // namespace

absl::StatusOr<v1::Calibration> MeasureCalibration(Backend& backend) {
  const Clock::time_point start = Clock::now();
  constexpr int64_t D = kCalibrationGemmDim, kMaxRows = 4096;
  constexpr int64_t kCopyBytes = int64_t{16} << 20, kAdamParams = int64_t{1} << 20;
  PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, backend.CreateStream("calibration"));
  MemorySpace& dev = backend.device();
  // GEMM operands (A, C: [4096 x 256]; B: [256 x 256]) and the copy's
  // device side; the AdamW state reuses the copy buffer (4 x 1M floats).
  PLATEAU_ASSIGN_OR_RETURN(Buffer a, dev.Allocate(LiveSet::kWorkspace, kMaxRows * D * sizeof(float)));
  PLATEAU_ASSIGN_OR_RETURN(Buffer b, dev.Allocate(LiveSet::kWorkspace, D * D * sizeof(float)));
  PLATEAU_ASSIGN_OR_RETURN(Buffer c, dev.Allocate(LiveSet::kWorkspace, kMaxRows * D * sizeof(float)));
  PLATEAU_ASSIGN_OR_RETURN(Buffer d, dev.Allocate(LiveSet::kWorkspace, kCopyBytes));
  PLATEAU_ASSIGN_OR_RETURN(Buffer h, backend.host().Allocate(LiveSet::kWorkspace, kCopyBytes));
  // Small finite values (uninitialised memory could hold NaN or denormals,
  // which are slower on some CPUs).
  PLATEAU_RETURN_IF_ERROR(backend.Fill(*stream, a.as<float>(), kMaxRows * D, 0.5f));
  PLATEAU_RETURN_IF_ERROR(backend.Fill(*stream, b.as<float>(), D * D, 0.25f));
  PLATEAU_RETURN_IF_ERROR(backend.Fill(*stream, d.as<float>(), kCopyBytes / sizeof(float), 0.125f));
  PLATEAU_RETURN_IF_ERROR(stream->Synchronize());
  std::fill(h.as<float>(), h.as<float>() + kCopyBytes / sizeof(float), 0.125f);

  v1::Calibration out;
  out.set_backend(backend.Describe());
  PLATEAU_ASSIGN_OR_RETURN(const double launch, Fastest(50, *stream, [&] {
                             return backend.Fill(*stream, c.as<float>(), 1, 0.0f);
                           }));
  out.set_launch_seconds(launch);
  for (int64_t rows = 1; rows <= kMaxRows; rows *= 4) {
    GemmArgs g;
    g.m = rows;
    g.n = D;
    g.k = D;
    g.a = a.as<float>();
    g.lda = D;
    g.b = b.as<float>();
    g.ldb = D;
    g.c = c.as<float>();
    g.ldc = D;
    PLATEAU_RETURN_IF_ERROR(backend.Gemm(*stream, g));  // warm-up (threads, caches)
    PLATEAU_ASSIGN_OR_RETURN(const double s, Fastest(rows >= 1024 ? 3 : 7, *stream, [&] {
                               return backend.Gemm(*stream, g);
                             }));
    v1::Calibration::GemmPoint* p = out.add_gemm();
    p->set_rows(rows);
    p->set_seconds(s);
  }
  PLATEAU_ASSIGN_OR_RETURN(const double up, Fastest(3, *stream, [&] {
                             return backend.Copy(*stream, d.data(), h.data(), kCopyBytes);
                           }));
  PLATEAU_ASSIGN_OR_RETURN(const double down, Fastest(3, *stream, [&] {
                             return backend.Copy(*stream, h.data(), d.data(), kCopyBytes);
                           }));
  out.set_h2d_bytes_per_second(kCopyBytes / up);
  out.set_d2h_bytes_per_second(kCopyBytes / down);
  float* base = d.as<float>();
  AdamWArgs args;
  args.lr = 1e-6f;  // keeps the values finite over the runs
  PLATEAU_ASSIGN_OR_RETURN(const double adamw, Fastest(3, *stream, [&] {
                             return backend.AdamW(*stream, base, base + kAdamParams, base + 2 * kAdamParams,
                                                  base + 3 * kAdamParams, kAdamParams, args);
                           }));
  out.set_adamw_params_per_second(kAdamParams / adamw);
  out.set_collective_seconds(backend.kind() == BackendKind::kCuda ? kCudaCollectiveSeconds
                                                                   : kCpuCollectiveSeconds);
  out.set_measured_unix_seconds(static_cast<int64_t>(std::time(nullptr)));
  out.set_measure_seconds(Since(start));
  return out;
}

}  // namespace plateau
