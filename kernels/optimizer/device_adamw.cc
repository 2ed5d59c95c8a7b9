#include "kernels/optimizer/device_adamw.h"

#include "absl/strings/str_cat.h"
#include "kernels/optimizer/host_state.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<DeviceAdamW>> DeviceAdamW::Create(const OptimizerConfig& config,
                                                                 const OptimizerParams& params,
                                                                 Backend& backend, Communicator& world,
                                                                 Stream& stream) {
  std::unique_ptr<DeviceAdamW> o(new DeviceAdamW(config, params, backend, world, stream));
  const int64_t S = params.shard_numel, X = params.owned_numel, f = sizeof(float);
  MemorySpace& dev = backend.device();
  for (auto [b, n] : {std::pair<Buffer*, int64_t>{&o->master_, S}, {&o->m_, S}, {&o->v_, S},
                      {&o->owned_m_, X}, {&o->owned_v_, X}}) {
    PLATEAU_ASSIGN_OR_RETURN(*b, dev.Allocate(LiveSet::kOptimizer, n * f));
  }
  return o;
}

absl::Status DeviceAdamW::Load(const OptimizerShardState& st) {
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
  return Refresh();
}

absl::StatusOr<OptimizerShardState> DeviceAdamW::Save() {
  OptimizerShardState st;
  for (auto [host, b] : {std::pair<std::vector<float>*, Buffer*>{&st.dense_master, &master_},
                         {&st.dense_m, &m_}, {&st.dense_v, &v_}, {&st.owned_m, &owned_m_},
                         {&st.owned_v, &owned_v_}}) {
    host->resize(b->bytes() / sizeof(float));
    // Into host memory: done when Copy returns (backend.h).
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, host->data(), b->data(), b->bytes()));
  }
  return st;
}

absl::Status DeviceAdamW::Update(float clip, int64_t step) {
  const OptimizerConfig& o = config_;
  AdamWArgs a{LearningRateF(o, step), o.beta1, o.beta2, o.eps, o.weight_decay, step, clip};
  PLATEAU_RETURN_IF_ERROR(backend_.AdamW(stream_, master_.as<float>(), params_.dense_grad_shard, m_.as<float>(),
                                         v_.as<float>(), params_.shard_numel, a));
  PLATEAU_RETURN_IF_ERROR(backend_.AdamW(stream_, params_.owned, params_.owned_grad, owned_m_.as<float>(),
                                         owned_v_.as<float>(), params_.owned_numel, a));
  return Refresh();
}

// The working dense weights are the all-gathered masters.
absl::Status DeviceAdamW::Refresh() {
  PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, master_.data(), params_.dense_working, params_.shard_numel,
                                           DataType::kFloat32));
  return stream_.Synchronize();
}

}  // namespace plateau
