#include "kernels/optimizer/offload_stream_adamw.h"

#include <algorithm>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/optimizer/host_state.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/status_macros.h"

namespace plateau {
template <typename W>
absl::StatusOr<std::unique_ptr<OffloadStreamAdamWT<W>>> OffloadStreamAdamWT<W>::Create(
    const OptimizerConfig& config, const OptimizerPlacementOptions& placement, const OptimizerParamsT<W>& params,
    Backend& backend, Communicator& world, Stream& stream) {
  PLATEAU_RETURN_IF_ERROR(ValidateOffloadStream(placement.bucket_params, placement.staging_slots));
  const int64_t S = params.shard_numel, X = params.owned_numel, f = sizeof(float);
  const int64_t bucket = OffloadStreamBucket(S, X, placement.bucket_params);
  std::unique_ptr<OffloadStreamAdamWT> o(
      new OffloadStreamAdamWT(config, params, bucket, placement.staging_slots, backend, world, stream));
  PLATEAU_ASSIGN_OR_RETURN(o->up_, backend.CreateStream("optimizer-up", StreamUse::kCopy));
  PLATEAU_ASSIGN_OR_RETURN(o->down_, backend.CreateStream("optimizer-down", StreamUse::kCopy));
  for (auto* events : {&o->loaded_, &o->updated_, &o->written_}) {
    for (int64_t s = 0; s < o->slots_count_; ++s) {
      PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, backend.CreateEvent());
      events->push_back(std::move(e));
    }
  }
  // The slots hold fp32 master, m and v in either precision (e.master); the
  // step's element sizes, as the budget plans them.
  const ElementBytes e = std::is_same_v<W, float> ? kFp32Elements : kBf16MixedElements;
  const OptimizerBytes bytes = OffloadStreamAdamWBytes(S, X, placement.bucket_params, placement.staging_slots, e);
  PLATEAU_ASSIGN_OR_RETURN(o->slots_, backend.device().Allocate(LiveSet::kOptimizer, bytes.device));
  const int64_t masters = S + (kSeparateOwnedMaster ? X : 0);
  PLATEAU_ASSIGN_OR_RETURN(o->master_, backend.host().Allocate(LiveSet::kOptimizer, masters * f));
  PLATEAU_ASSIGN_OR_RETURN(o->m_, backend.host().Allocate(LiveSet::kOptimizer, (S + X) * f));
  PLATEAU_ASSIGN_OR_RETURN(o->v_, backend.host().Allocate(LiveSet::kOptimizer, (S + X) * f));
  return o;
}

template <typename W>
OffloadStreamAdamWT<W>::OffloadStreamAdamWT(const OptimizerConfig& config, const OptimizerParamsT<W>& params,
                                            int64_t bucket, int64_t slots, Backend& backend, Communicator& world,
                                            Stream& stream)
    : config_(config),
      params_(params),
      bucket_(bucket),
      slots_count_(slots),
      backend_(backend),
      world_(world),
      stream_(stream) {}

template <typename W>
OffloadStreamAdamWT<W>::~OffloadStreamAdamWT() {
  Settle().IgnoreError();
}

template <typename W>
absl::Status OffloadStreamAdamWT<W>::Settle() {
  if (up_) PLATEAU_RETURN_IF_ERROR(up_->Synchronize());
  if (down_) PLATEAU_RETURN_IF_ERROR(down_->Synchronize());
  return absl::OkStatus();
}

template <typename W>
absl::Status OffloadStreamAdamWT<W>::Load(const OptimizerShardState& st) {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(CheckShardState(st, S, X));
  if (kSeparateOwnedMaster && static_cast<int64_t>(st.owned_master.size()) != X) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer state: the owned weights' master has ",
                                                   st.owned_master.size(), " values, expected ", X,
                                                   " (bf16 mixed precision keeps it apart)"));
  }
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  PLATEAU_RETURN_IF_ERROR(Settle());
  // Host memory of our own: written directly (pinned on CUDA, plain on the CPU).
  std::copy_n(st.dense_master.data(), S, master_.as<float>());
  if (kSeparateOwnedMaster) std::copy_n(st.owned_master.data(), X, master_.as<float>() + S);
  PutOrZero(st.dense_m, S, m_.as<float>());
  PutOrZero(st.owned_m, X, m_.as<float>() + S);
  PutOrZero(st.dense_v, S, v_.as<float>());
  PutOrZero(st.owned_v, X, v_.as<float>() + S);
  return Refresh();
}

template <typename W>
absl::StatusOr<OptimizerShardState> OffloadStreamAdamWT<W>::Save() {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  PLATEAU_RETURN_IF_ERROR(Settle());
  OptimizerShardState st;
  st.dense_master.assign(master_.as<float>(), master_.as<float>() + S);
  if (kSeparateOwnedMaster) st.owned_master.assign(master_.as<float>() + S, master_.as<float>() + S + X);
  st.dense_m.assign(m_.as<float>(), m_.as<float>() + S);
  st.owned_m.assign(m_.as<float>() + S, m_.as<float>() + S + X);
  st.dense_v.assign(v_.as<float>(), v_.as<float>() + S);
  st.owned_v.assign(v_.as<float>() + S, v_.as<float>() + S + X);
  return st;
}

template <typename W>
absl::Status OffloadStreamAdamWT<W>::Update(float clip, int64_t step) {
  const OptimizerConfig& o = config_;
  const AdamWArgs a{LearningRateF(o, step), o.beta1, o.beta2, o.eps, o.weight_decay, step, clip};
  const int64_t S = params_.shard_numel, f = sizeof(float);
  W* own_region = params_.dense_working + world_.rank() * S;
  const OffloadStreamBuckets buckets(S, params_.owned_numel, bucket_);
  for (int64_t i = 0; i < buckets.size(); ++i) {
    const OptimizerBucket b = buckets[i];
    const int64_t s = i % slots_count_, n = b.numel;
    const int64_t moment = (b.owned ? S : 0) + b.offset;  // into m and v (and the bf16 masters)
    // fp32: only the dense shard has a host master (the owned weights are
    // their own, on the device); bf16: both do.
    const bool master_on_host = !b.owned || kSeparateOwnedMaster;
    float* slot_master = SlotPart(s, 0);
    float* slot_m = SlotPart(s, 1);
    float* slot_v = SlotPart(s, 2);
    // Up: once the slot's last bucket is written back.
    PLATEAU_RETURN_IF_ERROR(up_->Wait(*written_[s]));
    if (master_on_host) {
      PLATEAU_RETURN_IF_ERROR(backend_.Copy(*up_, slot_master, master_.as<float>() + moment, n * f));
    }
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*up_, slot_m, m_.as<float>() + moment, n * f));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*up_, slot_v, v_.as<float>() + moment, n * f));
    PLATEAU_RETURN_IF_ERROR(up_->Record(*loaded_[s]));
    // Update, and the working copy: this rank's region of the dense
    // weights, or the owned weights.
    PLATEAU_RETURN_IF_ERROR(stream_.Wait(*loaded_[s]));
    const W* grad = (b.owned ? params_.owned_grad : params_.dense_grad_shard) + b.offset;
    W* working = (b.owned ? params_.owned : own_region) + b.offset;
    if constexpr (kSeparateOwnedMaster) {
      PLATEAU_RETURN_IF_ERROR(backend_.AdamWBf16(stream_, slot_master, grad, slot_m, slot_v, working, n, a));
    } else {
      float* param = b.owned ? working : slot_master;
      PLATEAU_RETURN_IF_ERROR(backend_.AdamW(stream_, param, grad, slot_m, slot_v, n, a));
      if (!b.owned) PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, working, slot_master, n * f));
    }
    PLATEAU_RETURN_IF_ERROR(stream_.Record(*updated_[s]));
    // Down: the new state back to the host.
    PLATEAU_RETURN_IF_ERROR(down_->Wait(*updated_[s]));
    if (master_on_host) {
      PLATEAU_RETURN_IF_ERROR(backend_.Copy(*down_, master_.as<float>() + moment, slot_master, n * f));
    }
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*down_, m_.as<float>() + moment, slot_m, n * f));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*down_, v_.as<float>() + moment, slot_v, n * f));
    PLATEAU_RETURN_IF_ERROR(down_->Record(*written_[s]));
    EndPhase(phases_, StepPhase::kOptimizerBucket, static_cast<int64_t>(i));
  }
  // Every rank's region of the working weights from every rank.
  PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, own_region, params_.dense_working, S, kWorkingDataType<W>));
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  return Settle();
}

template <typename W>
absl::Status OffloadStreamAdamWT<W>::Refresh() {
  const int64_t S = params_.shard_numel;
  W* own_region = params_.dense_working + world_.rank() * S;
  if constexpr (kSeparateOwnedMaster) {
    // The working copies rn(master), bucket by bucket through slot 0 (a
    // device kernel reads device memory): the dense shard's into this
    // rank's region, the owned weights'.
    const OffloadStreamBuckets buckets(S, params_.owned_numel, bucket_);
    float* slot = SlotPart(0, 0);
    for (int64_t i = 0; i < buckets.size(); ++i) {
      const OptimizerBucket b = buckets[i];
      const int64_t at = (b.owned ? S : 0) + b.offset;
      PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, slot, master_.as<float>() + at, b.numel * sizeof(float)));
      W* working = (b.owned ? params_.owned : own_region) + b.offset;
      PLATEAU_RETURN_IF_ERROR(backend_.ConvertToBf16(stream_, working, slot, b.numel));
    }
  } else {
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, own_region, master_.as<float>(), S * sizeof(float)));
  }
  PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, own_region, params_.dense_working, S, kWorkingDataType<W>));
  return stream_.Synchronize();
}

template class OffloadStreamAdamWT<float>;
template class OffloadStreamAdamWT<Bf16>;

}  // namespace plateau
