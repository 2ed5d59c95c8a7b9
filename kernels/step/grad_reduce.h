// The ZeRO gradient reduce-scatter of bf16 mixed precision: every rank's
// bf16 dense gradient ([P blocks of S], block p owned by rank p) summed over
// the ranks into the owner's shard [S], in fp32 and rounded once
// (kernels/model/precision.h: fp32 for whatever reduces).
// Communicator::ReduceScatter on kBfloat16 rounds once per ring hop, P - 1
// roundings of alike terms (every rank's gradient of the same parameter over
// its own data), and a sum of alike terms stalls in bf16. Mean relative
// error against the exact sum (grad_reduce_test prints it), the ring against
// one rounding: equal terms 2.6e-3 / 0 at P = 8, 6.3e-3 / 0 at P = 16 (and
// 2.6e-2 at P = 64, emulated); alike-sign random terms 1.9e-3 / 1.3e-3 at
// P = 4, 3.3e-3 / 1.3e-3 at P = 16. At P = 2 the two are the same bits.
//
// How: the shard in chunks of c elements. Per chunk each rank gathers the P
// bf16 blocks of its own shard's chunk, one from every rank, as the rows of
// a staging slot [P][c] (row p from rank p): its own by a device copy, the
// others by P - 1 SendRecv exchanges in a shift pattern (shift k sends the
// chunk that rank (r + k) % P owns and receives rank (r - k) % P's chunk of
// this rank's block), straight from the gradient: no packing. Then
// Backend::SumRowsBf16 adds the P rows in fp32 in rank order 0 .. P - 1 and
// rounds once into the shard. The wire carries what a ring reduce-scatter
// does: (P - 1) S bf16 elements sent and received per rank.
//
// Result: shard[i] = rn(((g_0[i] + g_1[i]) + ...) + g_{P-1}[i]), g_p rank p's
// block of this rank's shard, fp32 adds: the same bits on every backend
// (SumRowsBf16 is bitwise between the CPU and CUDA), run to run, and for
// every c (each element's sum is its own). P = 1: ReduceScatter itself (a
// copy), as before.
//
// Memory: none of its own. The caller lends `staging` (idle for the call):
// two slots of P rows of c elements, c = ChunkElements(P, staging_bytes),
// which must be >= 1. Two slots so that chunk j + 1 is exchanged on `comm`
// while chunk j is summed on `compute`.
//
// Streams: the exchanges on `comm`, the sums on `compute`, ordered both ways
// by the events (ring_attention.h's pattern), never a host synchronisation.
// The call first orders `comm` after the work enqueued on `compute` (the
// gradient's producers); the shard is written on `compute`, after every
// exchange: work that reads the shard, or touches the gradient or the
// staging, on another stream must wait for `compute` first.
//
// Thread safety: collective over the ranks of `world` (each calls it with
// the same S and staging_bytes, so that the exchanges match); one call at a
// time per rank.
#ifndef PLATEAU_KERNELS_STEP_GRAD_REDUCE_H_
#define PLATEAU_KERNELS_STEP_GRAD_REDUCE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/communicator.h"

namespace plateau {

struct GradReduceBf16 {
  Backend& be;
  Communicator& world;
  Stream& compute;
  Stream& comm;
  Event& ev_compute;  // compute -> comm ordering
  Event& ev_comm;     // comm -> compute ordering

  // grad: [P * shard_numel], block p at grad + p * shard_numel; shard:
  // [shard_numel], this rank's block summed over the ranks. staging: device
  // memory of staging_bytes (unused at P = 1). FAILED_PRECONDITION, before
  // anything is enqueued (so on every rank alike), when P > 1 and the
  // staging cannot hold one element per row of both slots.
  absl::Status Run(const Bf16* grad, Bf16* shard, int64_t shard_numel, void* staging, int64_t staging_bytes);

  // Elements per chunk for staging_bytes of staging: two slots of P rows.
  static int64_t ChunkElements(int64_t P, int64_t staging_bytes) {
    return staging_bytes / (2 * P * static_cast<int64_t>(sizeof(Bf16)));
  }
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_STEP_GRAD_REDUCE_H_
