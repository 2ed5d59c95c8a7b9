#include "kernels/optimizer/device_adamw.h"

#include "absl/strings/str_cat.h"
#include "kernels/optimizer/host_state.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/status_macros.h"

namespace plateau {
template <typename W>
absl::StatusOr<std::unique_ptr<DeviceAdamWT<W>>> DeviceAdamWT<W>::Create(const OptimizerConfig& config,
                                                                         const OptimizerParamsT<W>& params,
                                                                         Backend& backend, Communicator& world,
                                                                         Stream& stream) {
  std::unique_ptr<DeviceAdamWT> o(new DeviceAdamWT(config, params, backend, world, stream));
  const int64_t S = params.shard_numel, X = params.owned_numel, f = sizeof(float);
  MemorySpace& dev = backend.device();
  for (auto [b, n] : {std::pair<Buffer*, int64_t>{&o->master_, S}, {&o->m_, S}, {&o->v_, S},
                      {&o->owned_m_, X}, {&o->owned_v_, X}}) {
    PLATEAU_ASSIGN_OR_RETURN(*b, dev.Allocate(LiveSet::kOptimizer, n * f));
  }
  if (kSeparateOwnedMaster) {
    PLATEAU_ASSIGN_OR_RETURN(o->owned_master_, dev.Allocate(LiveSet::kOptimizer, X * f));
  }
  return o;
}

template <typename W>
absl::Status DeviceAdamWT<W>::Load(const OptimizerShardState& st) {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(CheckShardState(st, S, X));
  auto put = [&](Buffer& b, const std::vector<float>& host, int64_t n) -> absl::Status {
    if (host.empty()) return backend_.Fill(stream_, b.as<float>(), n, 0.0f);
    // From the caller's memory: done when Copy returns (backend.h).
    return backend_.Copy(stream_, b.data(), host.data(), b.bytes());
  };
  PLATEAU_RETURN_IF_ERROR(put(master_, st.dense_master, S));
  PLATEAU_RETURN_IF_ERROR(put(m_, st.dense_m, S));
  PLATEAU_RETURN_IF_ERROR(put(v_, st.dense_v, S));
  PLATEAU_RETURN_IF_ERROR(put(owned_m_, st.owned_m, X));
  PLATEAU_RETURN_IF_ERROR(put(owned_v_, st.owned_v, X));
  if constexpr (kSeparateOwnedMaster) {
    if (static_cast<int64_t>(st.owned_master.size()) != X) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer state: the owned weights' master has ",
                                                     st.owned_master.size(), " values, expected ", X,
                                                     " (bf16 mixed precision keeps it apart)"));
    }
    PLATEAU_RETURN_IF_ERROR(put(owned_master_, st.owned_master, X));
    // The working copies: rn(master), the owned ones here, the dense
    // shard's into this rank's block (Refresh gathers the blocks).
    PLATEAU_RETURN_IF_ERROR(backend_.ConvertToBf16(stream_, params_.owned, owned_master_.as<float>(), X));
    PLATEAU_RETURN_IF_ERROR(backend_.ConvertToBf16(stream_, OwnBlock(), master_.as<float>(), S));
  }
  return Refresh();
}

template <typename W>
absl::StatusOr<OptimizerShardState> DeviceAdamWT<W>::Save() {
  OptimizerShardState st;
  std::vector<std::pair<std::vector<float>*, Buffer*>> parts = {
      {&st.dense_master, &master_}, {&st.dense_m, &m_}, {&st.dense_v, &v_}, {&st.owned_m, &owned_m_},
      {&st.owned_v, &owned_v_}};
  if (kSeparateOwnedMaster) parts.push_back({&st.owned_master, &owned_master_});
  for (auto [host, b] : parts) {
    host->resize(b->bytes() / sizeof(float));
    // Into host memory: done when Copy returns (backend.h).
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, host->data(), b->data(), b->bytes()));
  }
  return st;
}

template <typename W>
absl::Status DeviceAdamWT<W>::Update(float clip, int64_t step) {
  const OptimizerConfig& o = config_;
  AdamWArgs a{LearningRateF(o, step), o.beta1, o.beta2, o.eps, o.weight_decay, step, clip};
  if constexpr (kSeparateOwnedMaster) {
    // The fp32 masters step with the bf16 gradients loaded exactly; the
    // working copies are written rn(master) in the same pass.
    PLATEAU_RETURN_IF_ERROR(backend_.AdamWBf16(stream_, master_.as<float>(), params_.dense_grad_shard,
                                               m_.as<float>(), v_.as<float>(), OwnBlock(), params_.shard_numel, a));
    PLATEAU_RETURN_IF_ERROR(backend_.AdamWBf16(stream_, owned_master_.as<float>(), params_.owned_grad,
                                               owned_m_.as<float>(), owned_v_.as<float>(), params_.owned,
                                               params_.owned_numel, a));
  } else {
    PLATEAU_RETURN_IF_ERROR(backend_.AdamW(stream_, master_.as<float>(), params_.dense_grad_shard, m_.as<float>(),
                                           v_.as<float>(), params_.shard_numel, a));
    PLATEAU_RETURN_IF_ERROR(backend_.AdamW(stream_, params_.owned, params_.owned_grad, owned_m_.as<float>(),
                                           owned_v_.as<float>(), params_.owned_numel, a));
  }
  return Refresh();
}

// The working dense weights are the all-gathered masters: fp32 straight
// from the master, bf16 in place from each rank's block of rn(master).
template <typename W>
absl::Status DeviceAdamWT<W>::Refresh() {
  const void* send = master_.data();
  if constexpr (kSeparateOwnedMaster) send = OwnBlock();
  PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, send, params_.dense_working, params_.shard_numel, kWorkingDataType<W>));
  return stream_.Synchronize();
}

template class DeviceAdamWT<float>;
template class DeviceAdamWT<Bf16>;

}  // namespace plateau
