#include "kernels/cpu_backend.h"

#include <cblas.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/cpu_bf16_ops.h"
#include "kernels/cpu_ops.h"
#include "kernels/cpu_stream.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

// The backend's GEMMs run as tasks on its pool (cpu::Gemm), one
// single-threaded sgemm each, so OpenBLAS is set to one thread (process-wide:
// every CPU backend of a process does the same). Its own workers would
// otherwise spin in sched_yield for ~2^28 cycles after each call, against
// the pool's threads running the next kernel.
std::shared_ptr<CpuPool> MakePool(int threads) {
  openblas_set_num_threads(1);
  return std::make_shared<CpuPool>(threads);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& o)
      : pool_(MakePool(o.cpu_threads)),
        streams_(std::make_shared<CpuStreamSet>()),
        device_(SpaceKind::kDevice, "device", o.device_memory_bytes,
                [s = streams_] { s->Drain(); }),
        host_(SpaceKind::kHost, "host", o.host_memory_bytes, [s = streams_] { s->Drain(); }),
        copy_delay_(absl::Microseconds(o.copy_delay_us_for_testing)) {}

  const std::shared_ptr<CpuPool>& pool() const { return pool_; }

  BackendKind kind() const override { return BackendKind::kCpu; }
  // Every bf16 op of the step is here: the fp32 op on the loaded values,
  // rounded once per stored element (cpu_bf16_ops.h, cpu_bf16_layers.h).
  bool computes_bf16() const override { return true; }

  std::string Describe() const override {
    // openblas_get_config() already begins with "OpenBLAS <version>".
    return absl::StrCat("cpu (", openblas_get_config(), ", ",
                        openblas_get_num_threads(), " thread per sgemm call; a pool of ",
                        pool_->threads(), " threads for the GEMMs and other kernels; device arena ",
                        device_.cap_bytes(), " bytes)");
  }

  MemorySpace& device() override { return device_; }
  MemorySpace& host() override { return host_; }

  // Every CPU stream runs anything: `use` changes nothing here.
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream(absl::string_view name,
                                                       StreamUse /*use*/ = StreamUse::kCompute) override {
    return std::make_unique<CpuStream>(std::string(name), streams_);
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::make_unique<CpuEvent>();
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateTimingEvent() override {
    return std::make_unique<CpuEvent>(/*timing=*/true);
  }

 protected:
  // Every operation becomes one task on the stream's thread.
  template <typename F>
  absl::Status Run(Stream& stream, F&& f) {
    auto* s = dynamic_cast<CpuStream*>(&stream);
    if (s == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stream '", stream.name(), "' does not belong to the CPU backend"));
    }
    s->Enqueue([f = std::forward<F>(f)]() {
      f();
      return absl::OkStatus();
    });
    return absl::OkStatus();
  }

  // Memory of the caller's own (a std::vector, a stack array) is copied
  // before Copy returns, as cudaMemcpyAsync does with pageable memory: the
  // caller may free it on any path, errors included, once Copy is back.
  // Between the backend's spaces the copy is asynchronous.
  absl::Status DoCopy(Stream& st, void* dst, const void* src,
                      size_t bytes) override {
    const bool crosses = (device_.Contains(dst, bytes) && host_.Contains(src, bytes)) ||
                         (host_.Contains(dst, bytes) && device_.Contains(src, bytes));
    const absl::Duration delay = crosses ? copy_delay_ : absl::ZeroDuration();
    PLATEAU_RETURN_IF_ERROR(Run(st, [=] {
      if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
      std::memcpy(dst, src, bytes);
    }));
    if (InSpaces(dst, bytes) && InSpaces(src, bytes)) return absl::OkStatus();
    return st.Synchronize();
  }
  absl::Status DoGemm(Stream& st, const GemmArgs& g) override {
    return Run(st, [=, p = pool_.get()] { cpu::Gemm(g, p); });
  }
  // The CUDA grouped GEMM's twin: the same sgemm calls, in order, as one
  // task.
  absl::Status DoGroupedGemm(Stream& st, absl::Span<const GemmArgs> gemms) override {
    return Run(st, [all = std::vector<GemmArgs>(gemms.begin(), gemms.end()), p = pool_.get()] {
      for (const GemmArgs& g : all) cpu::Gemm(g, p);
    });
  }
  absl::Status DoFill(Stream& st, float* x, int64_t n, float value) override {
    return Run(st, [=, p = pool_.get()] { cpu::Fill(x, n, value, p); });
  }
  absl::Status DoScale(Stream& st, float* x, int64_t n, float alpha) override {
    return Run(st, [=, p = pool_.get()] { cpu::Scale(x, n, alpha, p); });
  }
  absl::Status DoAxpy(Stream& st, float* y, const float* x, int64_t n,
                      float alpha) override {
    return Run(st, [=, p = pool_.get()] { cpu::Axpy(y, x, n, alpha, p); });
  }
  absl::Status DoAdd(Stream& st, float* out, const float* a, const float* b,
                     int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::Add(out, a, b, n, p); });
  }
  absl::Status DoMul(Stream& st, float* out, const float* a, const float* b,
                     int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::Mul(out, a, b, n, p); });
  }
  absl::Status DoSwiGluForward(Stream& st, float* out, const float* gate,
                               const float* up, int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::SwiGluForward(out, gate, up, n, p); });
  }
  absl::Status DoSwiGluBackward(Stream& st, float* dgate, float* dup,
                                const float* dout, const float* gate,
                                const float* up, int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::SwiGluBackward(dgate, dup, dout, gate, up, n, p); });
  }
  absl::Status DoRmsNormForward(Stream& st, float* out, float* rstd,
                                const float* x, const float* weight,
                                int64_t rows, int64_t cols,
                                float eps) override {
    return Run(st, [=, p = pool_.get()] {
      cpu::RmsNormForward(out, rstd, x, weight, rows, cols, eps, p);
    });
  }
  absl::Status DoRmsNormBackward(Stream& st, float* dx, float* dweight,
                                 const float* dout, const float* x,
                                 const float* weight, const float* rstd,
                                 int64_t rows, int64_t cols) override {
    return Run(st, [=, p = pool_.get()] {
      cpu::RmsNormBackward(dx, dweight, dout, x, weight, rstd, rows, cols, p);
    });
  }
  absl::Status DoSoftmaxRows(Stream& st, float* y, const float* x,
                             int64_t rows, int64_t cols) override {
    return Run(st, [=, p = pool_.get()] { cpu::SoftmaxRows(y, x, rows, cols, p); });
  }
  absl::Status DoLogSumExpRows(Stream& st, float* out, const float* x,
                               int64_t rows, int64_t cols) override {
    return Run(st, [=, p = pool_.get()] { cpu::LogSumExpRows(out, x, rows, cols, p); });
  }
  absl::Status DoSum(Stream& st, float* out, const float* x,
                     int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::Sum(out, x, n, p); });
  }
  absl::Status DoSumSquares(Stream& st, float* out, const float* x,
                            int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::SumSquares(out, x, n, p); });
  }
  absl::Status DoAdamW(Stream& st, float* param, const float* grad, float* m,
                       float* v, int64_t n, const AdamWArgs& args) override {
    return Run(st, [=, p = pool_.get()] { cpu::AdamW(param, grad, m, v, n, args, p); });
  }

  // bf16 mixed precision: the emulation of kernels/cpu_bf16_ops.h.
  absl::Status DoGemmBf16(Stream& st, const GemmBf16Args& g) override {
    return Run(st, [=] { cpu::GemmBf16(g); });
  }
  // As DoGroupedGemm: the same GEMMs, in order, as one task.
  absl::Status DoGroupedGemmBf16(Stream& st, absl::Span<const GemmBf16Args> gemms) override {
    return Run(st, [all = std::vector<GemmBf16Args>(gemms.begin(), gemms.end())] {
      for (const GemmBf16Args& g : all) cpu::GemmBf16(g);
    });
  }
  absl::Status DoConvertToBf16(Stream& st, Bf16* out, const float* x, int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::ConvertToBf16(out, x, n, p); });
  }
  absl::Status DoConvertToFloat(Stream& st, float* out, const Bf16* x, int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::ConvertToFloat(out, x, n, p); });
  }
  absl::Status DoSwiGluForwardBf16(Stream& st, Bf16* out, const Bf16* gate, const Bf16* up,
                                   int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::SwiGluForwardBf16(out, gate, up, n, p); });
  }
  absl::Status DoSwiGluBackwardBf16(Stream& st, Bf16* dgate, Bf16* dup, const Bf16* dout,
                                    const Bf16* gate, const Bf16* up, int64_t n) override {
    return Run(st, [=, p = pool_.get()] {
      cpu::SwiGluBackwardBf16(dgate, dup, dout, gate, up, n, p);
    });
  }
  absl::Status DoRmsNormForwardBf16(Stream& st, Bf16* out, float* rstd, const Bf16* x,
                                    const Bf16* weight, int64_t rows, int64_t cols,
                                    float eps) override {
    return Run(st, [=, p = pool_.get()] {
      cpu::RmsNormForwardBf16(out, rstd, x, weight, rows, cols, eps, p);
    });
  }
  absl::Status DoRmsNormBackwardBf16(Stream& st, Bf16* dx, Bf16* dweight, const Bf16* dout,
                                     const Bf16* x, const Bf16* weight, const float* rstd,
                                     int64_t rows, int64_t cols) override {
    return Run(st, [=, p = pool_.get()] {
      cpu::RmsNormBackwardBf16(dx, dweight, dout, x, weight, rstd, rows, cols, p);
    });
  }
  absl::Status DoFillBf16(Stream& st, Bf16* x, int64_t n, float value) override {
    return Run(st, [=, p = pool_.get()] { cpu::FillBf16(x, n, value, p); });
  }
  absl::Status DoAddBf16(Stream& st, Bf16* out, const Bf16* a, const Bf16* b,
                         int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::AddBf16(out, a, b, n, p); });
  }
  absl::Status DoSumSquaresBf16(Stream& st, float* out, const Bf16* x, int64_t n) override {
    return Run(st, [=, p = pool_.get()] { cpu::SumSquaresBf16(out, x, n, p); });
  }
  absl::Status DoSumRowsBf16(Stream& st, Bf16* out, const Bf16* x, int64_t rows, int64_t n, int64_t ld) override {
    return Run(st, [=, p = pool_.get()] { cpu::SumRowsBf16(out, x, rows, n, ld, p); });
  }
  absl::Status DoAddRowsBf16(Stream& st, Bf16* out, const Bf16* x, absl::Span<const int32_t> rows, int64_t ld,
                             int64_t n) override {
    // The list is the caller's (often a temporary): the task keeps a copy.
    return Run(st, [=, r = std::vector<int32_t>(rows.begin(), rows.end()), p = pool_.get()] {
      cpu::AddRowsBf16(out, x, r.data(), static_cast<int64_t>(r.size()), ld, n, p);
    });
  }
  absl::Status DoAdamWBf16(Stream& st, float* master, const Bf16* grad, float* m, float* v,
                           Bf16* working, int64_t n, const AdamWArgs& args) override {
    return Run(st, [=, p = pool_.get()] {
      cpu::AdamWBf16(master, grad, m, v, working, n, args, p);
    });
  }

 private:
  bool InSpaces(const void* p, size_t bytes) const {
    return device_.Contains(p, bytes) || host_.Contains(p, bytes);
  }

  // First, so destroyed last: queued tasks hold it by raw pointer.
  const std::shared_ptr<CpuPool> pool_;  // BackendOptions::cpu_threads
  // Before the spaces: their release fences drain these streams.
  std::shared_ptr<CpuStreamSet> streams_;
  HeapSpace device_;
  HeapSpace host_;
  const absl::Duration copy_delay_;  // BackendOptions::copy_delay_us_for_testing
};

}  // namespace

std::shared_ptr<CpuPool> CpuBackendPool(Backend& backend) {
  auto* cpu = dynamic_cast<CpuBackend*>(&backend);
  return cpu == nullptr ? nullptr : cpu->pool();
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(
    const BackendOptions& options) {
  if (options.device_memory_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device_memory_bytes: the CPU backend's device arena needs a size "
        "> 0 bytes, got ",
        options.device_memory_bytes));
  }
  return std::make_unique<CpuBackend>(options);
}

}  // namespace plateau
