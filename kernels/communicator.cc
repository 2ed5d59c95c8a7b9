#include "kernels/communicator.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu_stream.h"
#include "kernels/status_macros.h"

namespace plateau {

size_t DataTypeSize(DataType type) {
  switch (type) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kBfloat16:
      return 2;
  }
  return 0;
}

absl::string_view DataTypeName(DataType type) {
  switch (type) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kBfloat16:
      return "bfloat16";
  }
  return "unknown";
}

absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// Argument checks, shared by every backend.

namespace {

absl::Status Bad(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

absl::Status CheckType(absl::string_view op, DataType type) {
  if (DataTypeSize(type) == 0) {
    return Bad(op, absl::StrCat("type: unknown data type ", static_cast<int>(type),
                                "; expected float32, float64, int32, int64 or bfloat16"));
  }
  return absl::OkStatus();
}

absl::Status CheckReduceOp(absl::string_view op, ReduceOp reduce) {
  if (ReduceOpName(reduce) == "unknown") {
    return Bad(op, absl::StrCat("op: unknown reduce op ",
                                static_cast<int>(reduce),
                                "; expected sum, max or min"));
  }
  return absl::OkStatus();
}

// The byte size of `count` elements, or an error when it overflows.
absl::Status CheckBytes(absl::string_view op, absl::string_view name,
                        size_t count, DataType type, size_t* bytes) {
  const size_t elem = DataTypeSize(type);
  if (count > std::numeric_limits<size_t>::max() / elem ||
      count > static_cast<size_t>(std::numeric_limits<int64_t>::max()) / elem) {
    return Bad(op, absl::StrCat(name, " = ", count, " elements of ",
                                DataTypeName(type), " overflows a byte size"));
  }
  *bytes = count * elem;
  return absl::OkStatus();
}

// A pointer may be null only when nothing is read or written through it.
absl::Status CheckPtr(absl::string_view op, absl::string_view name,
                      const void* p, size_t count) {
  if (count > 0 && p == nullptr) {
    return Bad(op, absl::StrCat(name, " is null but ", count,
                                " elements are to be accessed"));
  }
  return absl::OkStatus();
}

bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

absl::Status CheckPeer(absl::string_view op, absl::string_view name, int peer,
                       int size) {
  if (peer < 0 || peer >= size) {
    return Bad(op, absl::StrCat(name, " = ", peer, " is not a rank of this ",
                                size, "-rank group; expected [0, ", size,
                                ")"));
  }
  return absl::OkStatus();
}

// Checks one side of an AllToAllV and returns its total element count.
absl::Status CheckCounts(absl::string_view op, absl::string_view name,
                         absl::Span<const int64_t> counts, int size,
                         DataType type, int64_t* total) {
  if (static_cast<int>(counts.size()) != size) {
    return Bad(op, absl::StrCat(name, " has ", counts.size(),
                                " entries; expected one per rank (", size,
                                ")"));
  }
  const int64_t max_elems =
      std::numeric_limits<int64_t>::max() / static_cast<int64_t>(DataTypeSize(type));
  *total = 0;
  for (int r = 0; r < size; ++r) {
    if (counts[r] < 0) {
      return Bad(op, absl::StrCat(name, "[", r, "] = ", counts[r],
                                  " is negative; expected >= 0"));
    }
    if (counts[r] > max_elems - *total) {
      return Bad(op, absl::StrCat(name, " sum to more elements than a byte "
                                        "size can hold"));
    }
    *total += counts[r];
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
// Communicator

Communicator::Communicator(BackendKind backend, std::string name, int rank,
                           std::vector<int> members)
    : backend_(backend),
      name_(std::move(name)),
      rank_(rank),
      members_(std::move(members)) {}

Communicator::~Communicator() = default;

std::string Communicator::Describe(absl::string_view op) const {
  return absl::StrCat(op, " on group '", name_, "' (rank ", rank_, " of ",
                      size(), ")");
}

absl::Status Communicator::CheckStream(absl::string_view op,
                                       const Stream& stream) const {
  switch (backend_) {
    case BackendKind::kCpu:
      if (dynamic_cast<const CpuStream*>(&stream) == nullptr) {
        return Bad(op, absl::StrCat("stream '", stream.name(),
                                    "' is not a CPU stream; this "
                                    "communicator runs on the cpu backend"));
      }
      break;
    case BackendKind::kCuda:
      if (stream.native_handle() == nullptr) {
        return Bad(op, absl::StrCat("stream '", stream.name(),
                                    "' has no CUDA stream handle; this "
                                    "communicator runs on the cuda backend"));
      }
      break;
  }
  return absl::OkStatus();
}

absl::Status Communicator::AllReduce(Stream& stream, const void* send,
                                     void* recv, size_t count, DataType type,
                                     ReduceOp op) {
  constexpr absl::string_view kOp = "all_reduce";
  PLATEAU_RETURN_IF_ERROR(CheckStream(kOp, stream));
  PLATEAU_RETURN_IF_ERROR(CheckType(kOp, type));
  PLATEAU_RETURN_IF_ERROR(CheckReduceOp(kOp, op));
  size_t bytes = 0;
  PLATEAU_RETURN_IF_ERROR(CheckBytes(kOp, "count", count, type, &bytes));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "send", send, count));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "recv", recv, count));
  if (send != recv && Overlap(send, bytes, recv, bytes)) {
    return Bad(kOp, "send and recv overlap without being equal; pass the "
                    "same pointer for an in-place all-reduce");
  }
  if (count == 0) return absl::OkStatus();
  return DoAllReduce(stream, send, recv, count, type, op);
}

absl::Status Communicator::ReduceScatter(Stream& stream, const void* send,
                                         void* recv, size_t recv_count,
                                         DataType type, ReduceOp op) {
  constexpr absl::string_view kOp = "reduce_scatter";
  PLATEAU_RETURN_IF_ERROR(CheckStream(kOp, stream));
  PLATEAU_RETURN_IF_ERROR(CheckType(kOp, type));
  PLATEAU_RETURN_IF_ERROR(CheckReduceOp(kOp, op));
  size_t recv_bytes = 0, send_bytes = 0;
  PLATEAU_RETURN_IF_ERROR(
      CheckBytes(kOp, "recv_count", recv_count, type, &recv_bytes));
  if (recv_count > std::numeric_limits<size_t>::max() / size()) {
    return Bad(kOp, "size() * recv_count overflows");
  }
  const size_t send_count = recv_count * size();
  PLATEAU_RETURN_IF_ERROR(
      CheckBytes(kOp, "size() * recv_count", send_count, type, &send_bytes));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "send", send, send_count));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "recv", recv, recv_count));
  const char* own_block = static_cast<const char*>(send) + rank() * recv_bytes;
  if (recv != own_block && Overlap(send, send_bytes, recv, recv_bytes)) {
    return Bad(kOp, "recv overlaps send; the only overlap allowed is in "
                    "place, recv == send + rank() * recv_count");
  }
  if (recv_count == 0) return absl::OkStatus();
  return DoReduceScatter(stream, send, recv, recv_count, type, op);
}

absl::Status Communicator::AllGather(Stream& stream, const void* send,
                                     void* recv, size_t send_count,
                                     DataType type) {
  constexpr absl::string_view kOp = "all_gather";
  PLATEAU_RETURN_IF_ERROR(CheckStream(kOp, stream));
  PLATEAU_RETURN_IF_ERROR(CheckType(kOp, type));
  size_t send_bytes = 0, recv_bytes = 0;
  PLATEAU_RETURN_IF_ERROR(
      CheckBytes(kOp, "send_count", send_count, type, &send_bytes));
  if (send_count > std::numeric_limits<size_t>::max() / size()) {
    return Bad(kOp, "size() * send_count overflows");
  }
  const size_t recv_count = send_count * size();
  PLATEAU_RETURN_IF_ERROR(
      CheckBytes(kOp, "size() * send_count", recv_count, type, &recv_bytes));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "send", send, send_count));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "recv", recv, recv_count));
  const char* own_block = static_cast<char*>(recv) + rank() * send_bytes;
  if (send != own_block && Overlap(send, send_bytes, recv, recv_bytes)) {
    return Bad(kOp, "send overlaps recv; the only overlap allowed is in "
                    "place, send == recv + rank() * send_count");
  }
  if (send_count == 0) return absl::OkStatus();
  return DoAllGather(stream, send, recv, send_count, type);
}

absl::Status Communicator::AllToAllV(Stream& stream, const void* send,
                                     absl::Span<const int64_t> send_counts,
                                     void* recv,
                                     absl::Span<const int64_t> recv_counts,
                                     DataType type) {
  constexpr absl::string_view kOp = "all_to_all_v";
  PLATEAU_RETURN_IF_ERROR(CheckStream(kOp, stream));
  PLATEAU_RETURN_IF_ERROR(CheckType(kOp, type));
  int64_t send_total = 0, recv_total = 0;
  PLATEAU_RETURN_IF_ERROR(
      CheckCounts(kOp, "send_counts", send_counts, size(), type, &send_total));
  PLATEAU_RETURN_IF_ERROR(
      CheckCounts(kOp, "recv_counts", recv_counts, size(), type, &recv_total));
  if (send_counts[rank()] != recv_counts[rank()]) {
    return Bad(kOp, absl::StrCat(
                        "send_counts[", rank(), "] = ", send_counts[rank()],
                        " but recv_counts[", rank(), "] = ",
                        recv_counts[rank()],
                        "; a rank's block to itself must have one size"));
  }
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "send", send, send_total));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "recv", recv, recv_total));
  const size_t elem = DataTypeSize(type);
  if (Overlap(send, send_total * elem, recv, recv_total * elem)) {
    return Bad(kOp, "send and recv overlap; all-to-all-v is not in place");
  }
  return DoAllToAllV(stream, send, send_counts, recv, recv_counts, type);
}

absl::Status Communicator::Broadcast(Stream& stream, void* data, size_t count,
                                     DataType type, int root) {
  constexpr absl::string_view kOp = "broadcast";
  PLATEAU_RETURN_IF_ERROR(CheckStream(kOp, stream));
  PLATEAU_RETURN_IF_ERROR(CheckType(kOp, type));
  PLATEAU_RETURN_IF_ERROR(CheckPeer(kOp, "root", root, size()));
  size_t bytes = 0;
  PLATEAU_RETURN_IF_ERROR(CheckBytes(kOp, "count", count, type, &bytes));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "data", data, count));
  if (count == 0) return absl::OkStatus();
  return DoBroadcast(stream, data, count, type, root);
}

absl::Status Communicator::SendRecv(Stream& stream, const void* send,
                                    size_t send_count, int dst, void* recv,
                                    size_t recv_count, int src,
                                    DataType type) {
  constexpr absl::string_view kOp = "send_recv";
  PLATEAU_RETURN_IF_ERROR(CheckStream(kOp, stream));
  PLATEAU_RETURN_IF_ERROR(CheckType(kOp, type));
  PLATEAU_RETURN_IF_ERROR(CheckPeer(kOp, "dst", dst, size()));
  PLATEAU_RETURN_IF_ERROR(CheckPeer(kOp, "src", src, size()));
  size_t send_bytes = 0, recv_bytes = 0;
  PLATEAU_RETURN_IF_ERROR(
      CheckBytes(kOp, "send_count", send_count, type, &send_bytes));
  PLATEAU_RETURN_IF_ERROR(
      CheckBytes(kOp, "recv_count", recv_count, type, &recv_bytes));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "send", send, send_count));
  PLATEAU_RETURN_IF_ERROR(CheckPtr(kOp, "recv", recv, recv_count));
  if ((dst == rank()) != (src == rank())) {
    return Bad(kOp, absl::StrCat("dst = ", dst, " and src = ", src,
                                 ": a rank exchanges with itself only both "
                                 "ways (dst == src == rank() = ",
                                 rank(), ")"));
  }
  if (dst == rank() && send_count != recv_count) {
    return Bad(kOp, absl::StrCat("send_count = ", send_count,
                                 " but recv_count = ", recv_count,
                                 " for an exchange with itself"));
  }
  if (Overlap(send, send_bytes, recv, recv_bytes)) {
    return Bad(kOp, "send and recv overlap");
  }
  // No shortcut when both counts are 0: a rank idle in a ring step while
  // its neighbours exchange must still take its place in the call order
  // (Gloo numbers each collective; one that skipped it would wait on
  // another collective than its peers from then on).
  return DoSendRecv(stream, send, send_count, dst, recv, recv_count, src,
                    type);
}

absl::Status Communicator::Barrier(Stream& stream) {
  PLATEAU_RETURN_IF_ERROR(CheckStream("barrier", stream));
  return DoBarrier(stream);
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Group(
    const std::string& name, std::vector<int> ranks) {
  constexpr absl::string_view kOp = "group";
  if (name.empty()) return Bad(kOp, "name is empty");
  if (ranks.empty()) {
    return Bad(kOp, absl::StrCat("ranks of group '", name, "' is empty"));
  }
  std::vector<bool> seen(size(), false);
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    if (r < 0 || r >= size()) {
      return Bad(kOp, absl::StrCat("ranks[", i, "] = ", r, " of group '", name,
                                   "' is not a rank of group '", name_,
                                   "' (expected [0, ", size(), "))"));
    }
    if (seen[r]) {
      return Bad(kOp, absl::StrCat("ranks of group '", name,
                                   "' lists rank ", r, " twice"));
    }
    seen[r] = true;
  }
  if (!seen[rank()]) {
    return Bad(kOp, absl::StrCat("the caller (rank ", rank(), " of '", name_,
                                 "') is not in ranks [",
                                 absl::StrJoin(ranks, ","), "] of group '",
                                 name, "'; only members call Group"));
  }
  std::vector<int> world;
  world.reserve(ranks.size());
  for (int r : ranks) world.push_back(members_[r]);
  return DoGroup(name, ranks, std::move(world));
}

// ---------------------------------------------------------------------------
// Options

absl::Status ValidateCommunicatorOptions(const CommunicatorOptions& o) {
  constexpr absl::string_view kOp = "communicator options";
  if (o.backend != BackendKind::kCpu && o.backend != BackendKind::kCuda) {
    return Bad(kOp, absl::StrCat("backend: unknown kind ",
                                 static_cast<int>(o.backend)));
  }
  if (o.size < 1) {
    return Bad(kOp, absl::StrCat("size must be >= 1, got ", o.size));
  }
  if (o.rank < 0 || o.rank >= o.size) {
    return Bad(kOp, absl::StrCat("rank = ", o.rank, " is outside [0, ", o.size,
                                 ")"));
  }
  if (o.store == nullptr) return Bad(kOp, "store is null");
  if (o.timeout <= absl::ZeroDuration() || o.timeout == absl::InfiniteDuration()) {
    return Bad(kOp, absl::StrCat("timeout must be positive and finite, got ",
                                 absl::FormatDuration(o.timeout)));
  }
  if (o.backend == BackendKind::kCpu && o.hostname.empty()) {
    return Bad(kOp, "hostname is empty; the cpu backend listens on it");
  }
  if (o.backend == BackendKind::kCuda && o.device_index < 0) {
    return Bad(kOp, absl::StrCat("device_index must be >= 0, got ",
                                 o.device_index));
  }
  return absl::OkStatus();
}

}  // namespace plateau
