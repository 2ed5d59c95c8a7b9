#include "kernels/projection/ring_dtp.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/model/working_ops.h"
#include "kernels/status_macros.h"

namespace plateau {
namespace {

constexpr int64_t kF = sizeof(float);

// The packed traveller's words (PackedCount): moved, never combined.
template <typename W>
constexpr DataType kPackedWire = std::is_same_v<W, float> ? DataType::kInt32 : DataType::kBfloat16;

}  // namespace

struct RingDtp::Buffers {
  Buffer strip;
  Buffer slots[3];
  Buffer state[2];
  Buffer lse_own;
  Buffer home;  // bf16: the home dW (activation mode) or dX (weight mode), fp32
  std::unique_ptr<Event> ev_compute, ev_comm;
};

RingDtp::RingDtp(const RingDtpConfig& config, Backend& backend, ModelKernels& kernels,
                 Communicator& group, Stream& compute, Stream& comm)
    : config_(config),
      backend_(backend),
      kernels_(kernels),
      group_(group),
      compute_(compute),
      comm_(comm),
      buf_(std::make_unique<Buffers>()) {}

int64_t RingDtp::FirstWeightRow() const {
  return VocabShardBegin(config_.vocab, group_.size(), group_.rank());
}

RingDtp::~RingDtp() {
  compute_.Synchronize().IgnoreError();
  comm_.Synchronize().IgnoreError();
}

absl::StatusOr<std::unique_ptr<RingDtp>> RingDtp::Create(const RingDtpConfig& c, Backend& backend,
                                                         ModelKernels& kernels,
                                                         Communicator& group, Stream& compute,
                                                         Stream& comm, const ElementBytes& e) {
  auto bad = [](absl::string_view field, absl::string_view expected, int64_t got) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got));
  };
  if (c.rows < 1) return bad("ring_dtp.rows", ">= 1", c.rows);
  if (c.hidden < 1) return bad("ring_dtp.hidden", ">= 1", c.hidden);
  if (c.vocab < 2) return bad("ring_dtp.vocab", ">= 2", c.vocab);
  if (c.vocab < group.size()) {
    return bad("ring_dtp.vocab", absl::StrCat(">= the ", group.size(), " ranks (one shard each)"),
               c.vocab);
  }
  if (c.strip < 1) return bad("ring_dtp.strip", ">= 1 vocabulary columns", c.strip);
  if (c.row_tile < 1) return bad("ring_dtp.row_tile", ">= 1 token rows", c.row_tile);
  if (c.chunk_rows < 0) return bad("ring_dtp.chunk_rows", ">= 0 (0: one pass)", c.chunk_rows);
  if (c.mode != RingDtpMode::kActivations && c.mode != RingDtpMode::kWeights) {
    return absl::InvalidArgumentError("ring_dtp.mode: expected activations or weights");
  }
  if (c.mode == RingDtpMode::kActivations && e.working == 2 && c.hidden % 2 != 0) {
    // The packed traveller's targets follow N H bf16 values: 4-byte aligned only for an even H.
    return bad("ring_dtp.hidden", "an even size under bf16 in activation mode", c.hidden);
  }
  std::unique_ptr<RingDtp> r(new RingDtp(c, backend, kernels, group, compute, comm));
  r->working_bytes_ = e.working;
  PLATEAU_RETURN_IF_ERROR(r->Allocate());
  return r;
}

absl::Status RingDtp::Allocate() {
  const int64_t N = config_.rows, R = PassRows(), P = group_.size();
  MemorySpace& dev = backend_.device();
  auto floats = [&](int64_t n) { return dev.Allocate(LiveSet::kProjection, n * kF); };
  // The strip tile and the travellers in the working precision.
  auto working = [&](int64_t n) { return dev.Allocate(LiveSet::kProjection, n * working_bytes_); };
  Buffers& b = *buf_;
  PLATEAU_ASSIGN_OR_RETURN(b.strip, working(RingDtpStripTileElements(config_, P)));
  // A slot: W (working) or dW (fp32), or activation mode's packed batch, X
  // (working) with R int32 targets and R fp32 lse, or its dX (fp32).
  const ElementBytes e = working_bytes_ == 4 ? kFp32Elements : kBf16MixedElements;
  const int64_t slot_bytes = RingDtpSlotBytes(config_, P, e);
  for (Buffer& s : b.slots) {
    PLATEAU_ASSIGN_OR_RETURN(s, dev.Allocate(LiveSet::kProjection, slot_bytes));
  }
  for (Buffer& s : b.state) {
    PLATEAU_ASSIGN_OR_RETURN(s, floats(3 * R));
  }
  PLATEAU_ASSIGN_OR_RETURN(b.lse_own, floats(N));
  if (const int64_t home = RingDtpHomeElements(config_, P, e); home > 0) {
    PLATEAU_ASSIGN_OR_RETURN(b.home, floats(home));
  }
  PLATEAU_ASSIGN_OR_RETURN(b.ev_compute, backend_.CreateEvent());
  PLATEAU_ASSIGN_OR_RETURN(b.ev_comm, backend_.CreateEvent());
  return absl::OkStatus();
}

int64_t RingDtp::PassRows() const { return RingDtpPassRows(config_); }

int64_t RingDtp::ShardRows(int64_t shard) const {
  const int64_t P = group_.size();
  return VocabShardBegin(config_.vocab, P, shard + 1) - VocabShardBegin(config_.vocab, P, shard);
}

// Activation mode's traveller, one message per hop: the batch's X [N, H]
// (the working type), then its targets (N int32), then (backward only) its
// log-sum-exp (N floats). One send/recv instead of two (forward) or three
// (backward): at small N a hop costs its round trip, not its bytes. The
// message moves unchanged as 4-byte words (kInt32) in fp32, as 2-byte words
// (kBfloat16: a send/recv only moves) in bf16; there the targets start
// N H 2 bytes in, 4-byte aligned because H is even (checked at Create).
template <typename W>
int32_t* RingDtp::PackedTargets(W* slot, int64_t N) const {
  return reinterpret_cast<int32_t*>(slot + N * config_.hidden);
}

template <typename W>
float* RingDtp::PackedLse(W* slot, int64_t N) const {
  return reinterpret_cast<float*>(PackedTargets(slot, N) + N);
}

template <typename W>
int64_t RingDtp::PackedCount(int64_t N, bool with_lse) const {
  const int64_t bytes = N * config_.hidden * static_cast<int64_t>(sizeof(W)) + (with_lse ? 2 : 1) * N * 4;
  return bytes / static_cast<int64_t>(sizeof(W));
}

// This rank's own batch (its X and targets, and with `lse` its log-sum-exp)
// copied into `slot`, to leave on its first hop in one message. On the
// communication stream, after a CommAfterCompute (X, targets and lse are
// ready, and nothing on the compute stream still reads the slot): the copy
// runs beside the first meeting's GEMMs instead of before them, and the
// in-order comm stream sends the slot only after it is filled.
template <typename W>
absl::Status RingDtp::PackOwnBatch(const W* x, const int32_t* targets, const float* lse, int64_t N, W* slot) {
  const int64_t H = config_.hidden;
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(comm_, slot, x, N * H * sizeof(W)));
  PLATEAU_RETURN_IF_ERROR(backend_.Copy(comm_, PackedTargets(slot, N), targets, N * sizeof(int32_t)));
  if (lse != nullptr) {
    PLATEAU_RETURN_IF_ERROR(backend_.Copy(comm_, PackedLse(slot, N), lse, N * kF));
  }
  return absl::OkStatus();
}

absl::Status RingDtp::CommAfterCompute() { return OrderAfter(comm_, compute_, *buf_->ev_compute); }

absl::Status RingDtp::ComputeAfterComm() { return OrderAfter(compute_, comm_, *buf_->ev_comm); }

// One (batch, shard) meeting, strip by strip, each strip in row tiles: the
// fixed order (strips ascending, then row tiles) is the fold order.
template <typename W>
absl::Status RingDtp::FoldMeeting(const W* x, int64_t N, const W* w, int64_t width,
                                  int64_t col0, const int32_t* targets, float* state) {
  using Ops = WorkingOps<W>;
  const int64_t H = config_.hidden;
  W* L = buf_->strip.as<W>();
  for (int64_t j0 = 0; j0 < width; j0 += config_.strip) {
    const int64_t sw = std::min(config_.strip, width - j0);
    for (int64_t i0 = 0; i0 < N; i0 += config_.row_tile) {
      const int64_t rows = std::min(config_.row_tile, N - i0);
      PLATEAU_RETURN_IF_ERROR(Ops::Gemm(
          backend_, compute_, {false, true, rows, sw, H, 1.0f, x + i0 * H, H, w + j0 * H, H, 0.0f, L, sw}));
      PLATEAU_RETURN_IF_ERROR(Ops::StripFold(kernels_, compute_, L, rows, sw, col0 + j0, targets + i0,
                                             state + i0, N));
    }
  }
  return absl::OkStatus();
}

template <typename W>
absl::Status RingDtp::DeltaMeeting(const W* x, int64_t N, const W* w, int64_t width, int64_t col0,
                                   const int32_t* targets, const float* lse, float scale, float* dx, float* dw) {
  using Ops = WorkingOps<W>;
  const int64_t H = config_.hidden;
  W* L = buf_->strip.as<W>();
  for (int64_t j0 = 0; j0 < width; j0 += config_.strip) {
    const int64_t sw = std::min(config_.strip, width - j0);
    const W* ws = w + j0 * H;
    for (int64_t i0 = 0; i0 < N; i0 += config_.row_tile) {
      const int64_t rows = std::min(config_.row_tile, N - i0);
      const W* xt = x + i0 * H;
      PLATEAU_RETURN_IF_ERROR(
          Ops::Gemm(backend_, compute_, {false, true, rows, sw, H, 1.0f, xt, H, ws, H, 0.0f, L, sw}));
      PLATEAU_RETURN_IF_ERROR(Ops::StripDelta(kernels_, compute_, L, rows, sw, col0 + j0, targets + i0,
                                              lse + i0, scale));
      // dX += delta W_strip; dW_strip += delta^T X, both into fp32
      // accumulators (bf16: the tile's products in fp32, added in fp32).
      PLATEAU_RETURN_IF_ERROR(
          Ops::GemmAccum(backend_, compute_, {false, false, rows, H, sw, 1.0f, L, sw, ws, H, 1.0f, dx + i0 * H, H}));
      PLATEAU_RETURN_IF_ERROR(
          Ops::GemmAccum(backend_, compute_, {true, false, sw, H, rows, 1.0f, L, sw, xt, H, 1.0f, dw + j0 * H, H}));
    }
  }
  return absl::OkStatus();
}

template <typename W>
absl::Status RingDtp::ForwardT(const W* x, const W* w_shard, const int32_t* targets, double* stats) {
  PLATEAU_RETURN_IF_ERROR(CheckElement(sizeof(W)));
  const int64_t N = config_.rows, R = PassRows(), H = config_.hidden;
  for (int64_t i0 = 0; i0 < N; i0 += R) {
    PLATEAU_RETURN_IF_ERROR(ForwardPass(x + i0 * H, w_shard, targets + i0, std::min(R, N - i0),
                                        buf_->lse_own.as<float>() + i0, stats));
  }
  return absl::OkStatus();
}

template <typename W>
absl::Status RingDtp::BackwardT(const W* x, const W* w_shard, const int32_t* targets, float scale, W* dx,
                                W* dw_shard) {
  PLATEAU_RETURN_IF_ERROR(CheckElement(sizeof(W)));
  const int64_t N = config_.rows, R = PassRows(), H = config_.hidden;
  // Activation mode sums the shard's dW over every meeting of every pass at
  // home: in fp32 in dw_shard itself, under bf16 in the fp32 home buffer
  // (loaded from dw_shard exactly, rounded back once at the end).
  const bool act = config_.mode == RingDtpMode::kActivations;
  const int64_t shard = ShardRows(group_.rank()) * H;
  float* dw_home = nullptr;
  if constexpr (std::is_same_v<W, float>) {
    dw_home = dw_shard;
  } else if (act) {
    dw_home = buf_->home.as<float>();
    PLATEAU_RETURN_IF_ERROR(backend_.ConvertToFloat(compute_, dw_home, dw_shard, shard));
  }
  for (int64_t i0 = 0; i0 < N; i0 += R) {
    PLATEAU_RETURN_IF_ERROR(BackwardPass(x + i0 * H, w_shard, targets + i0, buf_->lse_own.as<float>() + i0,
                                         std::min(R, N - i0), scale, dx + i0 * H, dw_shard, dw_home));
  }
  if constexpr (!std::is_same_v<W, float>) {
    if (act) PLATEAU_RETURN_IF_ERROR(backend_.ConvertToBf16(compute_, dw_shard, dw_home, shard));
  }
  return compute_.Synchronize();
}

template <typename W>
absl::Status RingDtp::ForwardPass(const W* x, const W* w_shard, const int32_t* targets,
                                  int64_t N, float* lse, double* stats) {
  const int64_t H = config_.hidden, V = config_.vocab;
  const int P = group_.size(), p = group_.rank();
  const int dst = (p + 1) % P, src = (p - 1 + P) % P;
  Buffers& b = *buf_;
  float* own_state = b.state[0].as<float>();
  PLATEAU_RETURN_IF_ERROR(kernels_.StripInit(compute_, own_state, N));

  if (config_.mode == RingDtpMode::kWeights) {
    // Shards travel; this batch's state stays home.
    const W* w = w_shard;
    for (int r = 0; r < P; ++r) {
      const int64_t s = (p - r + P) % P;
      W* next = b.slots[r % 2].as<W>();
      if (r + 1 < P) {
        PLATEAU_RETURN_IF_ERROR(CommAfterCompute());  // `next` was read at step r-1
        PLATEAU_RETURN_IF_ERROR(group_.SendRecv(comm_, w, ShardRows(s) * H, dst, next,
                                                ShardRows((s - 1 + P) % P) * H, src,
                                                kWorkingDataType<W>));
      }
      PLATEAU_RETURN_IF_ERROR(
          FoldMeeting(x, N, w, ShardRows(s), VocabShardBegin(V, P, s), targets, own_state));
      if (r + 1 < P) {
        PLATEAU_RETURN_IF_ERROR(ComputeAfterComm());
        w = next;
      }
    }
  } else {
    // Batches travel with their state; this rank's shard stays home. The
    // batch hops as one message [X | targets] (PackedTargets); this rank's
    // own leaves from slots[2], which the forward does not otherwise use.
    const int64_t col0 = VocabShardBegin(V, P, p), width = ShardRows(p);
    const int64_t words = PackedCount<W>(N, /*with_lse=*/false);
    const W* xq = x;
    const int32_t* tq = targets;
    const W* packed = b.slots[2].as<W>();
    float* state = own_state;
    for (int r = 0; r < P; ++r) {
      W* x_next = b.slots[r % 2].as<W>();
      if (r + 1 < P) {
        PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
        if (r == 0) PLATEAU_RETURN_IF_ERROR(PackOwnBatch(x, targets, nullptr, N, b.slots[2].as<W>()));
        PLATEAU_RETURN_IF_ERROR(
            group_.SendRecv(comm_, packed, words, dst, x_next, words, src, kPackedWire<W>));
      }
      PLATEAU_RETURN_IF_ERROR(FoldMeeting(xq, N, w_shard, width, col0, tq, state));
      if (P > 1) {
        // The state is final for this step: it hops on (after the last step,
        // home to its batch's rank).
        float* state_next = b.state[(r + 1) % 2].as<float>();
        PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
        PLATEAU_RETURN_IF_ERROR(
            group_.SendRecv(comm_, state, 3 * N, dst, state_next, 3 * N, src, DataType::kFloat32));
        PLATEAU_RETURN_IF_ERROR(ComputeAfterComm());
        state = state_next;
        xq = x_next;
        tq = PackedTargets(x_next, N);
        packed = x_next;
      }
    }
    own_state = state;
  }
  return kernels_.StripFinish(compute_, own_state, targets, N, lse, stats);
}

// The gradients accumulate in fp32 whatever the working type: the
// travelling dX or dW in a slot (hopping as kFloat32), the home dW
// (activation mode: dw_home) or dX (weight mode: dx itself in fp32, the
// home buffer under bf16). Under bf16 each is rounded once, when final:
// rounded at every strip tile's GEMM and every hop, a sum of hundreds of
// similar terms stalls in bf16 (its 8 bits: adding 1.0 1,024 times gives
// 256).
template <typename W>
absl::Status RingDtp::BackwardPass(const W* x, const W* w_shard, const int32_t* targets, const float* lse_own,
                                   int64_t N, float scale, W* dx, W* dw_shard, float* dw_home) {
  constexpr bool kFp32 = std::is_same_v<W, float>;
  const int64_t H = config_.hidden, V = config_.vocab;
  const int P = group_.size(), p = group_.rank();
  const int dst = (p + 1) % P, src = (p - 1 + P) % P;
  Buffers& b = *buf_;
  const bool weights = config_.mode == RingDtpMode::kWeights;
  // Weight mode's home dX.
  float* dx_home = nullptr;
  if (weights) {
    if constexpr (kFp32) {
      dx_home = dx;
    } else {
      dx_home = b.home.as<float>();
    }
    PLATEAU_RETURN_IF_ERROR(backend_.Fill(compute_, dx_home, N * H, 0.0f));
  }
  // `acc` (fp32, `count` elements) final: into dx (activation mode's dX)
  // or added into dw_shard (weight mode's dW); `scratch` a free slot.
  const auto dx_from = [&](const float* acc) -> absl::Status {
    if constexpr (kFp32) {
      return acc == dx ? absl::OkStatus() : backend_.Copy(compute_, dx, acc, N * H * sizeof(float));
    } else {
      return backend_.ConvertToBf16(compute_, dx, acc, N * H);
    }
  };
  const auto dw_add = [&](const float* acc, float* scratch) -> absl::Status {
    const int64_t count = ShardRows(p) * H;
    if constexpr (kFp32) {
      return backend_.Axpy(compute_, dw_shard, acc, count, 1.0f);
    } else {
      PLATEAU_RETURN_IF_ERROR(backend_.ConvertToFloat(compute_, scratch, dw_shard, count));
      PLATEAU_RETURN_IF_ERROR(backend_.Add(compute_, scratch, scratch, acc, count));
      return backend_.ConvertToBf16(compute_, dw_shard, scratch, count);
    }
  };

  if (P == 1) {  // one meeting, no ring
    if (weights) {  // fp32: into dw_shard itself; bf16: a slot, added once
      float* dw = kFp32 ? reinterpret_cast<float*>(dw_shard) : b.slots[0].as<float>();
      if (!kFp32) PLATEAU_RETURN_IF_ERROR(backend_.Fill(compute_, dw, V * H, 0.0f));
      PLATEAU_RETURN_IF_ERROR(DeltaMeeting(x, N, w_shard, V, 0, targets, lse_own, scale, dx_home, dw));
      PLATEAU_RETURN_IF_ERROR(dx_from(dx_home));
      return kFp32 ? absl::OkStatus() : dw_add(dw, b.slots[1].as<float>());
    }
    float* dxa = kFp32 ? reinterpret_cast<float*>(dx) : b.slots[0].as<float>();
    PLATEAU_RETURN_IF_ERROR(backend_.Fill(compute_, dxa, N * H, 0.0f));
    PLATEAU_RETURN_IF_ERROR(DeltaMeeting(x, N, w_shard, V, 0, targets, lse_own, scale, dxa, dw_home));
    return dx_from(dxa);
  }

  // Three slots rotate: the read-only traveller (X or W) of the next step
  // arrives in `free_slot` during the strips; the accumulator (dX or dW)
  // hops after them into the slot the current traveller leaves.
  int x_slot = -1;  // -1: the traveller is this rank's own input
  int acc_slot = 0, free_slot = 1, spare = 2;
  const W* trav = weights ? w_shard : x;
  const float* lse_q = lse_own;
  const int32_t* tq = targets;
  PLATEAU_RETURN_IF_ERROR(
      backend_.Fill(compute_, b.slots[acc_slot].as<float>(), weights ? ShardRows(p) * H : N * H, 0.0f));
  // Activation mode: the batch hops as one message [X | targets | lse]. This
  // rank's own leaves from `spare`; step 0's accumulator arrives there only
  // after that send (the communication stream runs in order).
  const int64_t words = PackedCount<W>(N, /*with_lse=*/true);
  const W* packed = b.slots[spare].as<W>();
  for (int r = 0; r < P; ++r) {
    const int64_t s = weights ? (p - r + P) % P : p;  // the shard met at this step
    float* acc = b.slots[acc_slot].as<float>();
    W* next = b.slots[free_slot].as<W>();
    if (r + 1 < P) {
      PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
      if (!weights && r == 0) {
        PLATEAU_RETURN_IF_ERROR(PackOwnBatch(x, targets, lse_own, N, b.slots[spare].as<W>()));
      }
      if (weights) {
        PLATEAU_RETURN_IF_ERROR(group_.SendRecv(comm_, trav, ShardRows(s) * H, dst, next,
                                                ShardRows((s - 1 + P) % P) * H, src, kWorkingDataType<W>));
      } else {
        PLATEAU_RETURN_IF_ERROR(
            group_.SendRecv(comm_, packed, words, dst, next, words, src, kPackedWire<W>));
      }
    }
    if (weights) {
      PLATEAU_RETURN_IF_ERROR(
          DeltaMeeting(x, N, trav, ShardRows(s), VocabShardBegin(V, P, s), targets, lse_own, scale, dx_home, acc));
    } else {
      PLATEAU_RETURN_IF_ERROR(
          DeltaMeeting(trav, N, w_shard, ShardRows(p), VocabShardBegin(V, P, p), tq, lse_q, scale, acc, dw_home));
    }
    // The accumulator holds this step's meeting: it hops on (an accumulator
    // arrives with the sum of the meetings before; only step 0's starts at 0).
    PLATEAU_RETURN_IF_ERROR(CommAfterCompute());
    const int64_t acc_count = weights ? ShardRows(s) * H : N * H;
    if (r + 1 < P) {
      const int recv_slot = x_slot >= 0 ? x_slot : spare;
      const int64_t next_count = weights ? ShardRows((s - 1 + P) % P) * H : N * H;
      PLATEAU_RETURN_IF_ERROR(group_.SendRecv(comm_, acc, acc_count, dst, b.slots[recv_slot].as<float>(), next_count,
                                              src, DataType::kFloat32));
      PLATEAU_RETURN_IF_ERROR(ComputeAfterComm());
      const int old_acc = acc_slot;
      x_slot = free_slot;
      acc_slot = recv_slot;
      free_slot = old_acc;
      trav = b.slots[x_slot].as<W>();
      if (!weights) {
        packed = trav;
        tq = PackedTargets(b.slots[x_slot].as<W>(), N);
        lse_q = PackedLse(b.slots[x_slot].as<W>(), N);
      }
    } else {
      // Home: in weight mode this rank's shard's dW, summed over every
      // batch; in activation mode this batch's dX, summed over every shard.
      // It lands in the slot whose traveller the last meeting read (in
      // fp32 activation mode in dx itself); `free_slot`'s accumulator left
      // a step ago.
      float* home =
          !weights && kFp32 ? reinterpret_cast<float*>(dx) : b.slots[x_slot >= 0 ? x_slot : spare].as<float>();
      const int64_t home_count = weights ? ShardRows(p) * H : N * H;
      PLATEAU_RETURN_IF_ERROR(group_.SendRecv(comm_, acc, acc_count, dst, home, home_count, src, DataType::kFloat32));
      PLATEAU_RETURN_IF_ERROR(ComputeAfterComm());
      PLATEAU_RETURN_IF_ERROR(weights ? dw_add(home, b.slots[free_slot].as<float>()) : dx_from(home));
    }
  }
  if (weights) PLATEAU_RETURN_IF_ERROR(dx_from(dx_home));
  return absl::OkStatus();
}

absl::Status RingDtp::CheckElement(size_t bytes) const {
  if (static_cast<int64_t>(bytes) == working_bytes_) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("ring_dtp: allocated for ", working_bytes_,
                                          "-byte working elements, called with ", bytes, "-byte ones"));
}

absl::Status RingDtp::Forward(const float* x, const float* w_shard, const int32_t* targets, double* stats) {
  return ForwardT<float>(x, w_shard, targets, stats);
}

absl::Status RingDtp::Forward(const Bf16* x, const Bf16* w_shard, const int32_t* targets, double* stats) {
  return ForwardT<Bf16>(x, w_shard, targets, stats);
}

absl::Status RingDtp::Backward(const float* x, const float* w_shard, const int32_t* targets, float scale,
                               float* dx, float* dw_shard) {
  return BackwardT<float>(x, w_shard, targets, scale, dx, dw_shard);
}

absl::Status RingDtp::Backward(const Bf16* x, const Bf16* w_shard, const int32_t* targets, float scale,
                               Bf16* dx, Bf16* dw_shard) {
  return BackwardT<Bf16>(x, w_shard, targets, scale, dx, dw_shard);
}

}  // namespace plateau
