#include "kernels/step/schedules.h"

#include "kernels/budget/budget.h"
#include "kernels/checkpoints/full_checkpoints.h"
#include "kernels/checkpoints/sco.h"
#include "kernels/dispatch/llep.h"
#include "kernels/dispatch/pipelined_llep.h"
#include "kernels/dispatch/standard_ep.h"
#include "kernels/optimizer/cpu_offload_adamw.h"
#include "kernels/optimizer/device_adamw.h"
#include "kernels/optimizer/offload_stream_adamw.h"
#include "kernels/projection/dense_projection.h"
#include "kernels/projection/ring_dtp.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::StatusOr<StepSchedules> CreateSchedules(const StepContext& c) {
  const StepOptions& o = c.options;
  PLATEAU_RETURN_IF_ERROR(CheckBf16Schedules(o));
  const bool bf16 = o.precision == Precision::kBf16Mixed;
  const ElementBytes e = ElementBytesOf(o.precision);
  StepSchedules s;
  const int64_t N = TokensPerRank(o.model, o.layout);
  // The attention records (keep_attention) are a second store of the same
  // kind over L - 1 "layers" (L records), fp32; under SCO the host pool's
  // budget is what the boundaries leave of beta (PlanScoPools).
  const int64_t record_width = AttentionRecordWidth(o);
  switch (o.checkpoints.kind) {
    case CheckpointOptions::Kind::kFull: {
      PLATEAU_ASSIGN_OR_RETURN(s.checkpoints,
                               FullCheckpoints::Create(c.backend.device(), o.model.layers, N, o.model.hidden, e));
      if (record_width > 0) {
        PLATEAU_ASSIGN_OR_RETURN(s.attention_records,
                                 FullCheckpoints::Create(c.backend.device(), o.model.layers - 1, N, record_width));
      }
      break;
    }
    case CheckpointOptions::Kind::kSco: {
      PLATEAU_ASSIGN_OR_RETURN(s.checkpoints, Sco::Create(c.backend, c.compute, o.model.layers, N, o.model.hidden,
                                                          o.checkpoints.host_budget_bytes, e));
      if (record_width > 0) {
        const ScoPools pools = CheckpointPools(o);
        PLATEAU_ASSIGN_OR_RETURN(s.attention_records,
                                 Sco::Create(c.backend, c.compute, o.model.layers - 1, N, record_width,
                                             pools.records.host_boundaries * pools.records.boundary_bytes));
      }
      break;
    }
  }
  switch (o.projection.kind) {
    case ProjectionOptions::Kind::kDense: {
      PLATEAU_ASSIGN_OR_RETURN(
          s.projection, DenseProjection::Create(c.backend, c.kernels, c.compute, TokensPerRank(o.model, o.layout),
                                                o.model.hidden, o.model.vocab_size, e));
      break;
    }
    case ProjectionOptions::Kind::kRingDtp: {
      PLATEAU_ASSIGN_OR_RETURN(s.projection, RingDtp::Create(RingDtpConfigOf(o), c.backend, c.kernels, c.world,
                                                             c.compute, c.comm, e));
      break;
    }
  }
  switch (o.dispatch.kind) {
    case DispatchOptions::Kind::kStandardEp:
      s.dispatch = std::make_unique<StandardEp>(o.model, c.backend, c.kernels, c.world, c.compute, c.comm);
      break;
    case DispatchOptions::Kind::kLlep: {
      PLATEAU_ASSIGN_OR_RETURN(s.dispatch, Llep::Create(o.model, o.dispatch.llep, c.backend, c.kernels, c.world,
                                                        c.compute, c.comm, e));
      break;
    }
    case DispatchOptions::Kind::kPipelinedLlep: {
      PLATEAU_ASSIGN_OR_RETURN(s.dispatch, PipelinedLlep::Create(o.model, o.dispatch.pipelined, N, c.backend,
                                                                 c.kernels, c.world, c.compute, c.comm, e));
      break;
    }
  }
  switch (o.optimizer_placement.kind) {
    case OptimizerPlacementOptions::Kind::kDevice: {
      if (bf16) {
        PLATEAU_ASSIGN_OR_RETURN(s.optimizer, DeviceAdamWT<Bf16>::Create(o.optimizer, c.params_bf16, c.backend,
                                                                         c.world, c.comm));
      } else {
        PLATEAU_ASSIGN_OR_RETURN(s.optimizer, DeviceAdamW::Create(o.optimizer, c.params, c.backend, c.world, c.comm));
      }
      break;
    }
    case OptimizerPlacementOptions::Kind::kCpuOffload: {
      if (bf16) {
        PLATEAU_ASSIGN_OR_RETURN(s.optimizer, CpuOffloadAdamWT<Bf16>::Create(o.optimizer, c.params_bf16, c.backend,
                                                                             c.world, c.comm));
      } else {
        PLATEAU_ASSIGN_OR_RETURN(s.optimizer,
                                 CpuOffloadAdamW::Create(o.optimizer, c.params, c.backend, c.world, c.comm));
      }
      break;
    }
    case OptimizerPlacementOptions::Kind::kOffloadStream: {
      if (bf16) {
        PLATEAU_ASSIGN_OR_RETURN(s.optimizer, OffloadStreamAdamWT<Bf16>::Create(o.optimizer, o.optimizer_placement,
                                                                                c.params_bf16, c.backend, c.world,
                                                                                c.comm));
      } else {
        PLATEAU_ASSIGN_OR_RETURN(s.optimizer, OffloadStreamAdamW::Create(o.optimizer, o.optimizer_placement,
                                                                         c.params, c.backend, c.world, c.comm));
      }
      break;
    }
  }
  return s;
}

}  // namespace plateau
