#include "kernels/model/layers.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu_exp.h"
#include "kernels/model/config.h"

namespace plateau {

using cpu::ExpShiftScale;
using cpu::ExpShiftSumOnly;
using cpu::RowMax;

void EmbeddingForward(const float* table, const int32_t* tokens, int64_t rows,
                      int64_t hidden, float* out, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(hidden), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::copy_n(table + static_cast<int64_t>(tokens[r]) * hidden, hidden, out + r * hidden);
    }
  });
}

void EmbeddingBackward(const float* dout, const int32_t* tokens, int64_t rows,
                       int64_t hidden, float* dtable, CpuPool* pool) {
  // A token may repeat, so rows cannot be split; columns can: each task adds
  // every row, in row order, into its own columns (the bits of a serial loop).
  ParallelBlocks(pool, hidden, 128, [=](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; ++r) {
      float* row = dtable + static_cast<int64_t>(tokens[r]) * hidden;
      const float* d = dout + r * hidden;
      for (int64_t c = c0; c < c1; ++c) row[c] += d[c];
    }
  });
}

namespace {
// Per-task scratch of `experts` entries without a heap allocation for the
// usual expert counts.
template <typename T>
struct SmallBuf {
  explicit SmallBuf(int64_t n) {
    if (n > kInline) heap.resize(n);
  }
  T* data() { return heap.empty() ? inline_buf : heap.data(); }
  static constexpr int64_t kInline = 256;
  T inline_buf[kInline];
  std::vector<T> heap;
};
}  // namespace

void RouterForward(const float* logits, int64_t rows, int64_t experts,
                   int64_t top_k, float* probs, int32_t* chosen, float* gates, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(experts * 8), [=](int64_t r0, int64_t r1) {
    SmallBuf<int32_t> buf(experts);
    int32_t* order = buf.data();
    for (int64_t r = r0; r < r1; ++r) {
      const float* lg = logits + r * experts;
      float* p = probs + r * experts;
      const float mx = *std::max_element(lg, lg + experts);
      float sum = 0.0f;
      for (int64_t e = 0; e < experts; ++e) sum += (p[e] = std::exp(lg[e] - mx));
      const float inv = 1.0f / sum;
      for (int64_t e = 0; e < experts; ++e) p[e] *= inv;
      std::iota(order, order + experts, 0);
      // Stable: equal probabilities keep the lower expert index first.
      std::partial_sort(order, order + top_k, order + experts, [p](int32_t a, int32_t b) {
        return p[a] > p[b] || (p[a] == p[b] && a < b);
      });
      float total = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) total += p[order[j]];
      for (int64_t j = 0; j < top_k; ++j) {
        chosen[r * top_k + j] = order[j];
        gates[r * top_k + j] = p[order[j]] / total;
      }
    }
  });
}

void RouterBackward(const float* probs, const int32_t* chosen,
                    const float* gates, const float* dgates, int64_t rows,
                    int64_t experts, int64_t top_k, float* dlogits, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(experts * 8), [=](int64_t r0, int64_t r1) {
    SmallBuf<float> buf(experts);
    float* dp = buf.data();
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = probs + r * experts;
      const int32_t* ch = chosen + r * top_k;
      const float* g = gates + r * top_k;
      const float* dg = dgates + r * top_k;
      // g_j = p_j / S with S = sum of the chosen p: dp_j = (dg_j - <dg, g>) / S.
      float total = 0.0f, gdot = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        total += p[ch[j]];
        gdot += dg[j] * g[j];
      }
      std::fill(dp, dp + experts, 0.0f);
      for (int64_t j = 0; j < top_k; ++j) dp[ch[j]] = (dg[j] - gdot) / total;
      // Softmax: dlogit_e = p_e (dp_e - <dp, p>).
      float pdot = 0.0f;
      for (int64_t e = 0; e < experts; ++e) pdot += dp[e] * p[e];
      float* dl = dlogits + r * experts;
      for (int64_t e = 0; e < experts; ++e) dl[e] = p[e] * (dp[e] - pdot);
    }
  });
}

double CrossEntropyForward(const float* logits, const int32_t* targets,
                           int64_t rows, int64_t vocab, float* lse,
                           int64_t* valid, CpuPool* pool) {
  // Rows in parallel (each writes its lse); the loss is then summed in row
  // order on this thread, so the total does not depend on the split.
  ParallelBlocks(pool, rows, RowsPerTask(vocab), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (targets[r] == kIgnoreIndex) {
        lse[r] = 0.0f;
        continue;
      }
      const float* lg = logits + r * vocab;
      const float mx = RowMax(lg, vocab);
      lse[r] = mx + std::log(ExpShiftSumOnly(lg, mx, vocab));
    }
  });
  double total = 0.0;
  int64_t count = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == kIgnoreIndex) continue;
    total += static_cast<double>(lse[r] - logits[r * vocab + targets[r]]);
    ++count;
  }
  *valid = count;
  return total;
}

void CrossEntropyBackward(float* logits_to_grad, const float* lse,
                          const int32_t* targets, int64_t rows, int64_t vocab,
                          float scale, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(vocab), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = logits_to_grad + r * vocab;
      if (targets[r] == kIgnoreIndex) {
        std::fill(row, row + vocab, 0.0f);
        continue;
      }
      ExpShiftScale(row, lse[r], scale, row, vocab);
      row[targets[r]] -= scale;
    }
  });
}

void GatherRows(const float* src, const int32_t* index, const float* scales,
                int64_t rows, int64_t width, float* dst, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(width), [=](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* s = src + static_cast<int64_t>(index[i]) * width;
      float* d = dst + i * width;
      if (scales == nullptr) {
        std::copy_n(s, width, d);
      } else {
        const float a = scales[i];
        for (int64_t c = 0; c < width; ++c) d[c] = a * s[c];
      }
    }
  });
}

void ScatterRows(const float* src, int64_t rows, const int32_t* index,
                 int64_t width, float* dst, CpuPool* pool) {
  // The indices are distinct, so tasks write disjoint rows.
  ParallelBlocks(pool, rows, RowsPerTask(width), [=](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      std::copy_n(src + i * width, width, dst + static_cast<int64_t>(index[i]) * width);
    }
  });
}

void CombineRows(const float* src, const int32_t* pos, const float* weights,
                 int64_t tokens, int64_t k, int64_t width, float* out, CpuPool* pool) {
  ParallelBlocks(pool, tokens, RowsPerTask(width * k), [=](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * width;
      for (int64_t j = 0; j < k; ++j) {
        const float* s = src + static_cast<int64_t>(pos[t * k + j]) * width;
        const float w = weights == nullptr ? 1.0f : weights[t * k + j];
        for (int64_t c = 0; c < width; ++c) o[c] += w * s[c];
      }
    }
  });
}

void RowDots(const float* a, const float* b, const int32_t* pos, int64_t tokens,
             int64_t k, int64_t width, float* out, CpuPool* pool) {
  ParallelBlocks(pool, tokens, RowsPerTask(width * k), [=](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = a + t * width;
      for (int64_t j = 0; j < k; ++j) {
        const float* y = b + static_cast<int64_t>(pos[t * k + j]) * width;
        double acc = 0.0;
        for (int64_t c = 0; c < width; ++c) acc += static_cast<double>(x[c]) * y[c];
        out[t * k + j] = static_cast<float>(acc);
      }
    }
  });
}

void StripFold(const float* logits, int64_t rows, int64_t width, int64_t col0,
               const int32_t* targets, float* m, float* s, float* t, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(width), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t target = targets[r];
      if (target == kIgnoreIndex) continue;
      const float* x = logits + r * width;
      const float mnew = std::max(m[r], RowMax(x, width));
      const float sum = ExpShiftSumOnly(x, mnew, width);
      s[r] = s[r] * std::exp(m[r] - mnew) + sum;  // exp(-inf) = 0 on the first strip
      m[r] = mnew;
      if (target >= col0 && target < col0 + width) t[r] = x[target - col0];
    }
  });
}

double StripFinish(const float* m, const float* s, const float* t,
                   const int32_t* targets, int64_t rows, float* lse,
                   int64_t* valid) {
  double total = 0.0;
  int64_t count = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] == kIgnoreIndex) {
      lse[r] = 0.0f;
      continue;
    }
    lse[r] = m[r] + std::log(s[r]);
    total += static_cast<double>(lse[r] - t[r]);
    ++count;
  }
  *valid = count;
  return total;
}

void StripDelta(float* logits_to_delta, int64_t rows, int64_t width,
                int64_t col0, const int32_t* targets, const float* lse,
                float scale, CpuPool* pool) {
  ParallelBlocks(pool, rows, RowsPerTask(width), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = logits_to_delta + r * width;
      const int64_t target = targets[r];
      if (target == kIgnoreIndex) {
        std::fill(x, x + width, 0.0f);
        continue;
      }
      ExpShiftScale(x, lse[r], scale, x, width);
      if (target >= col0 && target < col0 + width) x[target - col0] -= scale;
    }
  });
}

}  // namespace plateau
