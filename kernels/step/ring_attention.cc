#include "kernels/step/ring_attention.h"

#include "kernels/status_macros.h"

namespace plateau {

absl::Status RingAttention::CommAfterCompute() {
  PLATEAU_RETURN_IF_ERROR(compute.Record(ev_compute));
  return comm.Wait(ev_compute);
}

absl::Status RingAttention::ComputeAfterComm() {
  PLATEAU_RETURN_IF_ERROR(comm.Record(ev_comm));
  return compute.Wait(ev_comm);
}

absl::Status RingAttention::Forward(const float* q, const float* kv, float* ml, float* o, float* lse,
                                    float* trav, float* work) {
  const int64_t P = world.size(), rank = world.rank(), Ns = shape.q_len;
  const int64_t n = rows * shape.kv_heads * shape.head_dim;
  AttentionShape s = shape;
  float* m = ml;
  float* l = m + rows * shape.heads;
  PLATEAU_RETURN_IF_ERROR(kernels.AttentionInit(compute, s, m, l, o));
  const float* cur = kv;
  for (int64_t step = 0; step < P; ++step) {
    float* next = trav + (step % 2) * 2 * n;
    if (step + 1 < P) {
      // `next` was last read by the compute of step-1: wait for it.
      PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
      PLATEAU_RETURN_IF_ERROR(world.SendRecv(comm, cur, 2 * n, (rank + 1) % P, next, 2 * n,
                                             (rank - 1 + P) % P, DataType::kFloat32));
    }
    s.kv_pos0 = ((rank - step + P) % P) * Ns;
    PLATEAU_RETURN_IF_ERROR(kernels.AttentionForwardBlock(compute, s, q, cur, cur + n, m, l, o, work));
    if (step + 1 < P) {
      PLATEAU_RETURN_IF_ERROR(ComputeAfterComm());
      cur = next;
    }
  }
  return kernels.AttentionFinalize(compute, s, m, l, o, lse);
}

absl::Status RingAttention::Backward(const float* q, const float* kv, const float* dO, const float* lse,
                                     const float* delta, float* dq, float* dkv, float* trav, float* work) {
  const int64_t P = world.size(), rank = world.rank(), Ns = shape.q_len;
  const int64_t n = rows * shape.kv_heads * shape.head_dim;
  AttentionShape s = shape;
  // Traveller i: [k | v | dk | dv] at trav + i * 4n. The block's K/V and its
  // dK/dV accumulator travel as two exchanges: the K/V of the next step is
  // sent ahead while this step computes (it does not depend on it), and
  // only the accumulator, which must be final before it moves, waits for
  // the compute. Same data, same order of accumulation: the same bits as
  // one exchange of [k | v | dk | dv].
  PLATEAU_RETURN_IF_ERROR(be.Copy(compute, trav, kv, 2 * n * sizeof(float)));
  PLATEAU_RETURN_IF_ERROR(be.Fill(compute, trav + 2 * n, 2 * n, 0.0f));
  PLATEAU_RETURN_IF_ERROR(be.Fill(compute, dq, rows * shape.heads * shape.head_dim, 0.0f));
  const int dst = static_cast<int>((rank + 1) % P), src = static_cast<int>((rank - 1 + P) % P);
  for (int64_t step = 0; step < P; ++step) {
    float* cur = trav + (step % 2) * 4 * n;
    float* next = trav + ((step + 1) % 2) * 4 * n;
    if (step + 1 < P) {
      // `next`'s K/V was last read by the compute of step-1 (and `cur`'s
      // was written by the copy above at step 0): wait for it, then send
      // this block's K/V on while the compute below runs.
      PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
      PLATEAU_RETURN_IF_ERROR(world.SendRecv(comm, cur, 2 * n, dst, next, 2 * n, src, DataType::kFloat32));
    }
    s.kv_pos0 = ((rank - step + P) % P) * Ns;
    PLATEAU_RETURN_IF_ERROR(kernels.AttentionBackwardBlock(compute, s, q, cur, cur + n, dO, lse, delta, dq,
                                                           cur + 2 * n, cur + 3 * n, work));
    if (P == 1) return be.Copy(compute, dkv, cur + 2 * n, 2 * n * sizeof(float));
    PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
    // The last hop carries the accumulators home.
    float* to = step + 1 < P ? next + 2 * n : dkv;
    PLATEAU_RETURN_IF_ERROR(world.SendRecv(comm, cur + 2 * n, 2 * n, dst, to, 2 * n, src, DataType::kFloat32));
    // Recorded after the accumulators' exchange and before the next step's
    // K/V is sent ahead: the next compute waits for the block it needs,
    // not for the prefetch of the one after.
    PLATEAU_RETURN_IF_ERROR(ComputeAfterComm());
  }
  return absl::OkStatus();
}

}  // namespace plateau
