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

// Activation mode: a pass's travelling batch, X with its targets and
// log-sum-exp (one message per hop), or its dX. Weight mode: W or dW of the
// largest shard.
int64_t RingDtpSlotFloats(const RingDtpConfig& c, int64_t ranks) {
  const int64_t R = RingDtpPassRows(c);
  return c.mode == RingDtpMode::kActivations ? R * c.hidden + 2 * R
                                             : MaxVocabShardRows(c.vocab, ranks) * c.hidden;
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
//                      min(S, ceil(V/P))
//   slots            3 x SlotFloats             rotating travellers; in activation mode
//                                               each R x H plus R int32 targets and R
//                                               floats of log-sum-exp (one message)
//   state            2 x 3R                     running (m, s, t), double-buffered
//   lse_own          N                          this rank's log-sum-exp, forward -> backward
// with R the rows of one pass.
int64_t RingDtpBoundBytes(const RingDtpConfig& c, int64_t ranks, const ElementBytes& e) {
  const int64_t N = c.rows, R = RingDtpPassRows(c);
  const bool act = c.mode == RingDtpMode::kActivations;
  // The travellers' X or W in the working precision; a slot's targets and
  // log-sum-exp are int32 and fp32 whatever it is.
  const int64_t slot_working = act ? R * c.hidden : RingDtpSlotFloats(c, ranks);
  const int64_t working = RingDtpStripTileElements(c, ranks) + 3 * slot_working;
  int64_t accum = 6 * R + N;
  int64_t ints = 0;
  if (act) {
    accum += 3 * R;
    ints += 3 * R;
  }
  return working * e.working + accum * e.accum + ints * static_cast<int64_t>(sizeof(int32_t));
}

int64_t DenseProjectionBoundBytes(int64_t rows, int64_t vocab, const ElementBytes& e) {
  return rows * vocab * e.working + rows * e.accum;
}

}  // namespace plateau
