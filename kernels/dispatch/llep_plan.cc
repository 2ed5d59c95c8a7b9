#include "kernels/dispatch/llep_plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace plateau {
namespace {

constexpr int64_t kI32 = sizeof(int32_t), kI64 = sizeof(int64_t);

template <typename T>
absl::Status Bad(absl::string_view field, absl::string_view expected, T got) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got));
}

// `prefix` is the options' path as a user types it ("schedule.llep.").
absl::Status ValidateBalance(const LlepOptions& o, absl::string_view prefix) {
  // Written so that NaN fails too.
  if (!(o.alpha > 0.0 && std::isfinite(o.alpha))) {
    return Bad(absl::StrCat(prefix, "alpha"), "a finite capacity factor > 0", o.alpha);
  }
  if (o.min_piece < 1) {
    return Bad(absl::StrCat(prefix, "min_piece"), ">= 1 routes per moved piece", o.min_piece);
  }
  if (!(o.lambda >= 1.0 && std::isfinite(o.lambda))) {
    return Bad(absl::StrCat(prefix, "lambda"),
               "a finite imbalance threshold >= 1 (max/mean load is never below 1; 1 balances "
               "every layer)",
               o.lambda);
  }
  if (o.max_borrowed < 0) {
    return Bad(absl::StrCat(prefix, "max_borrowed"),
               ">= 0 experts one rank may borrow (0: no cap)", o.max_borrowed);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateLlepOptions(const LlepOptions& options) {
  return ValidateBalance(options, "schedule.llep.");
}

absl::Status ValidatePipelinedLlepOptions(const PipelinedLlepOptions& o) {
  if (o.chunk_tokens < 1) {
    return Bad("schedule.pipelined_llep.chunk_tokens", ">= 1 tokens per source rank per chunk",
               o.chunk_tokens);
  }
  if (o.membership != ChunkMembership::kStrided && o.membership != ChunkMembership::kContiguous) {
    return Bad("schedule.pipelined_llep.membership", "strided or contiguous",
               static_cast<int>(o.membership));
  }
  return ValidateBalance(o.balance, "schedule.pipelined_llep.");
}

absl::Status ValidateLlepShape(const ModelConfig& m, int64_t ranks) {
  if (ranks < 1) return Bad("layout.ranks", ">= 1 ranks in the expert group", ranks);
  if (m.experts < ranks || m.experts % ranks != 0) {
    return Bad("model.experts", absl::StrCat("a multiple of the ", ranks, " ranks"), m.experts);
  }
  if (m.top_k < 1 || m.top_k > m.experts) {
    return Bad("model.top_k", absl::StrCat("in [1, model.experts = ", m.experts, "]"), m.top_k);
  }
  if (m.hidden < 1) return Bad("model.hidden", ">= 1", m.hidden);
  if (m.expert_ffn < 1) return Bad("model.expert_ffn", ">= 1", m.expert_ffn);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// The assignment. The reference (SalesforceAIResearch/LeastLoadedEP,
// compute_llep_lpt_plan) is followed in: C from alpha over the mean load;
// experts in decreasing load, a stable order (lower id first on ties);
// "effective load" = routes already assigned + routes of the rank's own
// experts not yet visited, so that a helper is not picked just before its
// own heavy experts arrive; the least effective load picks the helper (lower
// rank first on ties); the imbalance test on per-rank native loads.
// Our choices, where it is silent or differs:
// - C = max(1, floor(alpha T / P)) (the reference floors T / P first).
// - Every piece moved to a helper has at least min_piece routes. An overflow
//   below min_piece stays on its home rank, over capacity; a piece that would
//   leave a remainder below min_piece takes the remainder too (its helper
//   goes over capacity by less than min_piece). The reference lets a last
//   piece of any size move. This is what bounds the borrowed experts by
//   routes / min_piece (llep_plan.h), which sizes PipelinedLLEP's slots.
// - One rule for an expert whose home has some room and one whose home has
//   none: helpers are re-ranked before every piece (the reference ranks them
//   once in the second case), and a remainder no helper has min_piece room
//   for goes whole to the least effectively loaded helper.
// - max_borrowed (ours; the reference has no cap): a helper that already
//   borrows max_borrowed experts takes no piece of another expert (more of
//   one it already borrows is free: its weights are there). Helpers are
//   chosen among the others by the rules above; when no other rank may
//   borrow the expert, it stays whole on its home rank, over capacity.
//   Compute balance gives way to the cap, never the memory bound.
LlepAssignment AssignLlep(absl::Span<const int64_t> loads, int64_t P, const LlepOptions& o) {
  const int64_t E = static_cast<int64_t>(loads.size()), Ep = E / P, m = o.min_piece;
  LlepAssignment a;
  a.pieces.assign(E, {});
  std::vector<int64_t> native(P, 0);
  int64_t T = 0;
  for (int64_t e = 0; e < E; ++e) {
    T += loads[e];
    native[e / Ep] += loads[e];
  }
  const double mean = static_cast<double>(T) / static_cast<double>(P);
  // Capped at 2^62 before the conversion: a finite but huge alpha (1e300)
  // would not fit in int64, and converting it is undefined (x86 gave
  // INT64_MIN, so capacity 1: "never spill" spilled everything).
  a.capacity =
      std::max<int64_t>(1, static_cast<int64_t>(std::min(std::floor(o.alpha * mean), 0x1p62)));
  const int64_t max_native = *std::max_element(native.begin(), native.end());
  // max / mean < lambda  <=>  max * P < lambda * T, for T > 0.
  a.balanced = P > 1 && T > 0 &&
               !(static_cast<double>(max_native) * static_cast<double>(P) <
                 o.lambda * static_cast<double>(T));
  if (!a.balanced) {
    for (int64_t e = 0; e < E; ++e) {
      if (loads[e] > 0) a.pieces[e].push_back({static_cast<int32_t>(e / Ep), 0, loads[e]});
    }
    a.rank_rows = native;
    return a;
  }

  std::vector<int32_t> order;
  for (int64_t e = 0; e < E; ++e) {
    if (loads[e] > 0) order.push_back(static_cast<int32_t>(e));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return loads[x] > loads[y]; });
  std::vector<int64_t> pending = native, assigned(P, 0);
  auto effective = [&](int64_t g) { return assigned[g] + pending[g]; };
  // borrows[g]: experts rank g borrows so far; holds[g]: it has a piece of
  // the current expert.
  std::vector<int64_t> borrows(P, 0);
  std::vector<char> holds(P, 0);
  auto may_borrow = [&](int32_t g) {
    return o.max_borrowed == 0 || holds[g] || borrows[g] < o.max_borrowed;
  };
  std::vector<int32_t> helpers;
  for (int32_t e : order) {
    const int64_t L = loads[e];
    const int32_t home = static_cast<int32_t>(e / Ep);
    pending[home] -= L;
    std::fill(holds.begin(), holds.end(), 0);
    std::vector<LlepPiece>& pieces = a.pieces[e];
    auto give = [&](int32_t rank, int64_t begin, int64_t n) {
      pieces.push_back({rank, begin, begin + n});
      assigned[rank] += n;
      if (rank != home && !holds[rank]) ++borrows[rank];
      holds[rank] = 1;
    };
    // Who may take a piece of e is fixed before the first piece (a helper
    // given one holds e and stays eligible), so an expert no other rank may
    // borrow stays home whole.
    helpers.clear();
    for (int32_t g = 0; g < P; ++g) {
      if (g != home && may_borrow(g)) helpers.push_back(g);
    }
    int64_t keep = std::clamp<int64_t>(a.capacity - effective(home), 0, L);
    if (L - keep < m || helpers.empty()) keep = L;
    if (keep > 0) give(home, 0, keep);
    for (int64_t off = keep; off < L;) {
      const int64_t remaining = L - off;  // >= m: kept so by every step
      // Least effective load first, lower rank on ties.
      std::sort(helpers.begin(), helpers.end(), [&](int32_t x, int32_t y) {
        return std::make_pair(effective(x), x) < std::make_pair(effective(y), y);
      });
      int32_t to = helpers.front();  // forced: no helper has room for a piece
      int64_t piece = remaining;
      for (int32_t g : helpers) {
        const int64_t room = a.capacity - effective(g);
        if (room >= m) {
          to = g;
          piece = std::min(remaining, room);
          if (remaining - piece < m) piece = remaining;
          break;
        }
      }
      give(to, off, piece);
      off += piece;
    }
  }
  a.rank_rows = assigned;
  return a;
}

// ---------------------------------------------------------------------------
// One rank's plan.

absl::StatusOr<LlepRankPlan> PlanLlepRank(const LlepAssignment& a, absl::Span<const int64_t> counts, int me, int64_t P,
                                          const ModelConfig& model, absl::Span<const int32_t> chosen, int64_t N,
                                          absl::Span<const int32_t> tokens, bool index_vectors) {
  const int64_t E = model.experts, K = model.top_k, Ep = E / P;
  const int64_t n = static_cast<int64_t>(tokens.size()), S = n * K;
  LlepRankPlan p;
  p.layer_tokens = N;
  p.tokens = n;
  bool contiguous = true;
  for (int64_t i = 1; i < n; ++i) contiguous = contiguous && tokens[i] == tokens[0] + i;
  p.first_token = n == 0 ? 0 : contiguous ? tokens[0] : -1;

  // start[s*E + e]: the first route number of expert e from source s.
  std::vector<int64_t> start(P * E);
  for (int64_t e = 0; e < E; ++e) {
    int64_t run = 0;
    for (int64_t s = 0; s < P; ++s) {
      start[s * E + e] = run;
      run += counts[s * E + e];
    }
  }
  // Routes of [lo, hi) of expert e that `rank` computes.
  auto routes_at = [&](int64_t e, int64_t lo, int64_t hi, int64_t rank) {
    int64_t c = 0;
    for (const LlepPiece& q : a.pieces[e]) {
      if (q.rank == rank) c += std::max<int64_t>(0, std::min(hi, q.end) - std::max(lo, q.begin));
    }
    return c;
  };
  auto has_piece_at = [&](int64_t e, int64_t rank) {
    for (const LlepPiece& q : a.pieces[e]) {
      if (q.rank == rank) return true;
    }
    return false;
  };

  // Sender: each route's destination, then a counting sort by (destination,
  // expert), keeping the chunk's route order within a bucket.
  std::vector<int32_t> dest(S);
  std::vector<int64_t> seen(E, 0), bucket(P * E, 0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < K; ++j) {
      const int32_t e = chosen[static_cast<int64_t>(tokens[i]) * K + j];
      if (e < 0 || e >= E) {
        return absl::InternalError(absl::StrCat("router chose expert ", e, " of ", E));
      }
      const int64_t g = start[me * E + e] + seen[e]++;
      int32_t d = -1;
      for (const LlepPiece& q : a.pieces[e]) {
        if (g >= q.begin && g < q.end) d = q.rank;
      }
      if (d < 0) {
        return absl::InternalError(absl::StrCat("route ", g, " of expert ", e,
                                                " is in no piece of the assignment"));
      }
      dest[i * K + j] = d;
      ++bucket[d * E + e];
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    if (seen[e] != counts[me * E + e]) {
      return absl::InternalError(absl::StrCat("rank ", me, " sends ", seen[e],
                                              " routes to expert ", e, " but counted ",
                                              counts[me * E + e]));
    }
  }
  std::vector<int64_t> fill(P * E + 1, 0);
  for (int64_t b = 0; b < P * E; ++b) fill[b + 1] = fill[b] + bucket[b];
  p.send_rows.assign(P, 0);
  for (int64_t d = 0; d < P; ++d) p.send_rows[d] = fill[(d + 1) * E] - fill[d * E];
  p.routes_sent = S;
  if (index_vectors) {
    p.send_index.resize(S);
    p.route_at_pos.resize(S);
    p.route_pos.resize(S);
  }
  for (int64_t i = 0; i < (index_vectors ? n : 0); ++i) {
    for (int64_t j = 0; j < K; ++j) {
      const int64_t r = i * K + j;
      const int32_t e = chosen[static_cast<int64_t>(tokens[i]) * K + j];
      const int64_t pos = fill[dest[r] * E + e]++;
      p.send_index[pos] = tokens[i];
      p.route_at_pos[pos] = static_cast<int32_t>(static_cast<int64_t>(tokens[i]) * K + j);
      p.route_pos[r] = static_cast<int32_t>(pos);
    }
  }

  // Transfers: what this rank borrows and lends; whether anyone does.
  std::vector<int32_t> slot_of(E, -1);
  p.borrowed_from.assign(P, 0);
  p.lent_to.assign(P, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t home = e / Ep;
    for (const LlepPiece& q : a.pieces[e]) p.transfers = p.transfers || q.rank != home;
    if (home != me && has_piece_at(e, me)) {
      slot_of[e] = static_cast<int32_t>(p.borrowed.size());
      p.borrowed.push_back(static_cast<int32_t>(e));
      ++p.borrowed_from[home];
    }
  }
  for (int32_t d = 0; d < P; ++d) {
    if (d == me) continue;
    for (int64_t le = 0; le < Ep; ++le) {
      const int64_t e = me * Ep + le;
      if (has_piece_at(e, d)) {
        p.lent.emplace_back(d, static_cast<int32_t>(e));
        ++p.lent_to[d];
      }
    }
  }

  // Receiver: rows arrive source-major (each source's block in expert
  // order); the groups want them expert-major.
  std::vector<int64_t> from(P * E);
  p.recv_rows.assign(P, 0);
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t e = 0; e < E; ++e) {
      from[s * E + e] = routes_at(e, start[s * E + e], start[s * E + e] + counts[s * E + e], me);
      p.recv_rows[s] += from[s * E + e];
    }
  }
  std::vector<int64_t> at(P);  // next received row of each source's block
  for (int64_t s = 0, run = 0; s < P; ++s) {
    at[s] = run;
    run += p.recv_rows[s];
  }
  std::vector<int64_t> block_start(P * E);
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t e = 0, run = at[s]; e < E; ++e) {
      block_start[s * E + e] = run;
      run += from[s * E + e];
    }
  }
  const int64_t R = std::accumulate(p.recv_rows.begin(), p.recv_rows.end(), int64_t{0});
  p.rows_received = R;
  if (index_vectors) {
    p.perm.reserve(R);
    p.inv_perm.resize(R);
  }
  for (int64_t e = 0; e < E; ++e) {
    int64_t rows = 0;
    for (int64_t s = 0; s < P; ++s) {
      for (int64_t i = 0; i < (index_vectors ? from[s * E + e] : 0); ++i) {
        const int64_t r = block_start[s * E + e] + i;
        p.inv_perm[r] = static_cast<int32_t>(p.perm.size());
        p.perm.push_back(static_cast<int32_t>(r));
      }
      rows += from[s * E + e];
    }
    if (rows == 0) continue;
    const bool own = e / Ep == me;
    p.groups.push_back({static_cast<int32_t>(e), rows, own ? static_cast<int32_t>(e % Ep) : -1,
                        own ? -1 : slot_of[e]});
  }

  if (p.first_token < 0 && index_vectors) {
    p.token_rows.assign(tokens.begin(), tokens.end());
    p.chunk_routes.resize(S);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < K; ++j) {
        p.chunk_routes[i * K + j] = static_cast<int32_t>(static_cast<int64_t>(tokens[i]) * K + j);
      }
    }
  }
  return p;
}

// ---------------------------------------------------------------------------
// Chunks.

int64_t PipelinedLlepChunks(int64_t max_tokens, int64_t chunk_tokens) {
  // Not (max_tokens + chunk_tokens - 1) / chunk_tokens: that overflows for
  // a chunk_tokens near INT64_MAX (a spec may ask for one) and gave 0
  // chunks, so the layer ran no chunk at all.
  return max_tokens <= 0 ? 0 : 1 + (max_tokens - 1) / chunk_tokens;
}

std::vector<int32_t> ChunkTokenRows(int64_t N, int64_t K, int64_t j, ChunkMembership membership) {
  std::vector<int32_t> rows;
  if (membership == ChunkMembership::kStrided) {
    for (int64_t t = j; t < N; t += K) rows.push_back(static_cast<int32_t>(t));
  } else {
    for (int64_t t = j * N / K; t < (j + 1) * N / K; ++t) rows.push_back(static_cast<int32_t>(t));
  }
  return rows;
}

// ---------------------------------------------------------------------------
// The live set.

LlepChunkSizes LlepChunkSizesOf(const LlepRankPlan& p) {
  LlepChunkSizes s;
  s.tokens = p.tokens;
  s.routes = p.routes();
  s.rows = p.rows();
  s.borrowed = static_cast<int64_t>(p.borrowed.size());
  s.lent = static_cast<int64_t>(p.lent.size());
  s.token_view = p.first_token < 0;
  return s;
}

LlepChunkSizes LlepSizesFor(const ModelConfig& m, int64_t ranks, int rank, int64_t tokens,
                            const LlepAssignment& a) {
  const int64_t Ep = m.experts / ranks;
  LlepChunkSizes s;
  s.tokens = tokens;
  s.routes = tokens * m.top_k;
  s.rows = a.rank_rows[rank];
  for (int64_t e = 0; e < m.experts; ++e) {
    const int64_t home = e / Ep;
    std::vector<char> at(ranks, 0);
    for (const LlepPiece& q : a.pieces[e]) at[q.rank] = 1;
    if (home != rank) s.borrowed += at[rank];
    if (home == rank) s.lent += std::count(at.begin(), at.end(), 1) - at[rank];
  }
  return s;
}

LlepIndexLayout LlepIndexLayoutOf(const LlepChunkSizes& s) {
  const int64_t S = s.routes, R = s.rows;
  LlepIndexLayout l;
  l.send_index = 0;
  l.route_at_pos = S;
  l.route_pos = 2 * S;
  l.perm = 3 * S;
  l.inv_perm = 3 * S + R;
  l.token_rows = l.chunk_routes = l.total = 3 * S + 2 * R;
  if (s.token_view) {
    l.chunk_routes = l.token_rows + s.tokens;
    l.total = l.chunk_routes + S;
  }
  return l;
}

int64_t DispatchBufferBytes(const std::vector<DispatchBufferSpec>& buffers) {
  int64_t total = 0;
  for (const DispatchBufferSpec& b : buffers) total += b.bytes;
  return total;
}

std::vector<DispatchBufferSpec> LlepChunkBuffers(const ModelConfig& m, const LlepChunkSizes& s,
                                                 const ElementBytes& e) {
  const int64_t H = m.hidden, F = m.expert_ffn, X = 3 * H * F;
  const int64_t S = s.routes, R = s.rows, view = s.token_view ? 1 : 0;
  const int64_t w = e.working;
  return {
      {"index", LlepIndexLayoutOf(s).total * kI32},
      {"scalars", (S + view * 2 * S) * e.accum},
      {"send", S * H * w},
      {"recv", R * H * w},
      {"x", R * H * w},
      {"t", R * H * w},
      {"ffn", 5 * R * F * w},
      {"token_rows", view * s.tokens * H * w},
      {"borrowed_weights", s.borrowed * X * w},
      {"borrowed_grads", s.borrowed * X * w},
      {"lent", s.lent * X * w},
  };
}

std::vector<DispatchBufferSpec> LlepBuffers(const ModelConfig& m, int64_t ranks,
                                            const LlepChunkSizes& s, const ElementBytes& e) {
  std::vector<DispatchBufferSpec> b = {{"counts", (m.experts + ranks * m.experts) * kI64}};
  for (const DispatchBufferSpec& c : LlepChunkBuffers(m, s, e)) b.push_back(c);
  return b;
}

int64_t LlepPeakBytes(const ModelConfig& m, int64_t ranks, const LlepChunkSizes& s, const ElementBytes& e) {
  return DispatchBufferBytes(LlepBuffers(m, ranks, s, e));
}

int64_t LlepMaxBorrowed(const ModelConfig& m, int64_t ranks, int64_t routes,
                        const LlepOptions& o) {
  const int64_t b = std::min(m.experts - m.experts / ranks, routes / o.min_piece);
  return o.max_borrowed > 0 ? std::min(b, o.max_borrowed) : b;
}

int64_t LlepMaxLent(const ModelConfig& m, int64_t ranks, int64_t routes, const LlepOptions& o) {
  const int64_t Ep = m.experts / ranks;
  const int64_t l = std::min(Ep * (ranks - 1), routes / o.min_piece);
  return o.max_borrowed > 0 ? std::min(l, std::min(Ep, o.max_borrowed) * (ranks - 1)) : l;
}

LlepChunkSizes LlepWorstCaseSizes(const ModelConfig& m, int64_t ranks, int64_t tokens_per_rank,
                                  const LlepOptions& o) {
  LlepChunkSizes s;
  s.tokens = tokens_per_rank;
  s.routes = tokens_per_rank * m.top_k;
  s.rows = ranks * s.routes;
  s.borrowed = LlepMaxBorrowed(m, ranks, s.rows, o);
  s.lent = LlepMaxLent(m, ranks, s.rows, o);
  return s;
}

int64_t LlepWorstCasePeakBytes(const ModelConfig& m, int64_t ranks, int64_t tokens_per_rank,
                               const LlepOptions& o, const ElementBytes& e) {
  return LlepPeakBytes(m, ranks, LlepWorstCaseSizes(m, ranks, tokens_per_rank, o), e);
}

LlepChunkSizes PipelinedLlepSlotSizes(const ModelConfig& m, int64_t ranks, int64_t max_tokens,
                                      const PipelinedLlepOptions& o) {
  const int64_t c_eff = std::max<int64_t>(0, std::min(o.chunk_tokens, max_tokens));
  LlepChunkSizes s;
  s.tokens = c_eff;
  s.routes = c_eff * m.top_k;
  s.rows = ranks * s.routes;
  s.borrowed = LlepMaxBorrowed(m, ranks, s.rows, o.balance);
  s.lent = LlepMaxLent(m, ranks, s.rows, o.balance);
  // Strided chunks are scattered token rows, gathered through the token
  // view, except a layer's only chunk: every token in order, which
  // PlanLlepRank sees as contiguous (first_token 0) and runs in place. A
  // layer of fewer tokens than planned has no more chunks than planned.
  s.token_view = o.membership == ChunkMembership::kStrided && PipelinedLlepChunks(max_tokens, o.chunk_tokens) > 1;
  return s;
}

int64_t PipelinedLlepCountWords(const ModelConfig& m, int64_t ranks, int64_t max_tokens,
                                const PipelinedLlepOptions& o) {
  const int64_t chunks = PipelinedLlepChunks(max_tokens, o.chunk_tokens);
  return 1 + (1 + ranks) * chunks * m.experts;
}

std::vector<DispatchBufferSpec> PipelinedLlepBuffers(const ModelConfig& m, int64_t ranks,
                                                     int64_t max_tokens,
                                                     const PipelinedLlepOptions& o,
                                                     const ElementBytes& e) {
  std::vector<DispatchBufferSpec> b = {
      {"counts", PipelinedLlepCountWords(m, ranks, max_tokens, o) * kI64}};
  for (const DispatchBufferSpec& c :
       LlepChunkBuffers(m, PipelinedLlepSlotSizes(m, ranks, max_tokens, o), e)) {
    b.push_back(c);
  }
  if (PipelinedLlepAccumulatesInFp32(max_tokens, o, e)) {
    const int64_t HF = m.hidden * m.expert_ffn;
    b.push_back({"grad_accum", (3 * (m.experts / std::max<int64_t>(1, ranks)) + 1) * HF * e.accum});
  }
  return b;
}

bool PipelinedLlepAccumulatesInFp32(int64_t max_tokens, const PipelinedLlepOptions& o, const ElementBytes& e) {
  return e.working != e.accum && PipelinedLlepChunks(max_tokens, o.chunk_tokens) > 1;
}

int64_t PipelinedLlepBoundBytes(const ModelConfig& m, int64_t ranks, int64_t max_tokens,
                                const PipelinedLlepOptions& o, const ElementBytes& e) {
  return DispatchBufferBytes(PipelinedLlepBuffers(m, ranks, max_tokens, o, e));
}

int64_t PipelinedLlepHostIndexWords(const ModelConfig& m, int64_t ranks, int64_t max_tokens,
                                    const PipelinedLlepOptions& o) {
  return PipelinedLlepChunks(max_tokens, o.chunk_tokens) *
         LlepIndexLayoutOf(PipelinedLlepSlotSizes(m, ranks, max_tokens, o)).total;
}

int64_t PipelinedLlepKeptCountWords(const ModelConfig& m, int64_t ranks, int64_t max_tokens,
                                    const PipelinedLlepOptions& o) {
  // A Forward gathers at most K_max chunks' counts (one in the one-chunk
  // path, where K_max = 1).
  const int64_t chunks = PipelinedLlepChunks(max_tokens, o.chunk_tokens);
  return std::max<int64_t>(0, m.layers) * (1 + ranks * chunks * m.experts);
}

int64_t PipelinedLlepPlanningBytes(const ModelConfig& m, int64_t ranks, int64_t max_tokens,
                                   const PipelinedLlepOptions& o) {
  const int64_t chunks = PipelinedLlepChunks(max_tokens, o.chunk_tokens), E = m.experts;
  const int64_t counts = (ranks + 1) * chunks * E + ranks * E + E;  // all, mine, a chunk's, loads
  return counts * kI64 + std::max<int64_t>(0, max_tokens) * m.top_k * kI32;
}

int64_t PipelinedLlepHostBytes(const ModelConfig& m, int64_t ranks, int64_t max_tokens,
                               const PipelinedLlepOptions& o) {
  return (PipelinedLlepHostIndexWords(m, ranks, max_tokens, o) + PipelinedLlepKeptCountWords(m, ranks, max_tokens, o)) *
             kI32 +
         PipelinedLlepPlanningBytes(m, ranks, max_tokens, o);
}

}  // namespace plateau
