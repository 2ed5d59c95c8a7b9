// A Communicator that counts the collectives a rank issues, by kind, with
// the bytes each hands over to send, and forwards each to the real one. For tests that check how many
// host-blocking round trips a schedule makes (a count no machine load
// changes) and for composed_bench's attribution.
//
// Thread safety: the table counts under a lock (a rank may issue
// collectives from more than one thread); the communicator itself is used
// as the one it wraps.
#ifndef PLATEAU_KERNELS_TESTING_COUNTING_COMMUNICATOR_H_
#define PLATEAU_KERNELS_TESTING_COUNTING_COMMUNICATOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/communicator.h"

namespace plateau {

// Forwards every collective to the communicator it wraps and counts it in a
// Table; groups made through it count into the same table.
class CountingCommunicator : public Communicator {
 public:
  using Counts = std::map<std::string, int64_t>;
  // Counts under a lock: a rank's collectives may be issued from more than
  // one of its threads.
  // `bytes` per kind: what this rank's calls hand over to send, its send
  // buffer (all_reduce and broadcast: the buffer; reduce_scatter: all P
  // blocks; all_gather: its block; all_to_all_v: every block, its own
  // included; send_recv: what goes to dst), whatever the algorithm moves.
  struct Table {
    std::mutex mu;
    Counts counts;
    Counts bytes;
    void Add(const char* op, int64_t sent = 0) {
      std::lock_guard<std::mutex> lock(mu);
      ++counts[op];
      bytes[op] += sent;
    }
    Counts Read() {
      std::lock_guard<std::mutex> lock(mu);
      return counts;
    }
    Counts ReadBytes() {
      std::lock_guard<std::mutex> lock(mu);
      return bytes;
    }
  };
  CountingCommunicator(Communicator& inner, Table* counts)
      : Communicator(inner.backend(), inner.name(), inner.rank(), inner.members()), inner_(inner), counts_(counts) {}
  CountingCommunicator(std::unique_ptr<Communicator> owned, Table* counts)
      : CountingCommunicator(*owned, counts) {
    owned_ = std::move(owned);
  }

 protected:
  absl::Status DoAllReduce(Stream& st, const void* send, void* recv, size_t count, DataType type,
                           ReduceOp op) override {
    counts_->Add("all_reduce", Bytes(count, type));
    return inner_.AllReduce(st, send, recv, count, type, op);
  }
  absl::Status DoReduceScatter(Stream& st, const void* send, void* recv, size_t recv_count, DataType type,
                               ReduceOp op) override {
    counts_->Add("reduce_scatter", Bytes(recv_count * static_cast<size_t>(size()), type));
    return inner_.ReduceScatter(st, send, recv, recv_count, type, op);
  }
  absl::Status DoAllGather(Stream& st, const void* send, void* recv, size_t send_count, DataType type) override {
    counts_->Add("all_gather", Bytes(send_count, type));
    return inner_.AllGather(st, send, recv, send_count, type);
  }
  absl::Status DoAllToAllV(Stream& st, const void* send, absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts, DataType type) override {
    int64_t elements = 0;
    for (int64_t c : send_counts) elements += c;
    counts_->Add("all_to_all_v", Bytes(static_cast<size_t>(elements), type));
    return inner_.AllToAllV(st, send, send_counts, recv, recv_counts, type);
  }
  absl::Status DoBroadcast(Stream& st, void* data, size_t count, DataType type, int root) override {
    counts_->Add("broadcast", Bytes(count, type));
    return inner_.Broadcast(st, data, count, type, root);
  }
  absl::Status DoSendRecv(Stream& st, const void* send, size_t send_count, int dst, void* recv, size_t recv_count,
                          int src, DataType type) override {
    counts_->Add("send_recv", Bytes(send_count, type));
    return inner_.SendRecv(st, send, send_count, dst, recv, recv_count, src, type);
  }
  absl::Status DoBarrier(Stream& st) override {
    counts_->Add("barrier");
    return inner_.Barrier(st);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> DoGroup(const std::string& name, const std::vector<int>& ranks,
                                                        std::vector<int>) override {
    absl::StatusOr<std::unique_ptr<Communicator>> g = inner_.Group(name, ranks);
    if (!g.ok()) return g.status();
    return std::unique_ptr<Communicator>(new CountingCommunicator(std::move(*g), counts_));
  }

 private:
  static int64_t Bytes(size_t count, DataType type) {
    return static_cast<int64_t>(count * DataTypeSize(type));
  }

  Communicator& inner_;
  std::unique_ptr<Communicator> owned_;  // a group's, made through this one
  Table* const counts_;
};

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_COUNTING_COMMUNICATOR_H_
