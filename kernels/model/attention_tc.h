// The arithmetic of the tensor-core attention kernels
// (kernels/cuda/cuda_attention_tc.h), on the CPU: bf16 q, k, v and dO, the
// block-pair interface of attention.h (running state m, l, acc; lse and
// delta from AttentionFinalize / AttentionDelta; dq a bf16 working gradient,
// dk and dv fp32).
//
// This is the twin the CUDA kernels are tested against, and a way to see on
// the CPU what bf16 training on tensor cores computes
// (ModelKernelsOptions::bf16_attention = kTensorCore). It is a scalar
// reference, one query row (or key) at a time: for tests and small runs,
// not for speed.
//
// What differs from attention.h's fp32 arithmetic on the loaded values: a
// tensor core multiplies bf16 operands, so the probabilities P and the score
// gradients dS are rounded to bf16 where they become the next product's
// operand. Precisely, per query row, over the block's keys in tiles of
// kAttentionTcTile from the block's first key (the tiles fix where each
// probability is rounded, so they are the kernels' tiles):
//   s = scale * (q . k)                      exact bf16 products summed in fp32
//   mnew = max(m, max s); alpha = exp(m - mnew)
//   p = bf16(exp(s - mnew))                  rounded: the P V operand
//   l = l * alpha + sum p                    the rounded p: o stays a convex
//                                            combination of v under them
//   acc = acc * alpha + sum p v              fp32
// (a tile with no visible key leaves the row unchanged), and backward
//   p = exp(scale * (q . k) - lse), dp = dO . v, ds = p (dp - delta)  fp32
//   dq = bf16(dq + scale * sum_keys bf16(ds) k)        once per call
//   dk += scale * sum_{heads of the group, queries} bf16(ds) q
//   dv += sum_{heads of the group, queries} bf16(p) dO
//
// The CUDA kernels compute the same expressions; what they may differ in is
// the order of the fp32 sums (inside the tensor cores, which also truncate
// rather than round within one instruction, and across lanes) and expf
// against std::exp, and either can move a value across a bf16
// rounding boundary. Hence the twin test's tolerance, in units of the
// magnitude each output sums (kernels/testing/attention_tc_testing.h): 2^-6,
// a few bf16 units; attention_tc_test holds this reference to exact
// (double) attention within 2^-6 (o) and 2^-5 (gradients) the same way.
#ifndef PLATEAU_KERNELS_MODEL_ATTENTION_TC_H_
#define PLATEAU_KERNELS_MODEL_ATTENTION_TC_H_

#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/model/attention_shape.h"

namespace plateau {

// Keys per tile (and query rows per block of the CUDA kernels).
inline constexpr int64_t kAttentionTcTile = 64;

// The head_dims the CUDA kernels are built for (cuda_attention_tc.cu's
// template instantiations): what the CUDA model kernels and job validation
// ask. This reference itself takes any head_dim.
inline constexpr bool TensorCoreHeadDim(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128;
}

// Folds the K/V block into (m, l, acc), as AttentionForwardBlock.
void TensorCoreAttentionForward(const AttentionShape& s, const Bf16* q, const Bf16* k,
                                const Bf16* v, float* m, float* l, float* acc);

// Adds this block pair's dq (rounded once), dk and dv, as
// AttentionBackwardBlock. `work` holds AttentionWorkspaceFloats(s) floats
// (it uses 2 * head_dim of them).
void TensorCoreAttentionBackward(const AttentionShape& s, const Bf16* q, const Bf16* k,
                                 const Bf16* v, const Bf16* dout, const float* lse,
                                 const float* delta, Bf16* dq, float* dk, float* dv, float* work);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_ATTENTION_TC_H_
