#include "kernels/dispatch/standard_ep.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/model/working_ops.h"
#include "kernels/status_macros.h"

namespace plateau {
StandardEp::StandardEp(const ModelConfig& model, Backend& backend, ModelKernels& kernels,
                       Communicator& experts, Stream& compute, Stream& comm)
    : model_(model),
      backend_(backend),
      kernels_(kernels),
      comm_(experts),
      compute_(compute),
      comm_stream_(comm),
      local_experts_(model.experts / experts.size()) {}

template <typename T>
absl::StatusOr<Buffer> StandardEp::Alloc(int64_t count) {
  return backend_.device().Allocate(LiveSet::kDispatch, count * static_cast<int64_t>(sizeof(T)));
}

absl::StatusOr<Buffer> StandardEp::AllocIndex(const std::vector<int32_t>& host) {
  PLATEAU_ASSIGN_OR_RETURN(Buffer b, backend_.device().Allocate(
                                         LiveSet::kDispatch, host.size() * sizeof(int32_t)));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(compute_, b.data(), host.data(), b.bytes()));
  return b;
}

void StandardEp::Release() {
  for (Buffer* b : {&send_index_, &route_pos_, &route_at_pos_, &perm_, &inv_perm_, &gates_sent_, &x_, &g_,
                    &u_, &a_, &returned_}) {
    b->Release();
  }
}

// Reads the routes on the host and lays out both all-to-alls. Ends with the
// index vectors on the device; synchronises the compute stream once (the
// all-to-all-v sizes must be known on the host, as NCCL and Gloo need them).
absl::Status StandardEp::Plan(const int32_t* chosen, int64_t tokens) {
  const int64_t P = comm_.size(), K = model_.top_k, Ep = local_experts_, routes = tokens * K;
  tokens_ = tokens;
  std::vector<int32_t> host_chosen(routes);
  // Into host memory: done when Copy returns (backend.h).
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(compute_, host_chosen.data(), chosen,
                                        routes * sizeof(int32_t)));

  // Counting sort of the routes by (destination, local expert); within a
  // bucket, token then choice order.
  std::vector<int64_t> bucket_count(P * Ep, 0);
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t e = host_chosen[r];
    if (e < 0 || e >= model_.experts) {
      return absl::InternalError(absl::StrCat("router chose expert ", e, " of ", model_.experts));
    }
    ++bucket_count[e];  // e = dest * Ep + local expert
  }
  std::vector<int64_t> bucket_start(P * Ep + 1, 0);
  for (int64_t b = 0; b < P * Ep; ++b) bucket_start[b + 1] = bucket_start[b] + bucket_count[b];
  std::vector<int32_t> send_index(routes), route_pos(routes), route_at_pos(routes);
  std::vector<int64_t> fill(bucket_start.begin(), bucket_start.end() - 1);
  for (int64_t r = 0; r < routes; ++r) {
    const int64_t pos = fill[host_chosen[r]]++;
    send_index[pos] = static_cast<int32_t>(r / K);
    route_pos[r] = static_cast<int32_t>(pos);
    route_at_pos[pos] = static_cast<int32_t>(r);
  }
  send_counts_.assign(P, 0);
  for (int64_t d = 0; d < P; ++d) {
    for (int64_t le = 0; le < Ep; ++le) send_counts_[d] += bucket_count[d * Ep + le];
  }

  // Each destination learns how many rows per local expert it receives.
  PLATEAU_ASSIGN_OR_RETURN(Buffer counts, backend_.device().Allocate(
                                              LiveSet::kDispatch, 2 * P * Ep * sizeof(int64_t)));
  int64_t* send_c = counts.as<int64_t>();
  int64_t* recv_c = send_c + P * Ep;
  std::vector<int64_t> host_recv(P * Ep);
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(comm_stream_, send_c, bucket_count.data(),
                                        P * Ep * sizeof(int64_t)));
  std::vector<int64_t> per_peer(P, Ep);
  PLATEAU_RETURN_IF_ERROR(
      comm_.AllToAllV(comm_stream_, send_c, per_peer, recv_c, per_peer, DataType::kInt64));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(comm_stream_, host_recv.data(), recv_c,
                                        P * Ep * sizeof(int64_t)));

  // Received rows arrive source-major; the experts want them expert-major.
  recv_counts_.assign(P, 0);
  std::vector<int64_t> recv_start(P + 1, 0);
  for (int64_t s = 0; s < P; ++s) {
    for (int64_t le = 0; le < Ep; ++le) recv_counts_[s] += host_recv[s * Ep + le];
    recv_start[s + 1] = recv_start[s] + recv_counts_[s];
  }
  recv_rows_ = recv_start[P];
  expert_rows_.assign(Ep, 0);
  std::vector<int32_t> perm, inv_perm(recv_rows_);
  perm.reserve(recv_rows_);
  for (int64_t le = 0; le < Ep; ++le) {
    for (int64_t s = 0; s < P; ++s) {
      int64_t off = recv_start[s];
      for (int64_t x = 0; x < le; ++x) off += host_recv[s * Ep + x];
      for (int64_t i = 0; i < host_recv[s * Ep + le]; ++i) {
        inv_perm[off + i] = static_cast<int32_t>(perm.size());
        perm.push_back(static_cast<int32_t>(off + i));
      }
      expert_rows_[le] += host_recv[s * Ep + le];
    }
  }
  PLATEAU_ASSIGN_OR_RETURN(send_index_, AllocIndex(send_index));
  PLATEAU_ASSIGN_OR_RETURN(route_pos_, AllocIndex(route_pos));
  PLATEAU_ASSIGN_OR_RETURN(route_at_pos_, AllocIndex(route_at_pos));
  PLATEAU_ASSIGN_OR_RETURN(perm_, AllocIndex(perm));
  PLATEAU_ASSIGN_OR_RETURN(inv_perm_, AllocIndex(inv_perm));
  return absl::OkStatus();  // AllocIndex's copies from the host vectors are done
}

// Rows of H elements: forward sends by send_counts_ and receives by
// recv_counts_; the reverse direction swaps them. Ordered after the compute
// stream's work so far; compute waits for it to land.
template <typename W>
absl::Status StandardEp::Exchange(const W* send, W* recv, bool forward) {
  const int64_t H = model_.hidden;
  std::vector<int64_t> sc(send_counts_.size()), rc(recv_counts_.size());
  for (size_t i = 0; i < sc.size(); ++i) {
    sc[i] = (forward ? send_counts_[i] : recv_counts_[i]) * H;
    rc[i] = (forward ? recv_counts_[i] : send_counts_[i]) * H;
  }
  // The events outlive every call: queued work refers to them.
  if (ready_ == nullptr) {
    PLATEAU_ASSIGN_OR_RETURN(ready_, backend_.CreateEvent());
    PLATEAU_ASSIGN_OR_RETURN(landed_, backend_.CreateEvent());
  }
  PLATEAU_RETURN_IF_ERROR(compute_.Record(*ready_));
  PLATEAU_RETURN_IF_ERROR(comm_stream_.Wait(*ready_));
  PLATEAU_RETURN_IF_ERROR(comm_.AllToAllV(comm_stream_, send, sc, recv, rc, kWorkingDataType<W>));
  PLATEAU_RETURN_IF_ERROR(comm_stream_.Record(*landed_));
  PLATEAU_RETURN_IF_ERROR(compute_.Wait(*landed_));
  return absl::OkStatus();
}

template <typename W>
std::vector<ExpertGroupT<W>> StandardEp::Groups(const ExpertWeightsT<W>& w,
                                                const ExpertGradsT<W>* grads) const {
  const int64_t mat = model_.hidden * model_.expert_ffn;
  std::vector<ExpertGroupT<W>> out;
  for (int64_t le = 0; le < local_experts_; ++le) {
    if (expert_rows_[le] == 0) continue;
    ExpertGroupT<W> e;
    e.rows = expert_rows_[le];
    e.w_gate = w.w_gate + le * mat;
    e.w_up = w.w_up + le * mat;
    e.w_down = w.w_down + le * mat;
    if (grads != nullptr) {
      e.dw_gate = grads->w_gate + le * mat;
      e.dw_up = grads->w_up + le * mat;
      e.dw_down = grads->w_down + le * mat;
    }
    out.push_back(e);
  }
  return out;
}

template <typename W>
absl::Status StandardEp::ForwardT(const W* u, const int32_t* chosen, const float* gates,
                                  int64_t tokens, const ExpertWeightsT<W>& w, W* out) {
  using Ops = WorkingOps<W>;
  Release();
  const int64_t H = model_.hidden, F = model_.expert_ffn, K = model_.top_k;
  const int64_t routes = tokens * K;
  PLATEAU_RETURN_IF_ERROR(Plan(chosen, tokens));
  const int64_t R = recv_rows_;

  // Gates in send order (fp32 in either precision), for the backward's
  // scaled rows.
  PLATEAU_ASSIGN_OR_RETURN(gates_sent_, Alloc<float>(routes));
  PLATEAU_RETURN_IF_ERROR(kernels_.GatherRows(compute_, gates, routes,
                                              route_at_pos_.as<int32_t>(), nullptr, routes, 1,
                                              gates_sent_.as<float>()));

  PLATEAU_ASSIGN_OR_RETURN(Buffer recv, Alloc<W>(R * H));
  {
    PLATEAU_ASSIGN_OR_RETURN(Buffer send, Alloc<W>(routes * H));
    PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, u, tokens, send_index_.as<int32_t>(),
                                                nullptr, routes, H, send.as<W>()));
    PLATEAU_RETURN_IF_ERROR(Exchange(send.as<W>(), recv.as<W>(), /*forward=*/true));
  }  // `send` goes back once the exchange has read it (memory.h)
  PLATEAU_ASSIGN_OR_RETURN(x_, Alloc<W>(R * H));
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, recv.as<W>(), R, perm_.as<int32_t>(),
                                              nullptr, R, H, x_.as<W>()));
  PLATEAU_ASSIGN_OR_RETURN(g_, Alloc<W>(R * F));
  PLATEAU_ASSIGN_OR_RETURN(u_, Alloc<W>(R * F));
  PLATEAU_ASSIGN_OR_RETURN(a_, Alloc<W>(R * F));
  // The experts' outputs reuse the receive buffer (expert-major order).
  W* y = recv.as<W>();
  PLATEAU_RETURN_IF_ERROR(ExpertMlpForward(backend_, compute_, H, F, Groups<W>(w, nullptr), x_.as<W>(),
                                           g_.as<W>(), u_.as<W>(), a_.as<W>(), y));
  // Back to source-major order, back to the senders, combined with the gates.
  PLATEAU_ASSIGN_OR_RETURN(Buffer yback, Alloc<W>(R * H));
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, y, R, inv_perm_.as<int32_t>(), nullptr, R,
                                              H, yback.as<W>()));
  PLATEAU_ASSIGN_OR_RETURN(returned_, Alloc<W>(routes * H));
  PLATEAU_RETURN_IF_ERROR(Exchange(yback.as<W>(), returned_.as<W>(), /*forward=*/false));
  PLATEAU_RETURN_IF_ERROR(Ops::CombineRows(kernels_, compute_, returned_.as<W>(), routes,
                                           route_pos_.as<int32_t>(), gates, tokens, K, H, out));
  // recv and yback go back once the queued work is done with them (memory.h).
  return absl::OkStatus();
}

template <typename W>
absl::Status StandardEp::BackwardT(const W* dout, const ExpertWeightsT<W>& w, W* du,
                                   float* dgates, const ExpertGradsT<W>& grads) {
  using Ops = WorkingOps<W>;
  // x_ is held (zero bytes on a rank sent no rows) from Forward to Backward.
  if (x_.empty()) {
    return absl::FailedPreconditionError("StandardEp::Backward needs the layer's Forward first");
  }
  const int64_t H = model_.hidden, F = model_.expert_ffn, K = model_.top_k;
  const int64_t tokens = tokens_, routes = tokens * K, R = recv_rows_;
  // d gate_{t,j} = <dout[t], y_{t,j}>.
  PLATEAU_RETURN_IF_ERROR(Ops::RowDots(kernels_, compute_, dout, returned_.as<W>(), routes,
                                       route_pos_.as<int32_t>(), tokens, K, H, dgates));
  // d y_{t,j} = gate_{t,j} dout[t], in send order, to the experts.
  PLATEAU_ASSIGN_OR_RETURN(Buffer dsend, Alloc<W>(routes * H));
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, dout, tokens, send_index_.as<int32_t>(),
                                              gates_sent_.as<float>(), routes, H,
                                              dsend.as<W>()));
  PLATEAU_ASSIGN_OR_RETURN(Buffer drecv, Alloc<W>(R * H));
  PLATEAU_RETURN_IF_ERROR(Exchange(dsend.as<W>(), drecv.as<W>(), /*forward=*/true));
  PLATEAU_ASSIGN_OR_RETURN(Buffer dy, Alloc<W>(R * H));
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, drecv.as<W>(), R, perm_.as<int32_t>(),
                                              nullptr, R, H, dy.as<W>()));
  PLATEAU_ASSIGN_OR_RETURN(Buffer da, Alloc<W>(R * F));
  PLATEAU_ASSIGN_OR_RETURN(Buffer dg, Alloc<W>(R * F));
  PLATEAU_ASSIGN_OR_RETURN(Buffer dup, Alloc<W>(R * F));
  W* dx = drecv.as<W>();  // reused: d inputs, expert-major
  PLATEAU_RETURN_IF_ERROR(ExpertMlpBackward(backend_, compute_, H, F, Groups<W>(w, &grads),
                                            x_.as<W>(), dy.as<W>(), g_.as<W>(),
                                            u_.as<W>(), a_.as<W>(), da.as<W>(),
                                            dg.as<W>(), dup.as<W>(), dx));
  // Source-major, back to the senders, summed per token in choice order.
  PLATEAU_RETURN_IF_ERROR(Ops::GatherRows(kernels_, compute_, dx, R, inv_perm_.as<int32_t>(), nullptr,
                                              R, H, dy.as<W>()));
  PLATEAU_RETURN_IF_ERROR(Exchange(dy.as<W>(), dsend.as<W>(), /*forward=*/false));
  PLATEAU_RETURN_IF_ERROR(Ops::CombineRows(kernels_, compute_, dsend.as<W>(), routes,
                                           route_pos_.as<int32_t>(), nullptr, tokens, K, H, du));
  Release();  // each buffer goes back once the queued work is done with it (memory.h)
  return absl::OkStatus();
}

absl::Status StandardEp::Forward(const float* u, const int32_t* chosen, const float* gates,
                                 int64_t tokens, const ExpertWeights& w, float* out) {
  return ForwardT<float>(u, chosen, gates, tokens, w, out);
}

absl::Status StandardEp::Forward(const Bf16* u, const int32_t* chosen, const float* gates,
                                 int64_t tokens, const ExpertWeightsT<Bf16>& w, Bf16* out) {
  return ForwardT<Bf16>(u, chosen, gates, tokens, w, out);
}

absl::Status StandardEp::Backward(const float* dout, const ExpertWeights& w, float* du,
                                  float* dgates, const ExpertGrads& grads) {
  return BackwardT<float>(dout, w, du, dgates, grads);
}

absl::Status StandardEp::Backward(const Bf16* dout, const ExpertWeightsT<Bf16>& w, Bf16* du,
                                  float* dgates, const ExpertGradsT<Bf16>& grads) {
  return BackwardT<Bf16>(dout, w, du, dgates, grads);
}

}  // namespace plateau
