// LLEP and PipelinedLLEP planned without a backend (DESIGN.md §1.1): option
// validation, the least-loaded assignment, each rank's routes and index
// vectors for one chunk, the chunk membership, and the dispatch live set's
// bytes. Pure functions of their arguments: every rank computes the same
// assignment from the same counts, so the all-to-all-v sizes agree without
// another exchange. The budget links only this; llep.h and pipelined_llep.h
// allocate exactly the buffers listed by LlepBuffers / PipelinedLlepBuffers.
//
// Route order. An expert's routes in a chunk are numbered globally: source
// rank by source rank, and within a source in its (token, choice) order.
// The assignment gives each expert's numbers [0, load) out in pieces
// [begin, end) to ranks; a source's routes to the expert are the numbers
// [sum of earlier sources' counts, + its count), so each source knows from
// the all-gathered counts which of its routes go where.
//
// Thread safety: plain functions of their arguments.
#ifndef PLATEAU_KERNELS_DISPATCH_LLEP_PLAN_H_
#define PLATEAU_KERNELS_DISPATCH_LLEP_PLAN_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/model/step_options.h"
#include "kernels/model/config.h"

namespace plateau {

// INVALID_ARGUMENT naming the field as a user types it:
// schedule.llep.{alpha, min_piece, lambda, max_borrowed}.
absl::Status ValidateLlepOptions(const LlepOptions& options);
// schedule.pipelined_llep.{chunk_tokens, membership, alpha, min_piece,
// lambda, max_borrowed}.
absl::Status ValidatePipelinedLlepOptions(const PipelinedLlepOptions& options);
// What the schedules need of the model and the expert group: P >= 1 ranks
// owning E / P experts each (model.experts a multiple of the ranks), k in
// [1, E]. Errors name the field.
absl::Status ValidateLlepShape(const ModelConfig& model, int64_t ranks);

// ---------------------------------------------------------------------------
// The assignment.

// Routes [begin, end) of one expert's global route order, computed by `rank`.
struct LlepPiece {
  int32_t rank = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

struct LlepAssignment {
  // C = max(1, floor(alpha * T / P)), T the routes of all experts.
  int64_t capacity = 0;
  // True when the imbalance reached lambda and the least-loaded pass ran
  // (it may still have moved nothing); false: plain expert parallelism.
  bool balanced = false;
  // [E]: the pieces of each expert in route order (the home rank's first
  // when it keeps any); none for an expert without routes. A rank may hold
  // two pieces of one expert (a helper filled to its capacity that later
  // takes a forced remainder); they are computed together.
  std::vector<std::vector<LlepPiece>> pieces;
  // [P]: routes each rank computes.
  std::vector<int64_t> rank_rows;
};

// LLEP's assignment from the global per-expert loads of one layer (or one
// chunk), `loads[e]` for expert e (owned by rank e / (E / P)):
// - plain EP (every expert at home) when P = 1, T = 0, or the imbalance
//   max_p (routes to p's experts) / (T / P) is below lambda;
// - otherwise experts in decreasing load (ties: lower id first); the home
//   rank keeps up to its free capacity, and the overflow goes to the other
//   rank with the least effective load (ties: lower rank), in pieces of at
//   least min_piece routes, each up to that rank's free capacity; when no
//   other rank has min_piece free, the rest goes to the least-loaded one;
// - with options.max_borrowed = B > 0, a rank that already borrows B
//   experts takes no piece of another one; an expert no other rank may
//   borrow stays whole on its home rank (over capacity).
// Details (llep_plan.cc) follow the reference code; where it is silent or
// we differ, the comments there say so.
LlepAssignment AssignLlep(absl::Span<const int64_t> loads, int64_t ranks,
                          const LlepOptions& options);

// ---------------------------------------------------------------------------
// One rank's part of one chunk.

// The rows of one expert that a rank computes, as one GEMM group.
struct LlepGroup {
  int32_t expert = 0;
  int64_t rows = 0;
  int32_t local = -1;     // index among this rank's experts, or -1
  int32_t borrowed = -1;  // slot among the borrowed experts, or -1
};

// Offsets (in int32 elements) of the index vectors of one chunk in one
// buffer, laid out for the given maxima (a launch-sized slot in
// PipelinedLLEP, the realized sizes in LLEP); the host staging and the
// device buffer share it.
struct LlepIndexLayout {
  int64_t send_index = 0;    // [S] send position -> token row of u
  int64_t route_at_pos = 0;  // [S] send position -> route id t*k + j of the layer
  int64_t route_pos = 0;     // [S] chunk route i*k + j -> send position
  int64_t perm = 0;          // [R] expert-major row -> received row
  int64_t inv_perm = 0;      // [R] received row -> expert-major row
  int64_t token_rows = 0;    // [n] chunk token i -> token row (token view only)
  int64_t chunk_routes = 0;  // [S] chunk route i*k + j -> route id (token view only)
  int64_t total = 0;
};

struct LlepRankPlan {
  int64_t layer_tokens = 0;  // N: rows of the caller's u, out, du
  int64_t tokens = 0;        // n: this rank's tokens in the chunk
  // The first token row when the chunk's tokens are a contiguous block (the
  // combine then writes the caller's rows in place); -1 otherwise (the
  // chunk goes through a token view: gathered, combined, scattered back).
  int64_t first_token = 0;
  std::vector<int64_t> send_rows;  // [P] rows to each rank
  std::vector<int64_t> recv_rows;  // [P] rows from each rank
  // The index vectors (host), as LlepIndexLayout describes.
  std::vector<int32_t> send_index, route_at_pos, route_pos, perm, inv_perm, token_rows,
      chunk_routes;
  // Expert groups over the received rows in expert-major order (ascending
  // expert id; within an expert, by source rank, then the source's order).
  std::vector<LlepGroup> groups;
  // Experts this rank borrows (ascending id; owners are then in rank order)
  // and how many come from each owner.
  std::vector<int32_t> borrowed;
  std::vector<int64_t> borrowed_from;  // [P]
  // (helper, expert) pairs this rank lends, helper-major, ascending expert
  // within a helper; how many go to each helper.
  std::vector<std::pair<int32_t, int32_t>> lent;
  std::vector<int64_t> lent_to;  // [P]
  // Some rank of the group borrows in this chunk (the same on every rank,
  // so all of them skip the weight exchanges together or none does).
  bool transfers = false;

  // S = n k routes this rank sends and R rows it receives in the chunk,
  // also when the index vectors were not made.
  int64_t routes_sent = 0;
  int64_t rows_received = 0;

  int64_t routes() const { return routes_sent; }
  int64_t rows() const { return rows_received; }
};

// This rank's plan for one chunk. `counts[s * E + e]` are the routes source
// rank s sends to expert e in the chunk (the all-gathered counts);
// `assignment` is AssignLlep over their column sums; `chosen` is this rank's
// routes of the whole layer ([N*k], host); `tokens` are the chunk's token
// rows in chunk order (the token-view vectors are made when they are not a
// contiguous block). INTERNAL if an expert id is out of range or this
// rank's own counts disagree with `chosen`. Without `index_vectors` the
// index vectors stay empty and everything else is the same: PipelinedLLEP
// stages them once and plans each chunk again as it runs it.
absl::StatusOr<LlepRankPlan> PlanLlepRank(const LlepAssignment& assignment, absl::Span<const int64_t> counts, int rank,
                                          int64_t ranks, const ModelConfig& model, absl::Span<const int32_t> chosen,
                                          int64_t layer_tokens, absl::Span<const int32_t> tokens,
                                          bool index_vectors = true);

// ---------------------------------------------------------------------------
// PipelinedLLEP's chunks.

// K = ceil(max_tokens / c): 0 when no rank has tokens.
int64_t PipelinedLlepChunks(int64_t max_tokens, int64_t chunk_tokens);
// The token rows chunk j of K takes from a source with `tokens` tokens:
// strided j, j+K, ...; contiguous [floor(jN/K), floor((j+1)N/K)). Either way
// at most ceil(N / K) <= c tokens.
std::vector<int32_t> ChunkTokenRows(int64_t tokens, int64_t chunks, int64_t chunk,
                                    ChunkMembership membership);

// ---------------------------------------------------------------------------
// The dispatch live set.

// The sizes one chunk's buffers are allocated for.
struct LlepChunkSizes {
  int64_t tokens = 0;    // n: tokens of the chunk on this rank
  int64_t routes = 0;    // S = n k: routes this rank sends
  int64_t rows = 0;      // R: rows this rank receives
  int64_t borrowed = 0;  // B: experts this rank borrows
  int64_t lent = 0;      // L: (helper, expert) pairs this rank lends
  bool token_view = false;
};
LlepChunkSizes LlepChunkSizesOf(const LlepRankPlan& plan);
// The same sizes without the routes themselves: rank `rank` with `tokens`
// tokens in a contiguous chunk (LLEP's layer) under assignment `a`, whose
// loads were the column sums of the counts. For planning LLEP's peak of a
// given routing: LlepPeakBytes(model, P, LlepSizesFor(...)).
LlepChunkSizes LlepSizesFor(const ModelConfig& model, int64_t ranks, int rank, int64_t tokens,
                            const LlepAssignment& a);
LlepIndexLayout LlepIndexLayoutOf(const LlepChunkSizes& sizes);

// One buffer of the dispatch live set (every one is LiveSet::kDispatch).
struct DispatchBufferSpec {
  const char* name;
  int64_t bytes;
};
int64_t DispatchBufferBytes(const std::vector<DispatchBufferSpec>& buffers);

// The buffers of one chunk, in allocation order (llep_chunk.h carves them),
// "w" in the working precision (e.working: fp32 or bf16), gates in fp32
// (e.accum: the router's softmax):
//   index             int32 LlepIndexLayoutOf(sizes).total
//   scalars           fp32  S (+ 2S with the token view): gates in send
//                           order; the chunk's gates and gate gradients
//   send              w     S x H   routes out (rows of u, dy), back (y, dx)
//   recv, x, t        w     3 x R x H   received rows, expert-major inputs,
//                           outputs / dy
//   ffn               w     5 x R x F   gate, up, act, d act, d up
//   token_rows        w     n x H (token view only)
//   borrowed_weights  w     B x 3HF   gate, up, down of borrowed experts
//   borrowed_grads    w     B x 3HF   their gradients, back to the owners
//   lent              w     L x 3HF   lent weights out, their gradients back
// The schedules allocate with the element sizes of the precision they were
// created for (kBf16MixedElements under bf16: Llep, PipelinedLlep,
// CarveChunk), and the budget passes the step's, to these and the functions
// below: one formula for both.
std::vector<DispatchBufferSpec> LlepChunkBuffers(const ModelConfig& model,
                                                 const LlepChunkSizes& sizes,
                                                 const ElementBytes& e = kFp32Elements);

// LLEP allocates the chunk buffers of its one chunk (the whole layer) at
// their realized sizes in Forward and holds them until Backward ends, after
// the counts buffer (int64 [E + P E]: its counts and everyone's).
std::vector<DispatchBufferSpec> LlepBuffers(const ModelConfig& model, int64_t ranks,
                                            const LlepChunkSizes& sizes,
                                            const ElementBytes& e = kFp32Elements);
int64_t LlepPeakBytes(const ModelConfig& model, int64_t ranks, const LlepChunkSizes& sizes,
                      const ElementBytes& e = kFp32Elements);
// Its worst case over every routing when no rank has more than
// `tokens_per_rank` tokens: R = P N k (with borrowing a rank can be sent
// every route), B and L as LlepMaxBorrowed / LlepMaxLent over P N k routes.
LlepChunkSizes LlepWorstCaseSizes(const ModelConfig& model, int64_t ranks,
                                  int64_t tokens_per_rank, const LlepOptions& options);
int64_t LlepWorstCasePeakBytes(const ModelConfig& model, int64_t ranks, int64_t tokens_per_rank,
                               const LlepOptions& options, const ElementBytes& e = kFp32Elements);

// The most experts one rank borrows, and the most (helper, expert) pairs one
// rank lends, in a chunk of at most `routes` routes in all:
//   B <= min(E - E_p, floor(routes / min_piece)  [, max_borrowed])
//   L <= min(E_p (P - 1), floor(routes / min_piece)
//            [, min(E_p, max_borrowed) (P - 1)])
// the bracketed terms when options.max_borrowed > 0.
// Proof (AssignLlep): every piece given to a helper has >= min_piece routes,
// pieces are disjoint, and a borrowed expert (a lent pair) has at least one
// piece at that helper; so B pieces at one helper hold >= B min_piece of the
// chunk's routes, and L lent pairs of one owner hold >= L min_piece of
// them. A rank borrows only experts it does not own (E - E_p) and lends
// each of its E_p experts to at most the P - 1 others. With the cap, no
// helper ever takes a piece of a new expert once it borrows max_borrowed,
// so each of the P - 1 others borrows at most min(E_p, max_borrowed) of one
// owner's experts.
int64_t LlepMaxBorrowed(const ModelConfig& model, int64_t ranks, int64_t routes,
                        const LlepOptions& options);
int64_t LlepMaxLent(const ModelConfig& model, int64_t ranks, int64_t routes,
                    const LlepOptions& options);

// PipelinedLLEP's launch-sized slots, per chunk, with c_eff = min(c, N_max)
// (a source's chunk has at most ceil(N / K) <= c_eff tokens): n = c_eff,
// S = c_eff k, R = P c_eff k (Eq. 1: each of the P sources sends at most
// c_eff k routes), B and L for P c_eff k routes, the token view with strided
// membership. Independent of N once N_max >= c.
LlepChunkSizes PipelinedLlepSlotSizes(const ModelConfig& model, int64_t ranks,
                                      int64_t max_tokens, const PipelinedLlepOptions& options);
// Count words exchanged once per Forward: [1] the all-reduced N, [K_max E]
// this rank's counts per chunk, [P K_max E] everyone's, with K_max =
// ceil(max_tokens / c). The only term that grows with N: 8 (P + 1) E bytes
// per chunk, exchanged up front so that no chunk waits on the host.
int64_t PipelinedLlepCountWords(const ModelConfig& model, int64_t ranks, int64_t max_tokens,
                                const PipelinedLlepOptions& options);
// Everything PipelinedLLEP allocates (in PipelinedLlep::Create, held for
// its lifetime): the counts, then the chunk slots, then (bf16 mixed with
// K_max > 1) "grad_accum": fp32 accumulators of the own experts' weight
// gradients, (3 E_p + 1) H F floats (E_p experts' three matrices and one
// helper's matrix loaded at a time), so that a gradient summed over K
// chunks rounds to bf16 once, not K times. `max_tokens` is the launch's tokens per rank (the most any
// Forward may be given).
std::vector<DispatchBufferSpec> PipelinedLlepBuffers(const ModelConfig& model, int64_t ranks,
                                                     int64_t max_tokens,
                                                     const PipelinedLlepOptions& options,
                                                     const ElementBytes& e = kFp32Elements);
// Whether PipelinedLlepBuffers lists "grad_accum": bf16 working rows (e)
// and more than one chunk at the launch's N.
bool PipelinedLlepAccumulatesInFp32(int64_t max_tokens, const PipelinedLlepOptions& options, const ElementBytes& e);
// The bound: the sum of PipelinedLlepBuffers. Holds in Forward and in
// Backward (which replays chunk by chunk in the same slots).
int64_t PipelinedLlepBoundBytes(const ModelConfig& model, int64_t ranks, int64_t max_tokens,
                                const PipelinedLlepOptions& options,
                                const ElementBytes& e = kFp32Elements);
// Host (pinned on CUDA) int32 words staging every chunk's index vectors, so
// that each chunk's upload is one asynchronous copy: K_max slot layouts.
int64_t PipelinedLlepHostIndexWords(const ModelConfig& model, int64_t ranks, int64_t max_tokens,
                                    const PipelinedLlepOptions& options);
// Host int32 words keeping each layer's gathered counts from its Forward for
// the recompute's ForwardForBackward (pipelined_llep.h, SetLayer), so that
// the recompute plans without exchanging them again: per layer of
// model.layers, its K and the [P][K_max][E] counts. 4 (1 + P K_max E) bytes
// per layer: at P = 4, E = 16 and one chunk (c >= N), 260 bytes; it grows
// with N as the index staging does (at L = 12, N = 2031, c = 16: 390 KB
// beside the staging's 398 KB).
int64_t PipelinedLlepKeptCountWords(const ModelConfig& model, int64_t ranks, int64_t max_tokens,
                                    const PipelinedLlepOptions& options);
// Host bytes of the planner's arrays (PipelinedLlep::Plan), allocated at
// Create beside the staging: this rank's routes of the layer [N_max k]
// int32 (host_chosen: kept until Backward, which replans each chunk from
// them), its per-chunk counts [K_max E] and everyone's [P K_max E] int64,
// one chunk's counts [P E] and loads [E] int64. A chunk's plan is made from
// these when it is needed (Plan stages its index words; Forward and
// Backward make it again as they run it) and freed after, so the only
// other host memory of a layer is one chunk's planning at a time: plain
// heap of O(P E + P c k) words, independent of N.
int64_t PipelinedLlepPlanningBytes(const ModelConfig& model, int64_t ranks, int64_t max_tokens,
                                   const PipelinedLlepOptions& options);
// Everything PipelinedLLEP holds in host memory (LiveSet::kDispatch, host),
// in bytes: the index staging, the kept counts and the planner's arrays.
// The budget's host plan.
int64_t PipelinedLlepHostBytes(const ModelConfig& model, int64_t ranks, int64_t max_tokens,
                               const PipelinedLlepOptions& options);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_DISPATCH_LLEP_PLAN_H_
