#include "kernels/projection/projection_plan.h"

#include <algorithm>

namespace plateau {

absl::string_view RingDtpModeName(RingDtpMode mode) {
  return mode == RingDtpMode::kActivations ? "activations" : "weights";
}

// Tokens per ring pass: a chunk of the batch in activation mode, all of it
// in weight mode.
int64_t RingDtpPassRows(const RingDtpConfig& c) {
  if (c.mode == RingDtpMode::kActivations && c.chunk_rows > 0) {
    return std::min(c.chunk_rows, c.rows);
  }
  return c.rows;
}

// X or dX of a pass in activation mode, W or dW of the largest shard in
// weight mode.
int64_t RingDtpSlotFloats(const RingDtpConfig& c, int64_t ranks) {
  return c.mode == RingDtpMode::kActivations ? RingDtpPassRows(c) * c.hidden
                                             : MaxVocabShardRows(c.vocab, ranks) * c.hidden;
}

RingDtpMode RingDtpChooseMode(int64_t rows, int64_t vocab, int64_t ranks) {
  return rows <= MaxVocabShardRows(vocab, ranks) ? RingDtpMode::kActivations
                                                   : RingDtpMode::kWeights;
}

// The live set, buffer by buffer (RingDtp::Allocate() allocates exactly these):
//   strip            min(R, row_tile) x S       logits of one strip tile, then its delta
//   slots            3 x SlotFloats             rotating travellers (2 in forward)
//   state            2 x 3R                     running (m, s, t), double-buffered
//   lse_own          N                          this rank's log-sum-exp, forward -> backward
//   side (act. mode) 2 x R floats + 2 x R int32 the travelling batch's lse and targets
// with R the rows of one pass.
int64_t RingDtpBoundBytes(const RingDtpConfig& c, int64_t ranks, const ElementBytes& e) {
  const int64_t N = c.rows, R = RingDtpPassRows(c);
  const int64_t working = std::min(R, c.row_tile) * std::min(c.strip, c.vocab) + 3 * RingDtpSlotFloats(c, ranks);
  int64_t accum = 6 * R + N;
  int64_t ints = 0;
  if (c.mode == RingDtpMode::kActivations) {
    accum += 2 * R;
    ints += 2 * R;
  }
  return working * e.working + accum * e.accum + ints * static_cast<int64_t>(sizeof(int32_t));
}

int64_t DenseProjectionBoundBytes(int64_t rows, int64_t vocab, const ElementBytes& e) {
  return rows * vocab * e.working + rows * e.accum;
}

}  // namespace plateau
