#include "kernels/step/grad_reduce.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace plateau {

absl::Status GradReduceBf16::Run(const Bf16* grad, Bf16* shard, int64_t shard_numel, void* staging,
                                 int64_t staging_bytes) {
  const int64_t P = world.size(), rank = world.rank(), S = shard_numel;
  if (S < 0) return absl::InvalidArgumentError(absl::StrCat("grad_reduce: shard_numel must be >= 0, got ", S));
  if (P == 1) {
    // Nothing to sum: the old path, bit for bit.
    PLATEAU_RETURN_IF_ERROR(OrderAfter(comm, compute, ev_compute));
    PLATEAU_RETURN_IF_ERROR(world.ReduceScatter(comm, grad, shard, S, DataType::kBfloat16, ReduceOp::kSum));
    return OrderAfter(compute, comm, ev_comm);
  }
  const int64_t c = ChunkElements(P, staging_bytes);
  if (c < 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grad_reduce: the ", staging_bytes, "-byte staging cannot hold two slots of one bf16 element per rank of ", P,
        " ranks (", 2 * P * static_cast<int64_t>(sizeof(Bf16)), " bytes)"));
  }
  if (S == 0) return absl::OkStatus();
  const int64_t chunks = (S + c - 1) / c;
  Bf16* slots = static_cast<Bf16*>(staging);
  auto slot = [&](int64_t j) { return slots + (j % 2) * P * c; };
  auto len = [&](int64_t j) { return std::min(c, S - j * c); };
  // Chunk j of this rank's shard from every rank into slot j % 2, row p
  // from rank p: its own row copied, the others received, shift k sending
  // rank (rank + k)'s chunk of this rank's gradient to that rank.
  auto exchange = [&](int64_t j) -> absl::Status {
    const int64_t lo = j * c, n = len(j);
    Bf16* rows = slot(j);
    PLATEAU_RETURN_IF_ERROR(be.Copy(comm, rows + rank * c, grad + rank * S + lo, n * sizeof(Bf16)));
    for (int64_t k = 1; k < P; ++k) {
      const int64_t dst = (rank + k) % P, src = (rank - k + P) % P;
      PLATEAU_RETURN_IF_ERROR(world.SendRecv(comm, grad + dst * S + lo, n, static_cast<int>(dst), rows + src * c, n,
                                             static_cast<int>(src), DataType::kBfloat16));
    }
    return absl::OkStatus();
  };
  // The gradient is final on `compute`; chunk 0 is exchanged before the loop.
  PLATEAU_RETURN_IF_ERROR(OrderAfter(comm, compute, ev_compute));
  PLATEAU_RETURN_IF_ERROR(exchange(0));
  PLATEAU_RETURN_IF_ERROR(OrderAfter(compute, comm, ev_comm));
  for (int64_t j = 0; j < chunks; ++j) {
    if (j + 1 < chunks) {
      // Chunk j + 1's slot was last read by the sum of chunk j - 1: wait
      // for it, then exchange while chunk j is summed below.
      PLATEAU_RETURN_IF_ERROR(OrderAfter(comm, compute, ev_compute));
      PLATEAU_RETURN_IF_ERROR(exchange(j + 1));
    }
    PLATEAU_RETURN_IF_ERROR(be.SumRowsBf16(compute, shard + j * c, slot(j), P, len(j), c));
    // Recorded after chunk j + 1's exchange: its sum waits for it.
    if (j + 1 < chunks) PLATEAU_RETURN_IF_ERROR(OrderAfter(compute, comm, ev_comm));
  }
  return absl::OkStatus();
}

}  // namespace plateau
