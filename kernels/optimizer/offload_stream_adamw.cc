#include "kernels/optimizer/offload_stream_adamw.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/optimizer/host_state.h"
#include "kernels/optimizer/lr_schedule.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<std::unique_ptr<OffloadStreamAdamW>> OffloadStreamAdamW::Create(
    const OptimizerConfig& config, const OptimizerPlacementOptions& placement, const OptimizerParams& params,
    Backend& backend, Communicator& world, Stream& stream) {
  PLATEAU_RETURN_IF_ERROR(ValidateOffloadStream(placement.bucket_params, placement.staging_slots));
  const int64_t S = params.shard_numel, X = params.owned_numel, f = sizeof(float);
  const int64_t bucket = OffloadStreamBucket(S, X, placement.bucket_params);
  std::unique_ptr<OffloadStreamAdamW> o(
      new OffloadStreamAdamW(config, params, bucket, placement.staging_slots, backend, world, stream));
  PLATEAU_ASSIGN_OR_RETURN(o->up_, backend.CreateStream("optimizer-up"));
  PLATEAU_ASSIGN_OR_RETURN(o->down_, backend.CreateStream("optimizer-down"));
  for (auto* events : {&o->loaded_, &o->updated_, &o->written_}) {
    for (int64_t s = 0; s < o->slots_count_; ++s) {
      PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, backend.CreateEvent());
      events->push_back(std::move(e));
    }
  }
  const OptimizerBytes bytes = OffloadStreamAdamWBytes(S, X, placement.bucket_params, placement.staging_slots);
  PLATEAU_ASSIGN_OR_RETURN(o->slots_, backend.device().Allocate(LiveSet::kOptimizer, bytes.device));
  PLATEAU_ASSIGN_OR_RETURN(o->master_, backend.host().Allocate(LiveSet::kOptimizer, S * f));
  PLATEAU_ASSIGN_OR_RETURN(o->m_, backend.host().Allocate(LiveSet::kOptimizer, (S + X) * f));
  PLATEAU_ASSIGN_OR_RETURN(o->v_, backend.host().Allocate(LiveSet::kOptimizer, (S + X) * f));
  return o;
}

OffloadStreamAdamW::OffloadStreamAdamW(const OptimizerConfig& config, const OptimizerParams& params,
                                       int64_t bucket, int64_t slots, Backend& backend, Communicator& world,
                                       Stream& stream)
    : config_(config),
      params_(params),
      bucket_(bucket),
      slots_count_(slots),
      backend_(backend),
      world_(world),
      stream_(stream) {}

OffloadStreamAdamW::~OffloadStreamAdamW() { Settle().IgnoreError(); }

absl::Status OffloadStreamAdamW::Settle() {
  if (up_) PLATEAU_RETURN_IF_ERROR(up_->Synchronize());
  if (down_) PLATEAU_RETURN_IF_ERROR(down_->Synchronize());
  return absl::OkStatus();
}

absl::Status OffloadStreamAdamW::Load(const OptimizerShardState& st) {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(CheckShardState(st, S, X));
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  PLATEAU_RETURN_IF_ERROR(Settle());
  // Host memory of our own: written directly (pinned on CUDA, plain on the CPU).
  std::copy_n(st.dense_master.data(), S, master_.as<float>());
  PutOrZero(st.dense_m, S, m_.as<float>());
  PutOrZero(st.owned_m, X, m_.as<float>() + S);
  PutOrZero(st.dense_v, S, v_.as<float>());
  PutOrZero(st.owned_v, X, v_.as<float>() + S);
  return Refresh();
}

absl::StatusOr<OptimizerShardState> OffloadStreamAdamW::Save() {
  const int64_t S = params_.shard_numel, X = params_.owned_numel;
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  PLATEAU_RETURN_IF_ERROR(Settle());
  OptimizerShardState st;
  st.dense_master.assign(master_.as<float>(), master_.as<float>() + S);
  st.dense_m.assign(m_.as<float>(), m_.as<float>() + S);
  st.owned_m.assign(m_.as<float>() + S, m_.as<float>() + S + X);
  st.dense_v.assign(v_.as<float>(), v_.as<float>() + S);
  st.owned_v.assign(v_.as<float>() + S, v_.as<float>() + S + X);
  return st;
}

absl::Status OffloadStreamAdamW::Update(float clip, int64_t step) {
  const OptimizerConfig& o = config_;
  const AdamWArgs a{LearningRateF(o, step), o.beta1, o.beta2, o.eps, o.weight_decay, step, clip};
  const int64_t S = params_.shard_numel, f = sizeof(float);
  float* own_region = params_.dense_working + world_.rank() * S;
  const std::vector<OptimizerBucket> buckets = OffloadStreamBuckets(S, params_.owned_numel, bucket_);
  for (size_t i = 0; i < buckets.size(); ++i) {
    const OptimizerBucket& b = buckets[i];
    const int64_t s = static_cast<int64_t>(i) % slots_count_, n = b.numel;
    const int64_t moment = (b.owned ? S : 0) + b.offset;  // into m and v
    float* slot_master = SlotPart(s, 0);
    float* slot_m = SlotPart(s, 1);
    float* slot_v = SlotPart(s, 2);
    // Up: once the slot's last bucket is written back.
    PLATEAU_RETURN_IF_ERROR(up_->Wait(*written_[s]));
    if (!b.owned) {
      PLATEAU_RETURN_IF_ERROR(backend_.Copy(*up_, slot_master, master_.as<float>() + b.offset, n * f));
    }
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*up_, slot_m, m_.as<float>() + moment, n * f));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*up_, slot_v, v_.as<float>() + moment, n * f));
    PLATEAU_RETURN_IF_ERROR(up_->Record(*loaded_[s]));
    // Update, and the dense master into this rank's working region.
    PLATEAU_RETURN_IF_ERROR(stream_.Wait(*loaded_[s]));
    float* param = b.owned ? params_.owned + b.offset : slot_master;
    const float* grad = (b.owned ? params_.owned_grad : params_.dense_grad_shard) + b.offset;
    PLATEAU_RETURN_IF_ERROR(backend_.AdamW(stream_, param, grad, slot_m, slot_v, n, a));
    if (!b.owned) PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, own_region + b.offset, slot_master, n * f));
    PLATEAU_RETURN_IF_ERROR(stream_.Record(*updated_[s]));
    // Down: the new state back to the host.
    PLATEAU_RETURN_IF_ERROR(down_->Wait(*updated_[s]));
    if (!b.owned) {
      PLATEAU_RETURN_IF_ERROR(backend_.Copy(*down_, master_.as<float>() + b.offset, slot_master, n * f));
    }
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*down_, m_.as<float>() + moment, slot_m, n * f));
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(*down_, v_.as<float>() + moment, slot_v, n * f));
    PLATEAU_RETURN_IF_ERROR(down_->Record(*written_[s]));
    EndPhase(phases_, StepPhase::kOptimizerBucket, static_cast<int64_t>(i));
  }
  // Every rank's region of the working weights from every rank.
  PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, own_region, params_.dense_working, S, DataType::kFloat32));
  PLATEAU_RETURN_IF_ERROR(stream_.Synchronize());
  return Settle();
}

absl::Status OffloadStreamAdamW::Refresh() {
  const int64_t S = params_.shard_numel;
  float* own_region = params_.dense_working + world_.rank() * S;
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(stream_, own_region, master_.as<float>(), S * sizeof(float)));
  PLATEAU_RETURN_IF_ERROR(world_.AllGather(stream_, own_region, params_.dense_working, S, DataType::kFloat32));
  return stream_.Synchronize();
}

}  // namespace plateau
