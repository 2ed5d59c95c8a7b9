// Ring-DTP: exact vocabulary projection and cross-entropy over distinct
// per-rank batches (DESIGN.md §1.2), the schedule that replaces the dense
// projection's N x V logits.
//
// Rank p keeps its batch X_p [N, H] (targets y_p) and owns vocabulary shard
// W_p (rows [VocabShardBegin(p), VocabShardBegin(p+1)) of the [V, H]
// projection; shards may be uneven). Over P ring steps every (batch, shard)
// pair meets once; a meeting computes logits in strips of S vocabulary
// columns, folds each strip into a running per-token state (max m, sum s,
// target logit t: online log-sum-exp in fp32, strips in a fixed order) and
// releases it. Two circulation modes:
// - kActivations: X_q travels with its running state (forward) and with its
//   log-sum-exp and dX accumulator (backward); dW stays home. X_q, its
//   targets and (backward) its log-sum-exp hop as one message: 2P - 1
//   send/recvs per pass each way, not 3P - 2 (forward) and 4P - 3.
// - kWeights: W_s travels (forward); in backward its dW accumulator travels
//   with it; X and dX stay home.
// The loss of a token is final only once every shard has met it, so backward
// recomputes every strip: delta = scale (softmax - onehot), dX += delta W,
// dW += delta^T X. Neither the N x V logits nor their gradient ever exist.
//
// Communication overlaps compute: the read-only traveller (X or W) of the
// next step is in flight on the communication stream while the current
// strips run; what compute writes (the forward state, the backward
// accumulator) hops after the step. The accumulators rotate through three
// buffers so the peak stays at the bound returned by BoundBytes().
//
// Every buffer is allocated by Create() in the kProjection live set.
// Thread safety: one per rank; Forward/Backward are collective over the
// vocabulary group.
#ifndef PLATEAU_KERNELS_PROJECTION_RING_DTP_H_
#define PLATEAU_KERNELS_PROJECTION_RING_DTP_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/memory.h"
#include "kernels/model/model_kernels.h"
#include "kernels/projection/projection_plan.h"
#include "kernels/projection/vocab_projection.h"

namespace plateau {

class RingDtp final : public VocabProjection {
 public:
  // kernels/projection/projection_plan.h, here for the schedule's users.
  static RingDtpMode ChooseMode(int64_t rows, int64_t vocab, int64_t ranks) {
    return RingDtpChooseMode(rows, vocab, ranks);
  }
  static int64_t BoundBytes(const RingDtpConfig& c, int64_t ranks) {
    return RingDtpBoundBytes(c, ranks);
  }

  // Validates the configuration (errors name the field: ring_dtp.strip, ...).
  // The strip tile and the read-only travellers hold e.working bytes per
  // element (bf16 mixed: bf16 logits and X / W); the strip state, lse and
  // every gradient accumulator (travelling dX / dW, the home dW or dX) fp32,
  // the loss sums double: RingDtpBoundBytes(config, P, e).
  static absl::StatusOr<std::unique_ptr<RingDtp>> Create(
      const RingDtpConfig& config, Backend& backend, ModelKernels& kernels,
      Communicator& vocab_group, Stream& compute, Stream& comm,
      const ElementBytes& e = kFp32Elements);
  ~RingDtp() override;

  // This rank's vocabulary shard: rows [VocabShardBegin(V, P, rank), ...).
  int64_t FirstWeightRow() const override;

  // x [N, H], w_shard [V_p, H] (this rank's shard), targets [N]:
  // stats[0] += the sum of this rank's valid token losses, stats[1] += their
  // count. Keeps this rank's log-sum-exp for Backward.
  absl::Status Forward(const float* x, const float* w_shard,
                       const int32_t* targets, double* stats) override;
  // With scale = 1 / (valid tokens of the global batch): dx = d loss / d x
  // (overwritten), dw_shard += d loss / d w_shard.
  absl::Status Backward(const float* x, const float* w_shard,
                        const int32_t* targets, float scale, float* dx,
                        float* dw_shard) override;
  // The same in bf16 mixed precision (Create with kBf16MixedElements): one
  // rounding per stored logit and delta; dX and dW summed in fp32 (over
  // strip tiles, meetings, hops and passes) and rounded once each, when
  // final (dw_shard: its value loaded exactly, the sum added, one rounding);
  // the hops move bf16 travellers and fp32 accumulators exactly.
  absl::Status Forward(const Bf16* x, const Bf16* w_shard, const int32_t* targets,
                       double* stats) override;
  absl::Status Backward(const Bf16* x, const Bf16* w_shard, const int32_t* targets,
                        float scale, Bf16* dx, Bf16* dw_shard) override;

  const RingDtpConfig& config() const { return config_; }

 private:
  struct Buffers;
  RingDtp(const RingDtpConfig& config, Backend& backend, ModelKernels& kernels,
          Communicator& group, Stream& compute, Stream& comm);
  absl::Status Allocate();
  // Rows per pass: chunk_rows in activation mode, else N.
  int64_t PassRows() const;
  // One body per call for both precisions (W: float or Bf16).
  template <typename W>
  absl::Status ForwardT(const W* x, const W* w_shard, const int32_t* targets, double* stats);
  template <typename W>
  absl::Status BackwardT(const W* x, const W* w_shard, const int32_t* targets, float scale, W* dx,
                         W* dw_shard);
  // INTERNAL unless the buffers were allocated for `bytes`-byte elements.
  absl::Status CheckElement(size_t bytes) const;
  // One pass of `rows` tokens (a chunk of the batch, or all of it).
  template <typename W>
  absl::Status ForwardPass(const W* x, const W* w_shard,
                           const int32_t* targets, int64_t rows, float* lse,
                           double* stats);
  // `dw_home` accumulates the shard's dW in activation mode (fp32: dw_shard
  // itself; bf16: the home buffer, rounded into dw_shard after the last pass).
  template <typename W>
  absl::Status BackwardPass(const W* x, const W* w_shard, const int32_t* targets, const float* lse, int64_t rows,
                            float scale, W* dx, W* dw_shard, float* dw_home);
  // The strips of one meeting of `rows` tokens with shard rows [0, width) of
  // w (vocabulary ids from col0); `state` has stride `rows`.
  template <typename W>
  absl::Status FoldMeeting(const W* x, int64_t rows, const W* w,
                           int64_t width, int64_t col0, const int32_t* targets,
                           float* state);
  template <typename W>
  absl::Status DeltaMeeting(const W* x, int64_t rows, const W* w, int64_t width, int64_t col0, const int32_t* targets,
                            const float* lse, float scale, float* dx, float* dw);
  // Activation mode's packed traveller of `rows` tokens in a slot: X (W),
  // then the targets, then the log-sum-exp (ring_dtp.cc says why one
  // message).
  template <typename W>
  int32_t* PackedTargets(W* slot, int64_t rows) const;
  template <typename W>
  float* PackedLse(W* slot, int64_t rows) const;
  template <typename W>
  absl::Status PackOwnBatch(const W* x, const int32_t* targets,
                            const float* lse, int64_t rows, W* slot);
  // The packed message of `rows` tokens (with or without its lse) in units
  // of its wire type (PackedWire).
  template <typename W>
  int64_t PackedCount(int64_t rows, bool with_lse) const;
  absl::Status CommAfterCompute();
  absl::Status ComputeAfterComm();
  int64_t ShardRows(int64_t shard) const;

  const RingDtpConfig config_;
  Backend& backend_;
  ModelKernels& kernels_;
  Communicator& group_;
  Stream& compute_;
  Stream& comm_;
  std::unique_ptr<Buffers> buf_;
  int64_t working_bytes_ = sizeof(float);  // of the strip tile and the travellers
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_PROJECTION_RING_DTP_H_
