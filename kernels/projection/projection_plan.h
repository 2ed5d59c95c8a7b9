// What the projection schedules need to be planned without a backend or a
// communicator: Ring-DTP's configuration, its circulation-mode choice and its
// bound, and the dense baseline's bound. The coordinator's budget links only
// this; ring_dtp.h and dense_projection.h build on it.
#ifndef PLATEAU_KERNELS_PROJECTION_PROJECTION_PLAN_H_
#define PLATEAU_KERNELS_PROJECTION_PROJECTION_PLAN_H_

#include <cstdint>

#include "absl/strings/string_view.h"
#include "kernels/model/precision.h"
#include "kernels/model/params.h"  // VocabShardBegin, MaxVocabShardRows
#include "kernels/model/step_options.h"

namespace plateau {

absl::string_view RingDtpModeName(RingDtpMode mode);  // "activations"/"weights"


struct RingDtpConfig {
  int64_t rows = 0;    // N, tokens per rank
  int64_t hidden = 0;  // H
  int64_t vocab = 0;   // V, the whole vocabulary
  int64_t strip = 0;   // S, vocabulary columns per strip
  RingDtpMode mode = RingDtpMode::kActivations;
  // Token rows per strip tile: the strip buffer is min(N, row_tile) x
  // min(S, ceil(V / P)) (RingDtpStripTileElements), so
  // it does not grow with N. Large enough to keep the strip GEMMs efficient.
  int64_t row_tile = 2048;
  // Activation mode only: the batch circulates in passes of at most
  // chunk_rows tokens (0: one pass of all N). Each pass is a full ring, so
  // every token still meets every shard once; the travellers shrink to
  // chunk_rows x H at the price of more, smaller hops.
  int64_t chunk_rows = 0;
};

// The smaller traveller: activations (about 2 N H in flight) when N is at
// most a shard's V / P rows, weights otherwise.
RingDtpMode RingDtpChooseMode(int64_t rows, int64_t vocab, int64_t ranks);

// Bytes of Ring-DTP's kProjection live set on P ranks: the strip tile, the
// three rotating traveller buffers, the per-token state and log-sum-exp,
// and under bf16 the home accumulator (ring_dtp.cc allocates exactly
// these). Independent of V in activation mode (but for the bf16 home dW,
// ceil(V / P) x H fp32); in weight mode it grows with N only through the
// per-token state (and under bf16 the home dX, N x H fp32).
// The strip tile and the read-only travellers (X or W) are in the working
// precision; the per-token state, log-sum-exp and every gradient
// accumulator (the travelling dX or dW, the home dW or dX) in fp32
// (e.accum): a slot is the larger of a traveller and an accumulator.
int64_t RingDtpBoundBytes(const RingDtpConfig& c, int64_t ranks, const ElementBytes& e = kFp32Elements);

// The pieces of that bound, shared with the allocation (with
// MaxVocabShardRows, kernels/model/params.h): the tokens of one ring pass,
// the bytes of one traveller slot, the elements of the strip tile, and the
// fp32 elements of the home accumulator (0 in fp32, where dx and dw_shard
// themselves accumulate): under bf16 the shard's dW [ceil(V / P), H] in
// activation mode (summed over every meeting and pass), the batch's dX
// [N, H] in weight mode (summed over every meeting).
int64_t RingDtpPassRows(const RingDtpConfig& c);
int64_t RingDtpSlotBytes(const RingDtpConfig& c, int64_t ranks, const ElementBytes& e);
int64_t RingDtpStripTileElements(const RingDtpConfig& c, int64_t ranks);
int64_t RingDtpHomeElements(const RingDtpConfig& c, int64_t ranks, const ElementBytes& e);

// Bytes of the dense projection's kProjection live set for `rows` tokens:
// the N x V logits (working precision) and the log-sum-exp (fp32).
int64_t DenseProjectionBoundBytes(int64_t rows, int64_t vocab, const ElementBytes& e = kFp32Elements);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_PROJECTION_PROJECTION_PLAN_H_
