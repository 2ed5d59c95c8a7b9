#include "kernels/optimizer/cpu_offload_adamw.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_bf16_ops.h"
#include "kernels/cpu_ops.h"
#include "kernels/optimizer/host_state.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/status_macros.h"

namespace plateau {
template <typename W>
absl::StatusOr<std::unique_ptr<CpuOffloadAdamWT<W>>> CpuOffloadAdamWT<W>::Create(const OptimizerConfig& config,
                                                                               const OptimizerParamsT<W>& params,
                                                                               Backend& backend, Communicator& world,
                                                                               Stream& stream, int threads) {
  if (threads < 0) return absl::InvalidArgumentError(absl::StrCat("threads: expected >= 0, got ", threads));
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  std::unique_ptr<CpuOffloadAdamWT> o(new CpuOffloadAdamWT(config, params, backend, world, stream, threads));
  const int64_t n = params.shard_numel + params.owned_numel, f = sizeof(float);
  for (Buffer* b : {&o->param_, &o->m_, &o->v_}) {
    PLATEAU_ASSIGN_OR_RETURN(*b, backend.host().Allocate(LiveSet::kOptimizer, n * f));
  }
  // The gradients as the step holds them (bf16: 2 bytes, CpuOffloadAdamWBytes' e.working).
  PLATEAU_ASSIGN_OR_RETURN(o->grad_, backend.host().Allocate(LiveSet::kOptimizer, n * int64_t{sizeof(W)}));
  return o;
}

template <typename W>
absl::Status CpuOffloadAdamWT<W>::Load(const OptimizerShardState& st) {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(CheckShardState(st, S, X));
  if (kSeparateOwnedMaster && static_cast<int64_t>(st.owned_master.size()) != X) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer state: the owned weights' master has ",
                                                   st.owned_master.size(), " values, expected ", X,
                                                   " (bf16 mixed precision keeps it apart)"));
  }
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  std::copy_n(st.dense_master.data(), S, param_.as<float>());
  if (kSeparateOwnedMaster) std::copy_n(st.owned_master.data(), X, param_.as<float>() + S);
  PutOrZero(st.dense_m, S, m_.as<float>());
  PutOrZero(st.owned_m, X, m_.as<float>() + S);
  PutOrZero(st.dense_v, S, v_.as<float>());
  PutOrZero(st.owned_v, X, v_.as<float>() + S);
  return Refresh();
}

template <typename W>
absl::StatusOr<OptimizerShardState> CpuOffloadAdamWT<W>::Save() {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  OptimizerShardState st;
  st.dense_master.assign(param_.as<float>(), param_.as<float>() + S);
  if (kSeparateOwnedMaster) st.owned_master.assign(param_.as<float>() + S, param_.as<float>() + S + X);
  st.dense_m.assign(m_.as<float>(), m_.as<float>() + S);
  st.owned_m.assign(m_.as<float>() + S, m_.as<float>() + S + X);
  st.dense_v.assign(v_.as<float>(), v_.as<float>() + S);
  st.owned_v.assign(v_.as<float>() + S, v_.as<float>() + S + X);
  return st;
}

template <typename W>
template <typename Fn>
void CpuOffloadAdamWT<W>::OnHostThreads(Fn fn) const {
  // Chunks of whole cache lines of W (16 floats, 32 bf16), so no two
  // threads write one line of the gradient buffer.
  constexpr int64_t kLine = 64 / sizeof(W);
  const int64_t n = params_.shard_numel + params_.owned_numel;
  const int64_t chunk = ((n + threads_ - 1) / threads_ + kLine - 1) / kLine * kLine;
  std::vector<std::thread> pool;
  for (int64_t lo = 0; lo < n; lo += chunk) {
    const int64_t len = std::min(chunk, n - lo);
    pool.emplace_back([&fn, lo, len] { fn(lo, len); });
  }
  for (std::thread& t : pool) t.join();
}

template <typename W>
absl::Status CpuOffloadAdamWT<W>::Update(float clip, int64_t step) {
  const OptimizerConfig& o = config_;
  const AdamWArgs a{LearningRateF(o, step), o.beta1, o.beta2, o.eps, o.weight_decay, step, clip};
  const int64_t S = params_.shard_numel, X = params_.owned_numel, w = sizeof(W);
  // Down: the gradients (in W, as the step reduced them).
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, grad_.as<W>(), params_.dense_grad_shard, S * w));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, grad_.as<W>() + S, params_.owned_grad, X * w));
  if constexpr (kSeparateOwnedMaster) {
    PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
    // AdamW on the host's cores, DeviceAdamWT<Bf16>'s arithmetic
    // (cpu::AdamWBf16): each gradient loaded exactly, the fp32 AdamW, the
    // working copy rn(master) written over the gradient it came from. In
    // blocks through a small stack buffer (the loaded gradients): the
    // kernel is elementwise with one formula for every element whatever
    // the split (cpu_ops.cc), so blocks change no bit.
    OnHostThreads([this, &a](int64_t lo, int64_t len) {
      constexpr int64_t kBlock = 2048;
      float g[kBlock];
      float* master = param_.as<float>();
      W* io = grad_.as<W>();
      for (int64_t b = lo; b < lo + len; b += kBlock) {
        const int64_t n = std::min(kBlock, lo + len - b);
        cpu::ConvertToFloat(g, io + b, n);
        cpu::AdamW(master + b, g, m_.as<float>() + b, v_.as<float>() + b, n, a);
        cpu::ConvertToBf16(io + b, master + b, n);
      }
    });
    return UploadWorking();
  } else {
    // The owned weights too (authoritative on the device).
    const int64_t f = sizeof(float);
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, param_.as<float>() + S, params_.owned, X * f));
    PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
    // AdamW on the host's cores, in chunks of whole cache lines.
    OnHostThreads([this, &a](int64_t lo, int64_t len) {
      cpu::AdamW(param_.as<float>() + lo, grad_.as<float>() + lo, m_.as<float>() + lo, v_.as<float>() + lo, len,
                 a);
    });
    // Up: the owned weights, and the dense master into the working weights.
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, params_.owned, param_.as<float>() + S, X * f));
    return Refresh();
  }
}

template <typename W>
absl::Status CpuOffloadAdamWT<W>::Refresh() {
  const int64_t S = params_.shard_numel;
  if constexpr (kSeparateOwnedMaster) {
    // The working copies rn(master) of both groups, staged in the gradient
    // buffer (idle outside Update).
    OnHostThreads([this](int64_t lo, int64_t len) {
      cpu::ConvertToBf16(grad_.as<W>() + lo, param_.as<float>() + lo, len);
    });
    return UploadWorking();
  } else {
    float* own_region = params_.dense_working + world_.rank() * S;
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, own_region, param_.as<float>(), S * sizeof(float)));
    PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, own_region, params_.dense_working, S, DataType::kFloat32));
    return stream_.Synchronize();
  }
}

template <typename W>
absl::Status CpuOffloadAdamWT<W>::UploadWorking() {
  const int64_t S = params_.shard_numel, X = params_.owned_numel, w = sizeof(W);
  W* own_region = params_.dense_working + world_.rank() * S;
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, own_region, grad_.as<W>(), S * w));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, params_.owned, grad_.as<W>() + S, X * w));
  PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, own_region, params_.dense_working, S, kWorkingDataType<W>));
  // The staging buffer is read by the copies up: nothing touches it again
  // before they are done.
  return stream_.Synchronize();
}

template class CpuOffloadAdamWT<float>;
template class CpuOffloadAdamWT<Bf16>;

}  // namespace plateau
