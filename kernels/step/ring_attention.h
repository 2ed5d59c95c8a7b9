// Ring attention over the ranks (DESIGN.md §2): each rank holds a distinct
// slice of every sequence (Ns = T/P positions of each of B sequences, N = B
// Ns rows); its queries meet every rank's keys as the K/V blocks circulate.
// Forward: the next block is in flight on the communication stream while
// the compute stream folds the current one (online softmax). Backward: each
// block travels with its dK/dV accumulator and comes home after P hops; the
// block's K/V is sent ahead while the compute runs (double-buffered), only
// the accumulator waits for it (it must be final before it moves). The
// step's orchestration (step.cc) calls these with its launch-sized buffers.
//
// Streams: every exchange is Communicator::SendRecv on `comm`, ordered with
// `compute` by events (recorded after the producing kernel, waited before
// the consumer), never a host synchronisation. On CUDA `world` is the NCCL
// communicator and SendRecv is a grouped ncclSend/ncclRecv on the comm
// stream's cudaStream_t (kernels/nccl/nccl_communicator.h), so compute and
// exchange overlap on the device; on the CPU it is Gloo on the comm
// stream's thread. The data and the order of accumulation are the same on
// both, so the results equal the CPU/Gloo path's (up to the kernels' own
// twin tolerances).
//
// Thread safety: collective over the ranks of `world`; one call at a time
// per rank.
#ifndef PLATEAU_KERNELS_STEP_RING_ATTENTION_H_
#define PLATEAU_KERNELS_STEP_RING_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/communicator.h"
#include "kernels/model/attention_shape.h"
#include "kernels/model/model_kernels.h"

namespace plateau {

// W is the working type (float: fp32; Bf16: bf16 mixed, working_ops.h).
// q, K/V, dO, dq and dK/dV as they leave are W; the online-softmax state
// (ml, o, lse), delta, `work`, the dK/dV accumulators that travel the ring
// and the dq accumulator stay fp32 (precision.h). Under bf16 each gradient
// rounds once: dq after the last hop, dK/dV when they come home into dkv
// (a rounding per hop would be P roundings of one sum).
template <typename W>
struct RingAttentionT {
  Backend& be;
  ModelKernels& kernels;
  Communicator& world;
  Stream& compute;
  Stream& comm;
  Event& ev_compute;  // compute -> comm ordering
  Event& ev_comm;     // comm -> compute ordering
  // This rank's block: q_len = kv_len = Ns, q_pos0 = rank * Ns.
  AttentionShape shape;
  int64_t rows;  // N = batch * Ns

  // q [N, heads*d], kv [k | v] ([N, kv_heads*d] each): o [N, heads*d] and
  // lse [N * heads]; ml [2 * N * heads] running (m | l), trav two travellers
  // of [k | v], work AttentionWorkspaceFloats(shape).
  absl::Status Forward(const W* q, const W* kv, float* ml, float* o, float* lse, W* trav,
                       float* work);
  // Given dO, lse and delta (rowsum(dO * o)): dq (overwritten) and dkv
  // [dk | dv] of this rank's keys (overwritten); trav two travellers of
  // [k | v] (W) followed by [dk | dv] (fp32): TravellerBytes() each.
  // dq_acc: under bf16 the fp32 dq accumulator, [N, heads*d] floats the
  // caller lends (the step lends `o`, dead once delta is computed); under
  // fp32 dq is its own accumulator and dq_acc must be null.
  absl::Status Backward(const W* q, const W* kv, const W* dO, const float* lse, const float* delta, W* dq, W* dkv,
                        void* trav, float* work, float* dq_acc);

  // Bytes of one backward traveller (the budget's bwd_trav is two).
  static int64_t TravellerBytes(int64_t kv_values) {
    return 2 * kv_values * static_cast<int64_t>(sizeof(W) + sizeof(float));
  }

 private:
  absl::Status CommAfterCompute();
  absl::Status ComputeAfterComm();
};

// The fp32 step's ring attention.
using RingAttention = RingAttentionT<float>;

}  // namespace plateau

#endif  // PLATEAU_KERNELS_STEP_RING_ATTENTION_H_
