#include "kernels/step/ring_attention.h"

#include <type_traits>

#include "kernels/model/working_ops.h"
#include "kernels/status_macros.h"

namespace plateau {
template <typename W>
absl::Status RingAttentionT<W>::CommAfterCompute() {
  return OrderAfter(comm, compute, ev_compute);
}

template <typename W>
absl::Status RingAttentionT<W>::ComputeAfterComm() {
  return OrderAfter(compute, comm, ev_comm);
}

template <typename W>
absl::Status RingAttentionT<W>::Forward(const W* q, const W* kv, float* ml, float* o, float* lse,
                                        W* trav, float* work) {
  using Ops = WorkingOps<W>;
  const int64_t P = world.size(), rank = world.rank(), Ns = shape.q_len;
  const int64_t n = rows * shape.kv_heads * shape.head_dim;
  AttentionShape s = shape;
  float* m = ml;
  float* l = m + rows * shape.heads;
  PLATEAU_RETURN_IF_ERROR(kernels.AttentionInit(compute, s, m, l, o));
  const W* cur = kv;
  for (int64_t step = 0; step < P; ++step) {
    W* next = trav + (step % 2) * 2 * n;
    if (step + 1 < P) {
      // `next` was last read by the compute of step-1: wait for it.
      PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
      PLATEAU_RETURN_IF_ERROR(world.SendRecv(comm, cur, 2 * n, (rank + 1) % P, next, 2 * n,
                                             (rank - 1 + P) % P, kWorkingDataType<W>));
    }
    s.kv_pos0 = ((rank - step + P) % P) * Ns;
    PLATEAU_RETURN_IF_ERROR(Ops::AttentionForwardBlock(kernels, compute, s, q, cur, cur + n, m, l, o, work));
    if (step + 1 < P) {
      PLATEAU_RETURN_IF_ERROR(ComputeAfterComm());
      cur = next;
    }
  }
  return kernels.AttentionFinalize(compute, s, m, l, o, lse);
}

template <typename W>
absl::Status RingAttentionT<W>::Backward(const W* q, const W* kv, const W* dO, const float* lse, const float* delta,
                                         W* dq, W* dkv, void* trav, float* work, float* dq_acc) {
  using Ops = WorkingOps<W>;
  constexpr bool kFp32 = std::is_same_v<W, float>;
  const int64_t P = world.size(), rank = world.rank(), Ns = shape.q_len;
  const int64_t n = rows * shape.kv_heads * shape.head_dim;
  const int64_t nq = rows * shape.heads * shape.head_dim;
  // dq sums in fp32 across the hops: in dq itself under fp32, in the lent
  // dq_acc under bf16 (rounded into dq once, after the last hop).
  float* dq32;
  if constexpr (kFp32) {
    if (dq_acc != nullptr) {
      return absl::InvalidArgumentError("ring attention (fp32): dq_acc must be null; dq is its own accumulator");
    }
    dq32 = dq;
  } else {
    if (dq_acc == nullptr) {
      return absl::InvalidArgumentError(
          "ring attention (bf16): dq_acc, the fp32 dq accumulator of rows * heads * head_dim floats, is null");
    }
    dq32 = dq_acc;
  }
  AttentionShape s = shape;
  // Traveller i: [k | v] (W) then [dk | dv] (fp32) at trav + i *
  // TravellerBytes(n); in fp32 that is [k | v | dk | dv] of 4n floats. The
  // block's K/V and its dK/dV accumulator travel as two exchanges: the K/V
  // of the next step is sent ahead while this step computes (it does not
  // depend on it), and only the accumulator, which must be final before it
  // moves, waits for the compute. Same data, same order of accumulation:
  // the same bits as one exchange of the whole traveller.
  char* base = static_cast<char*>(trav);
  auto kv_of = [&](int64_t slot) { return reinterpret_cast<W*>(base + slot * TravellerBytes(n)); };
  auto acc_of = [&](int64_t slot) {
    return reinterpret_cast<float*>(base + slot * TravellerBytes(n) + 2 * n * sizeof(W));
  };
  PLATEAU_RETURN_IF_ERROR(be.Copy(compute, kv_of(0), kv, 2 * n * sizeof(W)));
  PLATEAU_RETURN_IF_ERROR(be.Fill(compute, acc_of(0), 2 * n, 0.0f));
  PLATEAU_RETURN_IF_ERROR(be.Fill(compute, dq32, nq, 0.0f));
  const int dst = static_cast<int>((rank + 1) % P), src = static_cast<int>((rank - 1 + P) % P);
  for (int64_t step = 0; step < P; ++step) {
    W* cur = kv_of(step % 2);
    float* cur_acc = acc_of(step % 2);
    W* next = kv_of((step + 1) % 2);
    float* next_acc = acc_of((step + 1) % 2);
    if (step + 1 < P) {
      // `next`'s K/V was last read by the compute of step-1 (and `cur`'s
      // was written by the copy above at step 0): wait for it, then send
      // this block's K/V on while the compute below runs.
      PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
      PLATEAU_RETURN_IF_ERROR(world.SendRecv(comm, cur, 2 * n, dst, next, 2 * n, src, kWorkingDataType<W>));
    }
    s.kv_pos0 = ((rank - step + P) % P) * Ns;
    PLATEAU_RETURN_IF_ERROR(Ops::AttentionBackwardBlock(kernels, compute, s, q, cur, cur + n, dO, lse, delta, dq32,
                                                        cur_acc, cur_acc + n, work));
    if (P == 1) {
      if constexpr (kFp32) {
        return be.Copy(compute, dkv, cur_acc, 2 * n * sizeof(float));
      } else {
        PLATEAU_RETURN_IF_ERROR(be.ConvertToBf16(compute, dq, dq32, nq));
        return be.ConvertToBf16(compute, dkv, cur_acc, 2 * n);
      }
    }
    PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
    // The last hop carries the accumulators home: straight into dkv in
    // fp32; under bf16 into the idle traveller's fp32 slot (no prefetch
    // lands there on the last step), rounded into dkv once below.
    const bool last = step + 1 == P;
    float* to = next_acc;
    if constexpr (kFp32) {
      if (last) to = dkv;
    }
    PLATEAU_RETURN_IF_ERROR(world.SendRecv(comm, cur_acc, 2 * n, dst, to, 2 * n, src, DataType::kFloat32));
    // Recorded after the accumulators' exchange and before the next step's
    // K/V is sent ahead: the next compute waits for the block it needs,
    // not for the prefetch of the one after.
    PLATEAU_RETURN_IF_ERROR(ComputeAfterComm());
    if constexpr (!kFp32) {
      if (last) {
        PLATEAU_RETURN_IF_ERROR(be.ConvertToBf16(compute, dq, dq32, nq));
        PLATEAU_RETURN_IF_ERROR(be.ConvertToBf16(compute, dkv, next_acc, 2 * n));
      }
    }
  }
  return absl::OkStatus();
}

template struct RingAttentionT<float>;
template struct RingAttentionT<Bf16>;

}  // namespace plateau
