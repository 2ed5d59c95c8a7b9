#include "kernels/optimizer/cpu_offload_adamw.h"

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_ops.h"
#include "kernels/optimizer/host_state.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/optimizer/optimizer_plan.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<CpuOffloadAdamW>> CpuOffloadAdamW::Create(const OptimizerConfig& config,
                                                                         const OptimizerParams& params,
                                                                         Backend& backend, Communicator& world,
                                                                         Stream& stream, int threads) {
  if (threads < 0) return absl::InvalidArgumentError(absl::StrCat("threads: expected >= 0, got ", threads));
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  std::unique_ptr<CpuOffloadAdamW> o(new CpuOffloadAdamW(config, params, backend, world, stream, threads));
  const int64_t n = params.shard_numel + params.owned_numel, f = sizeof(float);
  for (Buffer* b : {&o->param_, &o->m_, &o->v_, &o->grad_}) {
    PLATEAU_ASSIGN_OR_RETURN(*b, backend.host().Allocate(LiveSet::kOptimizer, n * f));
  }
  return o;
}

absl::Status CpuOffloadAdamW::Load(const OptimizerShardState& st) {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(CheckShardState(st, S, X));
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  std::copy_n(st.dense_master.data(), S, param_.as<float>());
  PutOrZero(st.dense_m, S, m_.as<float>());
  PutOrZero(st.owned_m, X, m_.as<float>() + S);
  PutOrZero(st.dense_v, S, v_.as<float>());
  PutOrZero(st.owned_v, X, v_.as<float>() + S);
  return Refresh();
}

absl::StatusOr<OptimizerShardState> CpuOffloadAdamW::Save() {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  OptimizerShardState st;
  st.dense_master.assign(param_.as<float>(), param_.as<float>() + S);
  st.dense_m.assign(m_.as<float>(), m_.as<float>() + S);
  st.owned_m.assign(m_.as<float>() + S, m_.as<float>() + S + X);
  st.dense_v.assign(v_.as<float>(), v_.as<float>() + S);
  st.owned_v.assign(v_.as<float>() + S, v_.as<float>() + S + X);
  return st;
}

absl::Status CpuOffloadAdamW::Update(float clip, int64_t step) {
  const OptimizerConfig& o = config_;
  const AdamWArgs a{LearningRateF(o, step), o.beta1, o.beta2, o.eps, o.weight_decay, step, clip};
  const int64_t S = params_.shard_numel, X = params_.owned_numel, f = sizeof(float);
  // Down: the gradients, and the owned weights (authoritative on the device).
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, grad_.as<float>(), params_.dense_grad_shard, S * f));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, grad_.as<float>() + S, params_.owned_grad, X * f));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, param_.as<float>() + S, params_.owned, X * f));
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  // AdamW on the host's cores, in chunks of whole cache lines.
  const int64_t n = S + X;
  const int64_t chunk = ((n + threads_ - 1) / threads_ + 15) / 16 * 16;
  std::vector<std::thread> pool;
  for (int64_t lo = 0; lo < n; lo += chunk) {
    const int64_t len = std::min(chunk, n - lo);
    pool.emplace_back([this, lo, len, &a] {
      cpu::AdamW(param_.as<float>() + lo, grad_.as<float>() + lo, m_.as<float>() + lo, v_.as<float>() + lo, len,
                 a);
    });
  }
  for (std::thread& t : pool) t.join();
  // Up: the owned weights, and the dense master into the working weights.
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, params_.owned, param_.as<float>() + S, X * f));
  return Refresh();
}

absl::Status CpuOffloadAdamW::Refresh() {
  const int64_t S = params_.shard_numel;
  float* own_region = params_.dense_working + world_.rank() * S;
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, own_region, param_.as<float>(), S * sizeof(float)));
  PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, own_region, params_.dense_working, S, DataType::kFloat32));
  return stream_.Synchronize();
}

}  // namespace plateau
