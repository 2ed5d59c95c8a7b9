// Rank p's part of a global batch under the step's layout (docs/MODEL.md,
// parallel layout): each of the B sequences of T tokens is cut into P
// contiguous slices, and rank p holds slice p of every sequence, [B, T/P].
#ifndef PLATEAU_KERNELS_TESTING_RANK_SLICE_H_
#define PLATEAU_KERNELS_TESTING_RANK_SLICE_H_

#include <cstdint>
#include <vector>

namespace plateau {

inline std::vector<int32_t> RankSlice(const std::vector<int32_t>& global, int64_t batch, int64_t seq_len,
                                      int64_t rank, int64_t ranks) {
  const int64_t n = seq_len / ranks;
  std::vector<int32_t> out;
  out.reserve(batch * n);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < n; ++t) out.push_back(global[b * seq_len + rank * n + t]);
  }
  return out;
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_RANK_SLICE_H_
