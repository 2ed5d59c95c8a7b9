// The shape of one attention block call and the scratch it needs: what the
// budget reads to plan the step's attention workspace without linking the
// attention kernels (kernels/model/attention.h).
#ifndef PLATEAU_KERNELS_MODEL_ATTENTION_SHAPE_H_
#define PLATEAU_KERNELS_MODEL_ATTENTION_SHAPE_H_

#include <algorithm>
#include <cstdint>

namespace plateau {

// Query rows per panel: the block functions score a panel against the whole
// K/V block, so the scratch is linear in kv_len.
inline constexpr int64_t kAttentionPanelRows = 128;

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

// Scratch the block functions need, in floats: linear in kv_len (a panel of
// query rows against the block's keys), never kv_len x q_len.
inline int64_t AttentionWorkspaceFloats(const AttentionShape& s) {
  return 2 * std::min(kAttentionPanelRows, s.q_len) * s.kv_len;
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_ATTENTION_SHAPE_H_
