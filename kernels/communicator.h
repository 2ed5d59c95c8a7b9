// Collective communication between the ranks of a job: one interface, Gloo
// over TCP on the CPU backend and NCCL on CUDA.
//
// Every collective is enqueued on a Stream (kernels/stream.h) and runs when
// the stream reaches it: a CpuStream runs it on its worker thread, a CUDA
// stream hands it to NCCL (on the cudaStream_t of Stream::native_handle()).
// The call itself only validates its arguments (INVALID_ARGUMENT naming the
// argument, before anything is enqueued) and enqueues; failures of the
// communication itself (a peer that never answers, a broken connection)
// become the stream's sticky error, seen at Synchronize(). Callers order
// communication after compute with events, so communication on one stream
// overlaps compute on another. Buffers must stay valid, and must not be
// touched by other work, until the stream has run the collective.
//
// Matching, as in MPI and NCCL: every rank of a group issues the same
// collectives, with the same counts, data type, op and root, in the same
// order. Counts are element counts; buffers are contiguous.
//
// Determinism: the reduction order of AllReduce and ReduceScatter is fixed by
// the group size and the count, so the same inputs give the same bits run to
// run (on CUDA, as far as NCCL guarantees this for a fixed configuration).
//
// Failure: once a collective has failed (timed out, lost a peer), the
// communicator is unusable: later collectives fail with FAILED_PRECONDITION
// quoting the first error. Recovery means a new job attempt (a new prefix).
//
// Thread safety: the methods may be called from several threads, but the
// order of collectives must be the same on every rank, so a program drives a
// communicator from one thread (or orders its callers). A Communicator must
// outlive the work it enqueued; destroying it waits for that work to finish.
#ifndef PLATEAU_KERNELS_COMMUNICATOR_H_
#define PLATEAU_KERNELS_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/kv_store.h"
#include "kernels/stream.h"

namespace plateau {

// kBfloat16: kernels/bf16.h's Bf16 (bf16 mixed precision's working
// gradients, weights and rows, issue 17). A reduction loads both operands
// exactly, combines them in fp32 and rounds once to nearest even per
// combining step (per hop of the ring), as NCCL does for ncclBfloat16: a
// sum over P ranks carries P - 1 bf16 roundings.
enum class DataType { kFloat32, kFloat64, kInt32, kInt64, kBfloat16 };

// What a step's collectives carry for its working type W: float (fp32) or
// Bf16 (bf16 mixed precision). One rule for every schedule.
template <typename W>
inline constexpr DataType kWorkingDataType = std::is_same_v<W, float> ? DataType::kFloat32 : DataType::kBfloat16;
// Bytes per element; 0 for a value outside the enum.
size_t DataTypeSize(DataType type);
// "float32", "float64", "int32", "int64", "bfloat16" ("unknown" otherwise).
absl::string_view DataTypeName(DataType type);

enum class ReduceOp { kSum, kMax, kMin };
// "sum", "max", "min" ("unknown" otherwise).
absl::string_view ReduceOpName(ReduceOp op);

struct CommunicatorOptions {
  BackendKind backend = BackendKind::kCpu;
  int rank = 0;  // this process's rank in the world, in [0, size)
  int size = 1;  // ranks in the world, >= 1
  // Where the ranks meet: a FileStore on one machine, the coordinator's
  // store over gRPC in a job. Shared by the world and every group made from
  // it.
  std::shared_ptr<KeyValueStore> store;
  // Namespaces one job attempt in the store ("job7/attempt2"), so that keys
  // left by an earlier attempt are never read.
  std::string prefix;
  // Address the CPU transport listens on (Gloo over TCP, ephemeral port).
  std::string hostname = "127.0.0.1";
  // Bounds the rendezvous and every collective: a peer that does not answer
  // within it turns into DEADLINE_EXCEEDED, never a hang. On Gloo it bounds
  // each wait of a collective (each message, each ring step), not the
  // collective as a whole: a peer that answers slowly but steadily is not
  // cut off, and a collective of S steps may take up to S timeouts.
  absl::Duration timeout = absl::Seconds(60);
  // CUDA device ordinal (NCCL); ignored on the CPU.
  int device_index = 0;
};

class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  BackendKind backend() const { return backend_; }
  int rank() const { return rank_; }  // within this group
  int size() const { return static_cast<int>(members_.size()); }
  // "world", "sequence", "expert", "vocabulary", ...
  const std::string& name() const { return name_; }
  // World ranks of this group's members, in group-rank order.
  const std::vector<int>& members() const { return members_; }

  // recv[i] = op over ranks of send[i], for i < count. send == recv is
  // allowed (in place); other overlaps are not.
  absl::Status AllReduce(Stream& stream, const void* send, void* recv,
                         size_t count, DataType type, ReduceOp op);
  // send holds size() * recv_count elements; block r (elements
  // [r * recv_count, (r + 1) * recv_count)) is reduced over ranks into
  // rank r's recv. In place when recv == send + rank() * recv_count.
  absl::Status ReduceScatter(Stream& stream, const void* send, void* recv,
                             size_t recv_count, DataType type, ReduceOp op);
  // recv (size() * send_count elements) gets rank r's send at block r. In
  // place when send == recv + rank() * send_count.
  absl::Status AllGather(Stream& stream, const void* send, void* recv,
                         size_t send_count, DataType type);
  // send_counts[r] elements go to rank r and recv_counts[r] come from rank
  // r, both packed in rank order; zero counts are allowed. Each rank's
  // send_counts[r] must equal rank r's recv_counts[rank()] (the caller
  // exchanges counts first, e.g. with an AllToAllV of counts or an
  // AllGather); locally, send_counts[rank()] == recv_counts[rank()]. Counts
  // that disagree across ranks are a caller's bug that no backend turns into
  // a status (that would cost an exchange of counts per call): on Gloo a
  // rank that is sent more than it posted aborts (Gloo's event loop enforces
  // the length), one sent less keeps the rest of its block as it was;
  // NCCL's behaviour is undefined. The same holds for SendRecv.
  absl::Status AllToAllV(Stream& stream, const void* send,
                         absl::Span<const int64_t> send_counts, void* recv,
                         absl::Span<const int64_t> recv_counts,
                         DataType type);
  // data on `root` is copied to data on every other rank.
  absl::Status Broadcast(Stream& stream, void* data, size_t count,
                         DataType type, int root);
  // Sends send_count elements to `dst` while receiving recv_count elements
  // from `src` (group ranks); the ring schedules use dst = (rank + 1) % size
  // and src = (rank - 1 + size) % size. The peers' counts must match. A
  // rank may exchange with itself only both ways (dst == src == rank(), equal
  // counts), which is what a ring of one does.
  absl::Status SendRecv(Stream& stream, const void* send, size_t send_count,
                        int dst, void* recv, size_t recv_count, int src,
                        DataType type);
  // Completes on a rank only after every rank has reached it.
  absl::Status Barrier(Stream& stream);

  // A communicator over a subset of this one (the sequence, expert and
  // vocabulary groups are views of one rank set). Called by every member of
  // the new group, and only by them, with the same name and the same list
  // of this communicator's ranks; group rank i is ranks[i]. Blocks until all
  // members have joined (or the timeout), so ranks that make several groups
  // make them in one agreed order. The group is independent of this
  // communicator and its streams: its collectives may run concurrently with
  // the parent's, and it may outlive it. On CUDA one caveat: before NCCL
  // 2.26, the operations of several communicators on one GPU must be issued
  // in the same order on every rank, or the kernels can deadlock (NCCL's
  // documentation, "Using multiple NCCL communicators concurrently"). The
  // step uses only the world communicator today; a schedule that issues
  // on a group and its parent from different threads must order them.
  absl::StatusOr<std::unique_ptr<Communicator>> Group(const std::string& name,
                                                      std::vector<int> ranks);

 protected:
  // `members` are world ranks; `rank` indexes them.
  Communicator(BackendKind backend, std::string name, int rank,
               std::vector<int> members);

  // Implementations: called only with validated arguments, non-empty work
  // (zero-count AllReduce, ReduceScatter, AllGather and Broadcast never get
  // here: their counts are the same on every rank) and a stream of this
  // backend. AllToAllV and SendRecv do get here with zero counts, which may
  // differ across ranks: such a call is still a collective in the call
  // order.
  virtual absl::Status DoAllReduce(Stream& stream, const void* send,
                                   void* recv, size_t count, DataType type,
                                   ReduceOp op) = 0;
  virtual absl::Status DoReduceScatter(Stream& stream, const void* send,
                                       void* recv, size_t recv_count,
                                       DataType type, ReduceOp op) = 0;
  virtual absl::Status DoAllGather(Stream& stream, const void* send,
                                   void* recv, size_t send_count,
                                   DataType type) = 0;
  virtual absl::Status DoAllToAllV(Stream& stream, const void* send,
                                   absl::Span<const int64_t> send_counts,
                                   void* recv,
                                   absl::Span<const int64_t> recv_counts,
                                   DataType type) = 0;
  virtual absl::Status DoBroadcast(Stream& stream, void* data, size_t count,
                                   DataType type, int root) = 0;
  virtual absl::Status DoSendRecv(Stream& stream, const void* send,
                                  size_t send_count, int dst, void* recv,
                                  size_t recv_count, int src,
                                  DataType type) = 0;
  virtual absl::Status DoBarrier(Stream& stream) = 0;
  // `ranks` are validated ranks of this communicator (the caller among
  // them); `world_members` are the same ranks as world ranks.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> DoGroup(
      const std::string& name, const std::vector<int>& ranks,
      std::vector<int> world_members) = 0;

  // "all_reduce on group 'expert' (rank 1 of 4)": how failures name a call.
  std::string Describe(absl::string_view op) const;

 private:
  absl::Status CheckStream(absl::string_view op, const Stream& stream) const;

  const BackendKind backend_;
  const std::string name_;
  const int rank_;
  const std::vector<int> members_;
};

// Validates `options` (INVALID_ARGUMENT naming the field) and creates the
// world communicator of the backend, blocking until every rank has joined
// or options.timeout has passed (DEADLINE_EXCEEDED naming what was missing).
// CUDA needs a build with --config=cuda (FAILED_PRECONDITION otherwise).
absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(
    const CommunicatorOptions& options);

// The checks CreateCommunicator runs, for callers that validate a launch
// configuration before starting ranks.
absl::Status ValidateCommunicatorOptions(const CommunicatorOptions& options);

}  // namespace plateau

#endif  // PLATEAU_KERNELS_COMMUNICATOR_H_
