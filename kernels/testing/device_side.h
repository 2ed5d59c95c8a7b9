// One backend with a compute stream, for kernel tests: device buffers are
// filled and read back through Backend::Copy only, so a test exercises
// nothing but the Backend interface (the CPU backend's tests and the
// CPU-vs-CUDA twin tests share it).
//
// Output buffers start as NaN (Poisoned): an element an op forgets to write
// stays NaN and fails every comparison.
#ifndef PLATEAU_KERNELS_TESTING_DEVICE_SIDE_H_
#define PLATEAU_KERNELS_TESTING_DEVICE_SIDE_H_

#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace plateau {

// True where the CUDA backend runs on the CPU emulation of the CUDA runtime
// (--config=cuda_emulated, kernels/cuda/emulated/): a GPU test keeps every
// check and shrinks only what is sized to keep a real GPU busy.
#if defined(PLATEAU_CUDA_EMULATED)
inline constexpr bool kCudaEmulated = true;
#else
inline constexpr bool kCudaEmulated = false;
#endif

// True when `status` (from creating a CUDA backend or its model kernels)
// says only that there is no GPU to use here: a build without
// --config=cuda, or no visible device. A CUDA test skips then, and fails on
// any other error: where a GPU is present, a setup failure is a failure.
inline bool NoCudaHere(const absl::Status& status) {
  const absl::string_view m = status.message();
  return (status.code() == absl::StatusCode::kFailedPrecondition ||
          status.code() == absl::StatusCode::kUnimplemented) &&
         (absl::StrContains(m, "this build has no CUDA") ||
          absl::StrContains(m, "no GPU is visible"));
}

class DeviceSide {
 public:
  DeviceSide() = default;
  DeviceSide(const DeviceSide&) = delete;
  DeviceSide& operator=(const DeviceSide&) = delete;
  ~DeviceSide() {
    if (stream_ != nullptr) (void)stream_->Synchronize();
    buffers_.clear();
    stream_.reset();  // streams go before their backend
  }

  // Takes the backend and creates its compute stream.
  absl::Status Init(std::unique_ptr<Backend> backend) {
    backend_ = std::move(backend);
    auto stream = backend_->CreateStream("compute");
    if (!stream.ok()) return stream.status();
    stream_ = std::move(*stream);
    return absl::OkStatus();
  }

  bool ready() const { return stream_ != nullptr; }
  Backend& b() { return *backend_; }
  Stream& s() { return *stream_; }

  // A device buffer holding `host` (live set kActivations).
  float* Upload(const std::vector<float>& host) {
    auto buf = backend_->device().Allocate(LiveSet::kActivations, host.size() * sizeof(float));
    EXPECT_TRUE(buf.ok()) << buf.status();
    if (!buf.ok()) return nullptr;
    float* d = buf->as<float>();
    EXPECT_TRUE(backend_->Copy(*stream_, d, host.data(), host.size() * sizeof(float)).ok());
    EXPECT_TRUE(stream_->Synchronize().ok());
    buffers_.push_back(std::move(*buf));
    return d;
  }
  float* Poisoned(int64_t n) { return Upload(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN())); }

  std::vector<float> Download(const float* d, int64_t n) {
    std::vector<float> host(n, std::numeric_limits<float>::quiet_NaN());
    EXPECT_TRUE(stream_->Synchronize().ok());
    EXPECT_TRUE(backend_->Copy(*stream_, host.data(), d, n * sizeof(float)).ok());
    EXPECT_TRUE(stream_->Synchronize().ok());
    return host;
  }
  // Several device arrays (pointer, length), one after the other.
  std::vector<float> DownloadAll(const std::vector<std::pair<const float*, int64_t>>& parts) {
    std::vector<float> all;
    for (const auto& [p, n] : parts) {
      std::vector<float> part = Download(p, n);
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }

  // bf16 buffers (kernels/bf16.h), as Upload / Poisoned / Download. The
  // poison is bf16's NaN, so an element an op forgets to write stays NaN.
  Bf16* UploadBf16(const std::vector<Bf16>& host) {
    auto buf = backend_->device().Allocate(LiveSet::kActivations, host.size() * sizeof(Bf16));
    EXPECT_TRUE(buf.ok()) << buf.status();
    if (!buf.ok()) return nullptr;
    Bf16* d = buf->as<Bf16>();
    EXPECT_TRUE(backend_->Copy(*stream_, d, host.data(), host.size() * sizeof(Bf16)).ok());
    EXPECT_TRUE(stream_->Synchronize().ok());
    buffers_.push_back(std::move(*buf));
    return d;
  }
  Bf16* PoisonedBf16(int64_t n) { return UploadBf16(std::vector<Bf16>(n, Bf16{0x7fc0})); }
  std::vector<Bf16> DownloadBf16(const Bf16* d, int64_t n) {
    std::vector<Bf16> host(n, Bf16{0x7fc0});
    EXPECT_TRUE(stream_->Synchronize().ok());
    EXPECT_TRUE(backend_->Copy(*stream_, host.data(), d, n * sizeof(Bf16)).ok());
    EXPECT_TRUE(stream_->Synchronize().ok());
    return host;
  }

 private:
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  std::vector<Buffer> buffers_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_DEVICE_SIDE_H_
