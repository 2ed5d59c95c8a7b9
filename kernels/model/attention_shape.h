// The shape of one attention block call and the scratch it needs: what the
// budget reads to plan the step's attention workspace without linking the
// attention kernels (kernels/model/attention.h).
#ifndef PLATEAU_KERNELS_MODEL_ATTENTION_SHAPE_H_
#define PLATEAU_KERNELS_MODEL_ATTENTION_SHAPE_H_

#include <algorithm>
#include <cstdint>

namespace plateau {

// Attention is tiled (attention.h): a tile of up to kAttentionTileRows
// query rows meets the block's keys kAttentionTileRows at a time, so a score
// tile (64 x 64 floats, 16 KiB) stays in cache and no score row spans the
// sequence. Each participant of the CPU pool gets one slot of tile scratch;
// at most kAttentionMaxSlots take part in one call (the workspace is planned
// from the shape alone, before any pool exists).
inline constexpr int64_t kAttentionTileRows = 64;
inline constexpr int64_t kAttentionMaxSlots = 8;

struct AttentionShape {
  int64_t batch = 1;
  int64_t q_len = 0;   // query rows per sequence in this block
  int64_t kv_len = 0;  // key rows per sequence in the K/V block
  int64_t heads = 1;
  int64_t kv_heads = 1;
  int64_t head_dim = 0;
  int64_t q_pos0 = 0;
  int64_t kv_pos0 = 0;
  float scale = 1.0f;  // 1 / sqrt(head_dim)
};

// Tile sizes of a call: kAttentionTileRows, or the whole block when shorter.
inline int64_t AttentionTileQueries(const AttentionShape& s) {
  return std::min(kAttentionTileRows, s.q_len);
}
inline int64_t AttentionTileKeys(const AttentionShape& s) {
  return std::min(kAttentionTileRows, s.kv_len);
}

// One slot: scores/probabilities and their gradient [tq x tk], and the K
// and V tiles transposed [head_dim x tk]. (A third [tk x tq] tile, for a
// transposed operand, went when the tile GEMMs began to read B in place.)
inline int64_t AttentionSlotFloats(const AttentionShape& s) {
  const int64_t tq = AttentionTileQueries(s), tk = AttentionTileKeys(s);
  return 2 * tq * tk + 2 * s.head_dim * tk;
}

// Slots a call can use: one per task it splits into (forward: sequence x
// K/V head x query tile, the query heads of a group in one task; backward:
// sequence x K/V head), at most kAttentionMaxSlots.
inline int64_t AttentionSlots(const AttentionShape& s) {
  const int64_t tq = AttentionTileQueries(s);
  const int64_t forward = s.batch * s.kv_heads * ((s.q_len + tq - 1) / std::max<int64_t>(tq, 1));
  const int64_t backward = s.batch * s.kv_heads;
  return std::max<int64_t>(1, std::min(kAttentionMaxSlots, std::max(forward, backward)));
}

// Scratch the block functions need, in floats: independent of the sequence
// length beyond one tile (no T x T scores, no score row of kv_len).
inline int64_t AttentionWorkspaceFloats(const AttentionShape& s) {
  return AttentionSlots(s) * AttentionSlotFloats(s);
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_ATTENTION_SHAPE_H_
