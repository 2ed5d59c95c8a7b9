#include "kernels/dispatch/standard_ep_plan.h"

#include <algorithm>

namespace plateau {

int64_t StandardEpWorstCaseReceivedRows(const ModelConfig& model, int64_t ranks,
                                        int64_t tokens_per_rank) {
  return ranks * tokens_per_rank * std::min<int64_t>(model.top_k, model.experts / ranks);
}

int64_t StandardEpPeakBytes(const ModelConfig& model, int64_t sent_routes, int64_t received_rows,
                            const ElementBytes& e) {
  const int64_t S = sent_routes, R = received_rows, H = model.hidden, F = model.expert_ffn;
  const int64_t f = e.working, g = e.accum, i32 = sizeof(int32_t);
  // Kept from Plan to Backward: send_index_, route_pos_, route_at_pos_ [S],
  // perm_, inv_perm_ [R], gates_sent_ [S].
  const int64_t kept = 3 * S * i32 + 2 * R * i32 + S * g;
  // Plan: the per-expert counts exchanged (sent and received, [P * E/P] =
  // [E] each whatever P is) while the index vectors are made.
  const int64_t plan = 2 * model.experts * static_cast<int64_t>(sizeof(int64_t)) + kept - S * g;
  // Forward, at the return exchange: recv, x_, yback [R, H]; g_, u_, a_
  // [R, F]; returned_ [S, H] (the send buffer [S, H] was freed before x_).
  const int64_t forward = kept + (3 * R * H + 3 * R * F + S * H) * f;
  // Backward: x_, drecv, dy [R, H]; g_, u_, a_, da, dg, dup [R, F];
  // returned_, dsend [S, H].
  const int64_t backward = kept + (3 * R * H + 6 * R * F + 2 * S * H) * f;
  return std::max({plan, forward, backward});
}

}  // namespace plateau
