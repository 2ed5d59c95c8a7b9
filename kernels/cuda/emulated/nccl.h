// The SIMT emulation's stand-in for <nccl.h>: the part of NCCL that
// kernels/nccl/nccl_communicator.cc and its test use, on the CPU
// (emulated/nccl.cc), with NCCL 2.28's names, signatures and values.
//
// What it models:
//   - the communicators created with the same unique id form one world of
//     `nranks` ranks, threads of one process or of several. The id names
//     the process that made it (its pid and a random token): the world
//     lives there, and ranks in other processes join it through that
//     process's Unix-domain socket (abstract namespace, so same machine and
//     network namespace only; processes of the same user only), each served
//     by a proxy thread there that makes its calls for it (nccl.cc: "Ranks
//     in other processes"). A
//     blocking ncclCommInitRankConfig returns once all have joined; a
//     non-blocking one (config.blocking = 0) returns ncclInProgress and
//     ncclCommGetAsyncError says ncclInProgress until they have. As NCCL,
//     a world takes one rank per GPU: a rank joining on the GPU of one
//     already in (the machine's GPU, as CUDA_VISIBLE_DEVICES names it, in
//     any process) gets ncclInvalidUsage and the world fails;
//   - a non-blocking communicator's operations (what kernels/nccl uses) run
//     on the stream, as NCCL's do: the call checks its arguments, enqueues
//     the operation and returns; when the stream reaches it (emulation.h's
//     EnqueueExternal) the communicator's own thread meets the other ranks'
//     matching call (the n-th collective of each rank) and moves the data,
//     and the stream's later work, its queries and its synchronisations
//     wait until then. So a peer that never calls leaves the stream blocked
//     (until the wait limit below, an abort or a destroy), and every failure
//     found there is reported only asynchronously (ncclCommGetAsyncError), as
//     on a GPU; as there, an operation that failed still holds its stream
//     until the communicator is aborted or destroyed (here also until the
//     wait limit has passed once more since its first failure, so that
//     nothing hangs for ever). Operations run in call order; a group over
//     several streams is one operation, the streams joined before and after
//     it (events), as NCCL joins them;
//   - a blocking communicator's operations run at the call (a group's at
//     the outermost ncclGroupEnd): the call first runs its stream's work so
//     far (emulation.h's Flush: the data it reads is then written), then
//     meets the other ranks, moves the data, and returns with the results
//     in place, ahead of anything enqueued after it, and with any failure
//     as its own result (errors instead of hangs);
//   - reductions in rank order 0, 1, ..., n-1 (deterministic; NCCL's ring
//     order differs), sum / prod / max / min on int8, uint8, int32, uint32,
//     int64, uint64, float, double and bfloat16 (each combining step in fp32
//     and one rounding to bf16, as communicator.h describes NCCL: n - 1
//     roundings over n ranks); integer sums wrap;
//   - send / recv: a send is copied into its peer's mailbox when it runs (a
//     group deposits all its sends before waiting for its receives), so it
//     never waits; a receive takes the peer's oldest message to it;
//   - bounded waits: ranks that disagree on a collective (kind,
//     count, type, op, root) or a message (count, type) get
//     ncclInvalidUsage; a wait for other ranks ends after 60 s (or
//     PLATEAU_EMULATED_NCCL_TIMEOUT_MS, read when a world forms) with
//     ncclSystemError; when a rank gives up, aborts or its stream fails,
//     every wait in its world ends with ncclRemoteError, and when a rank
//     destroys its communicator, the waits that need it do (what it sent
//     before is still delivered). Each of these sets the communicator's
//     asynchronous error (ncclCommGetAsyncError), and later operations on
//     it return that error at once. Argument errors (ncclInvalidArgument)
//     take no part in any rendezvous and leave the communicator usable.
//   - a rank's process that goes away without destroying its communicator
//     aborts it (the others' waits end, naming it); when the process that
//     made the id goes away, its remote ranks' next calls fail with
//     ncclRemoteError.
// Not modelled: overlap of a collective with the stream's later work, fp16,
// fp8 and ncclAvg reductions (ncclInvalidArgument), one thread driving
// several blocking ranks inside one group (its waits would time out), a
// group over a remote rank's communicator and others, over blocking and
// non-blocking communicators, or over several non-blocking ones
// (ncclInvalidUsage), timing, a fork's child using its parent's
// communicators (as with NCCL, it makes its own; see runtime.cc's "Forks"
// for what else a child must leave alone).
#ifndef PLATEAU_KERNELS_CUDA_EMULATED_NCCL_H_
#define PLATEAU_KERNELS_CUDA_EMULATED_NCCL_H_

#include <climits>
#include <cstddef>

#include "kernels/cuda/emulated/cuda_runtime_api.h"

typedef struct ncclComm* ncclComm_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL

// NCCL 2.28's layout; only `blocking` means anything to the emulation.
typedef struct ncclConfig_v22800 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
  int trafficClass;
  const char* commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
} ncclConfig_t;

// clang-format off
#define NCCL_CONFIG_INITIALIZER                                                 \
  {                                                                             \
    sizeof(ncclConfig_t), /* size */                                            \
    0xcafebeef,           /* magic */                                           \
    22800,                /* version: 2.28.0 */                                 \
    NCCL_CONFIG_UNDEF_INT, /* blocking */                                       \
    NCCL_CONFIG_UNDEF_INT, /* cgaClusterSize */                                 \
    NCCL_CONFIG_UNDEF_INT, /* minCTAs */                                        \
    NCCL_CONFIG_UNDEF_INT, /* maxCTAs */                                        \
    NCCL_CONFIG_UNDEF_PTR, /* netName */                                        \
    NCCL_CONFIG_UNDEF_INT, /* splitShare */                                     \
    NCCL_CONFIG_UNDEF_INT, /* trafficClass */                                   \
    NCCL_CONFIG_UNDEF_PTR, /* commName */                                       \
    NCCL_CONFIG_UNDEF_INT, /* collnetEnable */                                  \
    NCCL_CONFIG_UNDEF_INT, /* CTAPolicy */                                      \
    NCCL_CONFIG_UNDEF_INT, /* shrinkShare */                                    \
    NCCL_CONFIG_UNDEF_INT, /* nvlsCTAs */                                       \
    NCCL_CONFIG_UNDEF_INT, /* nChannelsPerNetPeer */                            \
    NCCL_CONFIG_UNDEF_INT, /* nvlinkCentricSched */                             \
  }
// clang-format on

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

typedef enum {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclHalf = 6,
  ncclFloat32 = 7,
  ncclFloat = 7,
  ncclFloat64 = 8,
  ncclDouble = 8,
  ncclBfloat16 = 9,
  ncclFloat8e4m3 = 10,
  ncclFloat8e5m2 = 11,
  ncclNumTypes = 12
} ncclDataType_t;

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
// The calling thread's current device is the communicator's: its
// operations take only that device's streams (and the legacy stream).
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
// Ends the other ranks' waits with ncclRemoteError, then frees `comm`.
ncclResult_t ncclCommAbort(ncclComm_t comm);
// A blocking communicator's operations have all finished at their calls:
// ncclSuccess. A non-blocking one's: ncclSuccess if those on streams have
// finished, else ncclInProgress, and ncclCommGetAsyncError says
// ncclInProgress until they have.
ncclResult_t ncclCommFinalize(ncclComm_t comm);
// As NCCL's, finalizes first (a non-blocking communicator's operations on
// streams finish; bounded here by the wait limit, and not for one that has
// failed), then leaves the world and frees `comm`.
ncclResult_t ncclCommDestroy(ncclComm_t comm);

const char* ncclGetErrorString(ncclResult_t result);
// The communicator's asynchronous error's description if it has one, else
// the description of the calling thread's last failed call ("" if none).
// Valid until the calling thread's next NCCL call.
const char* ncclGetLastError(ncclComm_t comm);

ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);

// Not NCCL's: a switch for tests of the emulation's users. While on, a
// non-blocking communicator's operation call returns ncclInProgress and
// enqueues nothing, and that communicator's ncclCommGetAsyncError says
// ncclInProgress from then on, until an abort: as NCCL 2.22+ does while it
// connects a peer at a collective's first call and the peer never comes.
void plateauEmulatedNcclCallsNeverFinish(bool on);

// Not NCCL's: how many threads this process runs for connections of ranks
// in other processes (one per connection; each ends soon after its rank's
// process closes it). A test that forks waits for none: a thread busy at
// the fork may hold a lock of a library (the sanitizers' allocator has no
// fork handlers) that the child would inherit held.
int plateauEmulatedNcclConnectionThreads();

#endif  // PLATEAU_KERNELS_CUDA_EMULATED_NCCL_H_
