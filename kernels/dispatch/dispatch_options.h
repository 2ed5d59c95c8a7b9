// The options of the LLEP and PipelinedLLEP dispatch schedules (DESIGN.md
// §1.1), plain data with their defaults in one place. The step, the budget,
// the job spec and the benchmark read these; llep_plan.h validates them
// (ValidateLlepOptions, ValidatePipelinedLlepOptions: errors name the field as
// a user types it, "schedule.pipelined_llep.chunk_tokens").
//
// Depends on nothing (the model's folder and everything above it may use it).
#ifndef PLATEAU_KERNELS_DISPATCH_DISPATCH_OPTIONS_H_
#define PLATEAU_KERNELS_DISPATCH_DISPATCH_OPTIONS_H_

#include <cstdint>

namespace plateau {

// LLEP's least-loaded assignment (llep_plan.h, AssignLlep).
struct LlepOptions {
  // Per-rank capacity C = max(1, floor(alpha * T / P)) routes, T the routes
  // of the layer (of the chunk, in PipelinedLLEP). The reference code's
  // max_tokens_factor, and its default. > 0; below 1 the ranks' capacities
  // do not cover T and the overflow is forced onto the least-loaded ranks.
  double alpha = 1.1;
  // Smallest piece of an expert's routes that is moved to a helper rank (a
  // helper's GEMM on fewer rows would cost more than it saves). The
  // reference's min_tokens_per_gemm, and its default. >= 1. It also bounds
  // how many experts a rank can borrow: at most routes / min_piece
  // (llep_plan.h).
  int64_t min_piece = 1024;
  // Below this imbalance (max over ranks of the routes to its own experts,
  // over their mean) the layer runs as plain expert parallelism: nothing is
  // moved. The reference's MOE_ADAPTIVE_LPT_ROUTING_RATIO. >= 1; 1 balances
  // every layer (max/mean is never below 1).
  double lambda = 1.0;
};

// Which of a source rank's tokens a PipelinedLLEP chunk takes.
enum class ChunkMembership {
  // Chunk j of K takes tokens j, j+K, j+2K, ...: spreads similar neighbouring
  // routes over the chunks (the paper's default).
  kStrided,
  // Chunk j takes the block [floor(j N / K), floor((j+1) N / K)): the same
  // chunk sizes as strided, for comparison.
  kContiguous,
};

struct PipelinedLlepOptions {
  // c: the most tokens one source rank sends in one chunk, so a rank
  // receives at most P c k rows per chunk whatever the routing (Eq. 1).
  // K = ceil(max_p N_p / c) chunks (at small N, K = 1). >= 1.
  int64_t chunk_tokens = 4096;
  ChunkMembership membership = ChunkMembership::kStrided;
  // The assignment run on each chunk's loads.
  LlepOptions balance;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_DISPATCH_OPTIONS_H_
