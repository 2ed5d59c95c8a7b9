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

// Activation mode: a pass's travelling batch, X (working) with its int32
// targets and fp32 log-sum-exp (one message per hop), or its dX (fp32).
// Weight mode: W (working) or dW (fp32) of the largest shard.
int64_t RingDtpSlotBytes(const RingDtpConfig& c, int64_t ranks, const ElementBytes& e) {
  const int64_t R = RingDtpPassRows(c), H = c.hidden;
  const int64_t rows = c.mode == RingDtpMode::kActivations ? R : MaxVocabShardRows(c.vocab, ranks);
  const int64_t traveller = rows * H * e.working + (c.mode == RingDtpMode::kActivations ? R * (4 + e.accum) : 0);
  return std::max(traveller, rows * H * e.accum);
}

int64_t RingDtpHomeElements(const RingDtpConfig& c, int64_t ranks, const ElementBytes& e) {
  if (e.working == e.accum) return 0;
  return (c.mode == RingDtpMode::kActivations ? MaxVocabShardRows(c.vocab, ranks) : RingDtpPassRows(c)) * c.hidden;
}

// A strip never spans two shards, so it is at most the largest shard wide:
// a strip setting wider than V / P would only allocate columns never used.
int64_t RingDtpStripTileElements(const RingDtpConfig& c, int64_t ranks) {
  return std::min(RingDtpPassRows(c), c.row_tile) * std::min(c.strip, MaxVocabShardRows(c.vocab, ranks));
}

RingDtpMode RingDtpChooseMode(int64_t rows, int64_t vocab, int64_t ranks) {
  return rows <= MaxVocabShardRows(vocab, ranks) ? RingDtpMode::kActivations
                                                   : RingDtpMode::kWeights;
}

// The live set, buffer by buffer (RingDtp::Allocate() allocates exactly these):
//   strip            min(R, row_tile) x         logits of one strip tile, then its delta
//                      min(S, ceil(V/P))        (working)
//   slots            3 x SlotBytes              rotating travellers; in activation mode
//                                               each R x H plus R int32 targets and R
//                                               floats of log-sum-exp (one message), or
//                                               the travelling dX or dW (fp32)
//   state            2 x 3R                     running (m, s, t), double-buffered (fp32)
//   lse_own          N                          this rank's log-sum-exp, forward -> backward
//   home             HomeElements               bf16 only: the home dW or dX (fp32)
// with R the rows of one pass.
int64_t RingDtpBoundBytes(const RingDtpConfig& c, int64_t ranks, const ElementBytes& e) {
  const int64_t N = c.rows, R = RingDtpPassRows(c);
  return RingDtpStripTileElements(c, ranks) * e.working + 3 * RingDtpSlotBytes(c, ranks, e) +
         (6 * R + N + RingDtpHomeElements(c, ranks, e)) * e.accum;
}

int64_t DenseProjectionBoundBytes(int64_t rows, int64_t vocab, const ElementBytes& e) {
  return rows * vocab * e.working + rows * e.accum;
}

}  // namespace plateau
