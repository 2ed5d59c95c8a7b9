// The arithmetic of the tensor-core attention kernels
// (kernels/cuda/cuda_attention_tc.h), on the CPU: bf16 q, k, v and dO, the
// block-pair interface of attention.h (running state m, l, acc; lse and
// delta from AttentionFinalize / AttentionDelta; dq, dk and dv fp32
// accumulators: ring attention rounds dq and dk / dv once, at the end).
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
// probability is rounded, so they are the kernels' tiles), with the
// exponentials in base 2 and the scale folded into one fused multiply-add
// (FlashAttention's form: on a GPU one FFMA and one MUFU.EX2 per score):
//   x = q . k                                exact bf16 products summed in fp32
//   c = scale * log2(e)                      fp32, once per call
//   m2 = m * log2(e) at entry                the running maximum, base 2
//   mnew = max(m2, max(x) * c); alpha = exp2(m2 - mnew)
//   p = bf16(exp2(fma(x, c, -mnew)))         rounded: the P V operand
//   l = l * alpha + sum p                    the rounded p: o stays a convex
//                                            combination of v under them
//   acc = acc * alpha + sum p v              fp32
// (a tile with no visible key leaves the row unchanged; at exit m = m2 *
// ln(2) where a tile raised it, else m as it came: l and acc are scaled
// together, so that rounding moves lse = m + log(l) by an ulp of m and o
// not at all), and backward, with lse2 = lse * log2(e) (+inf where lse =
// -inf: p = 0)
//   p = exp2(fma(q . k, c, -lse2)), dp = dO . v, ds = p (dp - delta)  fp32
//   dq += scale * sum_keys bf16(ds) k                  one addition per call
//   dk += scale * sum_{heads of the group, queries} bf16(ds) q
//   dv += sum_{heads of the group, queries} bf16(p) dO
// exp2 here is std::exp2 with results below the smallest normal float
// flushed to 0, as the kernels' ex2.approx.ftz.
//
// The CUDA kernels compute the same expressions; what they may differ in is
// the order of the fp32 sums (inside the tensor cores, which also truncate
// rather than round within one instruction, and across lanes) and
// ex2.approx's ulps (at most 2 against a correctly rounded 2^x) against
// std::exp2, and either can move a value across a bf16
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
// log2(e) and ln(2) as floats: the base changes of the arithmetic above
// (kernels/cuda/cuda_attention_tc.h holds the same two).
inline constexpr float kAttentionTcLog2e = 1.44269504088896340736f;
inline constexpr float kAttentionTcLn2 = 0.69314718055994530942f;

// The head_dims the CUDA kernels are built for (cuda_attention_tc.cu's
// template instantiations): what the CUDA model kernels and job validation
// ask. This reference itself takes any head_dim.
inline constexpr bool TensorCoreHeadDim(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128;
}

// Folds the K/V block into (m, l, acc), as AttentionForwardBlock.
void TensorCoreAttentionForward(const AttentionShape& s, const Bf16* q, const Bf16* k,
                                const Bf16* v, float* m, float* l, float* acc);

// Adds this block pair's dq, dk and dv, as
// AttentionBackwardBlock. `work` holds AttentionWorkspaceFloats(s) floats
// (it uses 2 * head_dim of them).
void TensorCoreAttentionBackward(const AttentionShape& s, const Bf16* q, const Bf16* k, const Bf16* v, const Bf16* dout,
                                 const float* lse, const float* delta, float* dq, float* dk, float* dv, float* work);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_ATTENTION_TC_H_
