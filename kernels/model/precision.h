// The step's numeric precision and the element sizes it implies, read by
// every plan function (the budget's terms) so that the bytes of a buffer are
// counted from one buffer list in either precision (no second formula).
//
// fp32: everything in 4-byte floats (what the CPU backend computes).
// bf16 mixed (DESIGN.md §1.4, issue 17): bf16 working weights, activations,
// gradients and the rows that dispatch, the projection and the checkpoints
// hold; fp32 master weights and Adam moments; fp32 for what accumulates or
// reduces (loss, log-sum-exp, online-softmax state: m, l and the running
// output o across the ring's hops, RMSNorm's rstd, the
// router's softmax and gates, attention's score panel, the dK/dV
// accumulators that travel the ring and dq's sum over the hops (in `o`,
// dead by then: no buffer of its own), Ring-DTP's dX / dW accumulators and
// PipelinedLLEP's expert-gradient sums over its chunks, and the ZeRO
// gradient sum over the ranks: kernels/step/grad_reduce.h). Ring-DTP's three
// slots rotate between a read-only traveller (working) and a dX / dW
// accumulator (fp32), so each is sized for the larger.
//
// Thread safety: constants and pure functions.
#ifndef PLATEAU_KERNELS_MODEL_PRECISION_H_
#define PLATEAU_KERNELS_MODEL_PRECISION_H_

#include <cstdint>

namespace plateau {

enum class Precision { kFp32, kBf16Mixed };

// Bytes per element of each kind of buffer.
struct ElementBytes {
  int64_t working = 4;  // weights as the kernels read them, activations, gradients, routed rows
  int64_t master = 4;   // master weights and Adam moments (always fp32)
  int64_t accum = 4;    // accumulators and reductions (always fp32)

  // Whether a weight's working copy can serve as its own fp32 master (true
  // in fp32: the owned weights then need no separate master).
  bool working_is_master() const { return working == master; }
};

// fp32 and bf16 mixed; every plan function defaults to fp32, and the step
// and its schedules pass the sizes of the precision they compute.
inline constexpr ElementBytes kFp32Elements{4, 4, 4};
inline constexpr ElementBytes kBf16MixedElements{2, 4, 4};

inline constexpr ElementBytes ElementBytesOf(Precision p) {
  return p == Precision::kBf16Mixed ? kBf16MixedElements : kFp32Elements;
}

// "fp32" or "bf16" (the job spec's PRECISION_FP32 / PRECISION_BF16).
inline constexpr const char* PrecisionName(Precision p) {
  return p == Precision::kBf16Mixed ? "bf16" : "fp32";
}

// The arithmetic of bf16 attention's block pairs (the ModelKernels *Bf16
// attention ops; StepOptions::bf16_attention; the job's bf16_attention).
//   kTiles: the fp32 tile arithmetic on the exactly loaded bf16 values
//     (attention.h); on CUDA the tiled kernels, bit for bit its fp32 ones.
//   kTensorCore: what tensor cores compute (kernels/model/attention_tc.h):
//     bf16 operands, fp32 accumulation, the probabilities and dS rounded to
//     bf16 where they become operands. CUDA: the mma.sync kernels, or on an
//     H100/H200 the wgmma ones where the device's checks agree
//     (StepOptions::attention_wgmma)
//     (kernels/cuda/cuda_attention_tc.h; head_dim 64 or 128, else the op
//     answers UNIMPLEMENTED); CPU: attention_tc.h's scalar reference.
//   kAuto: on CUDA kTensorCore where its kernels take the head_dim on that
//     device, else kTiles; on the CPU kTiles.
enum class Bf16Attention { kAuto, kTiles, kTensorCore };

// "auto", "tiles", "tensor_core" (the job spec's BF16_ATTENTION_*).
inline constexpr const char* Bf16AttentionName(Bf16Attention a) {
  return a == Bf16Attention::kTiles        ? "tiles"
         : a == Bf16Attention::kTensorCore ? "tensor_core"
                                           : "auto";
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_PRECISION_H_
