// A naive, single-process implementation of the whole model of
// docs/MODEL.md — forward, loss and every gradient — written as plain loops
// for readability, templated on the scalar type.
//
// It is the reference the real step is tested against: instantiated in double
// it is checked against central finite differences, and the fp32 step
// (tiled/ring attention, expert parallelism, ZeRO sharding) must reproduce
// its loss and gradients. Attention materialises the T x T scores and the
// projection the full logits; that is fine at test shapes and is exactly
// what the bounded schedules avoid.
#ifndef PLATEAU_KERNELS_MODEL_REFERENCE_H_
#define PLATEAU_KERNELS_MODEL_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "kernels/model/config.h"

namespace plateau {

// One flat row-major tensor per WeightSpec, in ModelWeights() order.
template <typename T>
using Tensors = std::vector<std::vector<T>>;

// Deterministic initialisation (docs/MODEL.md): N(0, std^2) from a
// counter-based generator keyed by (seed, weight name, element index), so any
// shard of any weight can be generated on its own, identically on every rank.
template <typename T>
Tensors<T> InitWeights(const ModelConfig& m, uint64_t seed);

template <typename T>
Tensors<T> ZerosLike(const Tensors<T>& t);

// Computes the mean cross-entropy over the valid targets of a batch of
// `batch` sequences of m.seq_len tokens (tokens and targets are
// [batch * seq_len], targets may be kIgnoreIndex). When `grads` is not null
// it is overwritten with d loss / d weights, shaped like `weights`.
// (`grads` is a non-deduced parameter so that a plain nullptr can be passed.)
template <typename T>
struct NonDeduced {
  using type = T;
};
template <typename T>
T ReferenceLossAndGrads(const ModelConfig& m, const Tensors<T>& weights,
                        const std::vector<int32_t>& tokens,
                        const std::vector<int32_t>& targets, int64_t batch,
                        typename NonDeduced<Tensors<T>>::type* grads);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_REFERENCE_H_
