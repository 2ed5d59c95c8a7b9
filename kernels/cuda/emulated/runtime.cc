// The emulated CUDA runtime (cuda_runtime_api.h says what it models). One
// lock guards everything; stream work runs under it, one item at a time, so
// the SIMT emulation (one grid at a time) is never entered twice.
//
// A stream is a queue of items: work (a kernel, a copy, a free), a wait for
// another stream's event, or external work (emulation.h: EnqueueExternal,
// the emulated NCCL's collectives), which runs on another thread and keeps
// the stream's later items from running until it is done. A flush runs a
// stream's items up to a point or until one blocks (a wait whose stream is
// blocked, external work not yet done); the items stay queued until they
// finish, so a host call that must wait (a synchronise, a blocking copy)
// releases the lock while blocked and flushes again when external work
// finishes. When it does, the next external work whose stream can reach it
// starts (StartExternalsLocked), without waiting for a host call.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "kernels/cuda/emulated/cuda_runtime_api.h"
#include "kernels/cuda/emulated/emulation.h"
#include "kernels/cuda/simt_emulator.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace plateau::cuda_emulation {
// Work done off the stream (EnqueueExternal). Guarded by the runtime's lock.
struct External {
  std::function<bool(std::function<void()>)> start;
  bool started = false;
  bool done = false;
};
}  // namespace plateau::cuda_emulation

// The handles are pointers to these. Destroyed ones stay allocated (marked)
// so that a later use is an error, not a read of freed memory.
struct CUstream_st {
  int device = 0;
  bool destroyed = false;
  uint64_t enqueued = 0, executed = 0;  // sequence numbers
  struct Item {
    uint64_t seq = 0;
    std::function<void()> work;  // may be empty
    // A wait: done once `wait`'s items up to `wait_seq` are.
    CUstream_st* wait = nullptr;
    uint64_t wait_seq = 0;
    std::shared_ptr<plateau::cuda_emulation::External> external;
  };
  std::deque<Item> queue;
};
struct CUevent_st {
  int device = 0;
  bool destroyed = false;
  bool timing = true;             // made without cudaEventDisableTiming
  CUstream_st* stream = nullptr;  // of the last record; none: complete
  uint64_t seq = 0;
  // A timing event's last record, stamped when the stream ran it (the host's
  // steady clock: the emulation's "device" is the host).
  uint64_t ran_seq = 0;
  std::chrono::steady_clock::time_point ran_at;
};
struct CUmemPoolHandle_st {
  int device = 0;
  bool destroyed = false;
  size_t used = 0;
};

namespace plateau::cuda_emulation {
namespace {

constexpr size_t kAlign = 256;  // cudaMalloc's alignment
// Guard bands of 0xFF bytes before and after every allocation (beside the
// rounding's padding): a kernel that writes a row or a tile outside its
// buffer lands in one, and the free reports it, where it would otherwise
// corrupt the host heap or another buffer unseen (a GPU does not fault on
// a write that stays inside a mapped page either).
constexpr size_t kGuardBytes = 16 << 10;
constexpr int kDefaultSmem = 48 << 10;
constexpr int kOptinSmem = 227 << 10;  // sm_90's opt-in maximum

struct Device {
  int physical = 0;  // the machine's GPU this device is (CUDA_VISIBLE_DEVICES)
  size_t total = 0, used = 0;
  CUstream_st legacy;
};

struct Allocation {
  size_t bytes;
  cudaMemoryType type;
  int device;
  CUmemPoolHandle_st* pool;
  bool free_queued = false;  // cudaFreeAsync called, not yet run
};

struct Runtime {
  std::mutex mu;
  std::condition_variable external_done;  // some external work finished
  std::vector<std::unique_ptr<Device>> devices;
  // Every stream, event and pool ever created (destroyed ones marked, kept
  // so that a later use is an error rather than a use after free).
  std::vector<CUstream_st*> streams;
  std::vector<std::unique_ptr<CUevent_st>> events;
  std::vector<std::unique_ptr<CUmemPoolHandle_st>> pools;
  std::map<uintptr_t, Allocation> allocations;
  // cudaFuncSetAttribute's opt-in, per (device, kernel) as CUDA keeps it.
  std::map<std::pair<int, const void*>, int> max_dynamic_smem;
  cudaError_t sticky = cudaSuccess;
  simt::Schedule schedule = simt::Schedule::kShuffled;
};

}  // namespace

std::vector<int> VisibleDevices(const char* cuda_visible_devices, int gpus) {
  std::vector<int> visible;
  if (cuda_visible_devices == nullptr) {
    for (int d = 0; d < gpus; ++d) visible.push_back(d);
    return visible;
  }
  const std::string list = cuda_visible_devices;
  size_t at = 0;
  while (at < list.size()) {
    size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    std::string entry = list.substr(at, end - at);
    entry.erase(0, entry.find_first_not_of(" \t"));
    entry.erase(entry.find_last_not_of(" \t") + 1);
    // CUDA stops at the first entry that names no GPU (here: not an index
    // of one, or one named twice); the devices after it are not visible.
    if (entry.empty() || entry.size() > 6 ||
        entry.find_first_not_of("0123456789") != std::string::npos) {
      break;
    }
    const int physical = std::stoi(entry);
    if (physical >= gpus || std::count(visible.begin(), visible.end(), physical) != 0) break;
    visible.push_back(physical);
    at = end + 1;
  }
  return visible;
}

namespace {

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

Runtime* MakeRuntime() {
  auto* r = new Runtime;
  const int gpus = EnvInt("PLATEAU_EMULATED_GPUS", 1);
  const size_t mib = static_cast<size_t>(EnvInt("PLATEAU_EMULATED_GPU_MIB", 4096));
  for (int physical : VisibleDevices(std::getenv("CUDA_VISIBLE_DEVICES"), gpus)) {
    r->devices.push_back(std::make_unique<Device>());
    r->devices.back()->physical = physical;
    r->devices.back()->total = mib << 20;
    r->devices.back()->legacy.device = static_cast<int>(r->devices.size()) - 1;
  }
  // No GPU visible: every call that needs one fails, as CUDA's do.
  if (r->devices.empty()) r->sticky = cudaErrorNoDevice;
  const char* schedule = std::getenv("PLATEAU_SIMT_SCHEDULE");
  const std::string s = schedule != nullptr ? schedule : "";
  if (s == "in_order") r->schedule = simt::Schedule::kInOrder;
  if (s == "reversed") r->schedule = simt::Schedule::kReversed;
  return r;
}

// The runtime, made at its first use (so the environment is read then).
// Not a function-local static: a fork while another thread was inside its
// initialisation would leave the child waiting on a guard no thread of its
// own holds. first_use_mu is taken instead, and forks take it too (Forks).
std::mutex first_use_mu;
std::atomic<Runtime*> made{nullptr};

Runtime& R() {
  Runtime* r = made.load(std::memory_order_acquire);
  if (r != nullptr) return *r;
  std::lock_guard<std::mutex> first(first_use_mu);
  r = made.load(std::memory_order_relaxed);
  if (r == nullptr) {
    r = MakeRuntime();
    made.store(r, std::memory_order_release);
  }
  return *r;
}

thread_local int current_device = 0;
thread_local cudaError_t last_error = cudaSuccess;

// ---- Forks ------------------------------------------------------------------
//
// A thread that forks copies the runtime's lock as it is, and the child has
// none of the other threads to release it: a fork while another thread was
// in a call (the emulated NCCL's communicator setup asks PhysicalDevice)
// hung the child's first call. So a fork takes the lock first, waiting for
// the work running under it (work never forks), and both sides release it
// after. first_use_mu is taken before it: a runtime being made is finished
// first, and one not yet made is made by nobody until the fork is over.
// The emulated NCCL's and cuBLAS's fork handlers take their own locks; no
// thread waits for the runtime's lock holding one of those, and work under
// the runtime's lock takes only a communicator worker's lock, held with no
// other, so the handlers' order (registration order across files is not
// fixed) cannot deadlock. The child gets a new external_done: the waiters
// counted in the old one are the parent's threads, and a notify in the child
// could wait for them. What was in flight at the fork (queued work, external
// work whose threads are the parent's) is not the child's to finish: as in
// CUDA, a child uses none of its parent's communicators or busy streams, nor
// synchronises a whole device (cudaFree, cudaDeviceSynchronize) where a
// non-blocking communicator's operation was in flight.
// made changes only under first_use_mu, which the forking thread holds from
// the prepare handler to the after ones: all three see the same runtime.
void LockBeforeFork() {
  first_use_mu.lock();
  if (Runtime* r = made.load(std::memory_order_relaxed)) r->mu.lock();
}

void UnlockAfterForkInParent() {
  if (Runtime* r = made.load(std::memory_order_relaxed)) r->mu.unlock();
  first_use_mu.unlock();
}

void UnlockAfterForkInChild() {
  if (Runtime* r = made.load(std::memory_order_relaxed)) {
    new (&r->external_done) std::condition_variable;
  }
  UnlockAfterForkInParent();
}

// At load, before any thread of the runtime's callers exists.
const int fork_handlers =
    pthread_atfork(LockBeforeFork, UnlockAfterForkInParent, UnlockAfterForkInChild);

// Every failing call leaves its error for cudaGetLastError, as CUDA does.
cudaError_t Ret(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

CUstream_st* Resolve(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy) {
    if (R().devices.empty()) {  // no GPU: a stream no call can use
      static CUstream_st* none = [] {
        auto* n = new CUstream_st;
        n->destroyed = true;
        return n;
      }();
      return none;
    }
    return &R().devices[current_device]->legacy;
  }
  return s;
}

void StartExternalsLocked();

void FaultLocked(const std::string& why) {
  if (R().sticky == cudaSuccess) {
    std::fprintf(stderr, "[emulated CUDA] device fault: %s\n", why.c_str());
    R().sticky = cudaErrorLaunchFailure;
    // Calls waiting for external work return the fault now (their next
    // flush drops what is queued), not when that work is done.
    R().external_done.notify_all();
  }
}

// Hands external work to its thread (or, after a fault, tells it not to
// run); it is done at once if its start says there is nothing to do.
void StartLocked(const std::shared_ptr<External>& x, bool faulted) {
  x->started = true;
  if (faulted) {
    x->start(nullptr);
    x->done = true;
  } else {
    x->done = !x->start([x] {
      std::lock_guard<std::mutex> lock(R().mu);
      x->done = true;
      StartExternalsLocked();
      R().external_done.notify_all();
    });
  }
  x->start = nullptr;  // what it held is the other thread's now
}

// Runs `s`'s items up to sequence number `upto` (all of them: UINT64_MAX)
// or until one blocks; true if none is left before `upto`. A wait item
// flushes the other stream up to its event; external work is started when
// the stream reaches it and blocks the stream until done. After a fault the
// remaining items are dropped, as a faulted context runs nothing: external
// work not yet started is told so (start(nullptr)); work already started
// finishes on its own thread, unheeded.
bool FlushLocked(CUstream_st* s, uint64_t upto) {
  while (s->executed < upto && !s->queue.empty()) {
    CUstream_st::Item& front = s->queue.front();
    const bool faulted = R().sticky != cudaSuccess;
    if (!faulted && front.wait != nullptr && !FlushLocked(front.wait, front.wait_seq)) {
      return false;
    }
    External* x = front.external.get();
    if (x != nullptr && !x->started) StartLocked(front.external, faulted);
    if (x != nullptr && !x->done && !faulted) return false;
    CUstream_st::Item item = std::move(front);
    s->queue.pop_front();
    s->executed = item.seq;
    if (!faulted && item.work) item.work();
  }
  return s->executed >= upto || s->queue.empty();
}

// Starts every external work whose stream can now reach it (running the
// work ahead of it on that stream): after external work finishes, the next
// may start without any host call, as on a GPU, where a collective does not
// wait for the host to look. Other work stays lazy.
void StartExternalsLocked() {
  bool started = true;
  while (started) {
    started = false;
    auto start = [&](CUstream_st* s) {
      for (const CUstream_st::Item& item : s->queue) {
        if (item.external == nullptr || item.external->started) continue;
        const std::shared_ptr<External> x = item.external;  // the flush may pop the item
        FlushLocked(s, item.seq);
        started = started || x->started;
        return;
      }
    };
    for (auto& d : R().devices) start(&d->legacy);
    for (CUstream_st* s : R().streams) start(s);
  }
}

// FlushLocked, waiting (the lock released) while external work blocks it.
void FlushWaitingLocked(std::unique_lock<std::mutex>& lock, CUstream_st* s, uint64_t upto) {
  while (!FlushLocked(s, upto)) R().external_done.wait(lock);
}

// Everything queued on `device` (what its streams wait for on other
// devices runs too, through their wait items).
void FlushDeviceLocked(std::unique_lock<std::mutex>& lock, int device) {
  for (;;) {
    bool all = FlushLocked(&R().devices[device]->legacy, UINT64_MAX);
    for (CUstream_st* s : R().streams) {
      if (s->device == device) all = FlushLocked(s, UINT64_MAX) && all;
    }
    if (all) return;
    R().external_done.wait(lock);
  }
}

cudaError_t EnqueueLocked(CUstream_st* s, CUstream_st::Item item) {
  if (R().sticky != cudaSuccess) return R().sticky;
  if (s->destroyed) return cudaErrorInvalidResourceHandle;
  item.seq = ++s->enqueued;
  s->queue.push_back(std::move(item));
  return cudaSuccess;
}

cudaError_t EnqueueLocked(CUstream_st* s, std::function<void()> work) {
  CUstream_st::Item item;
  item.work = std::move(work);
  return EnqueueLocked(s, std::move(item));
}

const Allocation* Find(const void* p, uintptr_t* start) {
  auto& allocations = R().allocations;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return nullptr;
  --it;
  if (a >= it->first + std::max<size_t>(it->second.bytes, 1)) return nullptr;
  if (start != nullptr) *start = it->first;
  return &it->second;
}

// Device memory starts as 0xFF bytes (NaN as float and bf16) and is filled
// again when freed, so a read of memory never written, or already freed,
// shows in the results.
cudaError_t AllocateLocked(void** p, size_t bytes, cudaMemoryType type,
                           CUmemPoolHandle_st* pool) {
  if (p == nullptr) return cudaErrorInvalidValue;
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  Device& d = *R().devices[current_device];
  if (type == cudaMemoryTypeDevice && bytes > d.total - d.used) return cudaErrorMemoryAllocation;
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  char* base = static_cast<char*>(std::aligned_alloc(kAlign, kGuardBytes + rounded + kGuardBytes));
  if (base == nullptr) return cudaErrorMemoryAllocation;
  std::memset(base, 0xFF, kGuardBytes + rounded + kGuardBytes);
  char* memory = base + kGuardBytes;
#if defined(__SANITIZE_ADDRESS__)
  // The guard bands and the rounding's padding: an access outside `bytes`
  // is an ASan report.
  __asan_poison_memory_region(base, kGuardBytes);
  __asan_poison_memory_region(memory + bytes, rounded - bytes + kGuardBytes);
#endif
  if (type == cudaMemoryTypeDevice) d.used += bytes;
  if (pool != nullptr) pool->used += bytes;
  R().allocations[reinterpret_cast<uintptr_t>(memory)] = {bytes, type, current_device, pool};
  *p = memory;
  return cudaSuccess;
}

cudaError_t FreeLocked(void* p, cudaMemoryType type) {
  if (p == nullptr) return cudaSuccess;
  auto it = R().allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == R().allocations.end() || it->second.type != type) {
    return type == cudaMemoryTypeDevice ? cudaErrorInvalidDevicePointer : cudaErrorInvalidValue;
  }
  const Allocation a = it->second;
  if (type == cudaMemoryTypeDevice) R().devices[a.device]->used -= a.bytes;
  if (a.pool != nullptr) a.pool->used -= a.bytes;
  const size_t rounded = (a.bytes + kAlign - 1) / kAlign * kAlign;
  unsigned char* bytes = static_cast<unsigned char*>(p);
  unsigned char* base = bytes - kGuardBytes;
#if defined(__SANITIZE_ADDRESS__)
  __asan_unpoison_memory_region(base, kGuardBytes);
  __asan_unpoison_memory_region(bytes + a.bytes, rounded - a.bytes + kGuardBytes);
#endif
  // The guard bands and padding still as allocated, or something wrote
  // outside the allocation: a fault here (reported from this call on).
  size_t after = 0, before = 0;
  while (after < rounded - a.bytes + kGuardBytes && bytes[a.bytes + after] == 0xFF) ++after;
  while (before < kGuardBytes && bytes[-1 - static_cast<ptrdiff_t>(before)] == 0xFF) ++before;
  const bool overrun = after < rounded - a.bytes + kGuardBytes || before < kGuardBytes;
  if (after < rounded - a.bytes + kGuardBytes) {
    FaultLocked("a write at byte " + std::to_string(after) + " past the end of a " +
                std::to_string(a.bytes) + "-byte allocation");
  } else if (before < kGuardBytes) {
    FaultLocked("a write " + std::to_string(before + 1) + " bytes before the start of a " +
                std::to_string(a.bytes) + "-byte allocation");
  }
  std::memset(p, 0xFF, a.bytes);
  std::free(base);
  R().allocations.erase(it);
  return overrun ? R().sticky : cudaSuccess;
}

// Pageable host memory: everything the runtime did not allocate.
bool IsPageable(const void* p) { return Find(p, nullptr) == nullptr; }

// A kernel's dynamic shared memory limit on the current device: its opt-in
// (cudaFuncSetAttribute), else the 48 KiB default.
int DynamicSmemLimit(const void* kernel) {
  auto it = R().max_dynamic_smem.find({current_device, kernel});
  return it != R().max_dynamic_smem.end() ? it->second : kDefaultSmem;
}

}  // namespace

cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work) {
  std::lock_guard<std::mutex> lock(R().mu);
  return EnqueueLocked(Resolve(stream), std::move(work));
}

cudaError_t EnqueueExternal(cudaStream_t stream,
                            std::function<bool(std::function<void()> done)> start) {
  std::lock_guard<std::mutex> lock(R().mu);
  CUstream_st* s = Resolve(stream);
  CUstream_st::Item item;
  item.external = std::make_shared<External>();
  item.external->start = std::move(start);
  const cudaError_t e = EnqueueLocked(s, std::move(item));
  if (e == cudaSuccess) FlushLocked(s, UINT64_MAX);  // starts it if nothing is ahead
  return e;
}

cudaError_t Flush(cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(R().mu);
  FlushWaitingLocked(lock, Resolve(stream), UINT64_MAX);
  return R().sticky;
}

void Fault(const std::string& why) { FaultLocked(why); }

int CurrentDevice() { return current_device; }

int PhysicalDevice(int device) {
  std::lock_guard<std::mutex> lock(R().mu);
  if (device < 0 || device >= static_cast<int>(R().devices.size())) return -1;
  return R().devices[device]->physical;
}

int StreamDevice(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(R().mu);
  if (stream == nullptr || stream == cudaStreamLegacy) return current_device;
  for (CUstream_st* s : R().streams) {
    if (s == stream) return s->destroyed ? -1 : s->device;
  }
  return -1;
}

}  // namespace plateau::cuda_emulation

namespace plateau::simt {

cudaError_t LaunchKernel(const void* kernel, const char* name, dim3 grid, dim3 block,
                         size_t smem_bytes, cudaStream_t stream, std::function<void()> body) {
  using namespace cuda_emulation;
  std::lock_guard<std::mutex> lock(R().mu);
  if (R().sticky != cudaSuccess) return Ret(R().sticky);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535 || block.x == 0 || block.x * block.y * block.z > 1024) {
    return Ret(cudaErrorInvalidConfiguration);
  }
  if (block.y != 1 || block.z != 1 || block.x % 32 != 0) {
    std::fprintf(stderr, "[emulated CUDA] %s: the emulation runs 1-D blocks of whole warps\n",
                 name);
    return Ret(cudaErrorNotSupported);
  }
  const int smem_limit = DynamicSmemLimit(kernel);
  if (smem_bytes > static_cast<size_t>(smem_limit)) return Ret(cudaErrorInvalidValue);
  CUstream_st* s = Resolve(stream);
  // A launch goes to a stream of the current device, as CUDA requires.
  if (s->destroyed || s->device != current_device) return Ret(cudaErrorInvalidResourceHandle);
  const std::string kernel_name = name;
  const Schedule schedule = R().schedule;
  const SimtDim3 g{grid.x, grid.y, grid.z};
  const int threads = static_cast<int>(block.x), smem = static_cast<int>(smem_bytes);
  return Ret(EnqueueLocked(s, [=] {
    // Static __shared__ arrays count against the same limit as on a GPU.
    const std::string failure = RunGrid(g, threads, smem, schedule, body, smem_limit);
    if (!failure.empty()) FaultLocked(kernel_name + ": " + failure);
  }));
}

}  // namespace plateau::simt

using plateau::cuda_emulation::current_device;
using plateau::cuda_emulation::kDefaultSmem;
using plateau::cuda_emulation::kOptinSmem;
using plateau::cuda_emulation::last_error;
using plateau::cuda_emulation::R;
using plateau::cuda_emulation::Ret;

namespace {

struct ErrorText {
  cudaError_t error;
  const char* name;
  const char* text;
};
constexpr ErrorText kErrors[] = {
#define PLATEAU_CUDA_ERROR_TEXT(name, value, text) {name, #name, text},
    PLATEAU_CUDA_ERRORS(PLATEAU_CUDA_ERROR_TEXT)
#undef PLATEAU_CUDA_ERROR_TEXT
};

const ErrorText& Text(cudaError_t e) {
  for (const ErrorText& t : kErrors) {
    if (t.error == e) return t;
  }
  return kErrors[sizeof(kErrors) / sizeof(kErrors[0]) - 1];
}

bool BadDevice(int device) {
  return device < 0 || device >= static_cast<int>(R().devices.size());
}

}  // namespace

#define PLATEAU_EMULATED_LOCK std::unique_lock<std::mutex> plateau_lock_(R().mu)
#define PLATEAU_EMULATED_STICKY \
  if (R().sticky != cudaSuccess) return Ret(R().sticky)

const char* cudaGetErrorName(cudaError_t error) { return Text(error).name; }
const char* cudaGetErrorString(cudaError_t error) { return Text(error).text; }

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return Ret(cudaErrorInvalidValue);
  *version = 13000;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return Ret(cudaErrorInvalidValue);
  *version = 13000;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  PLATEAU_EMULATED_LOCK;
  if (R().sticky != cudaSuccess) return R().sticky;
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() {
  PLATEAU_EMULATED_LOCK;
  return R().sticky != cudaSuccess ? R().sticky : last_error;
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Ret(cudaErrorInvalidValue);
  PLATEAU_EMULATED_LOCK;
  *count = static_cast<int>(R().devices.size());
  return R().devices.empty() ? Ret(cudaErrorNoDevice) : cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  PLATEAU_EMULATED_LOCK;
  if (BadDevice(device)) return Ret(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return Ret(cudaErrorInvalidValue);
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  PLATEAU_EMULATED_LOCK;
  if (prop == nullptr) return Ret(cudaErrorInvalidValue);
  if (BadDevice(device)) return Ret(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "SIMT emulation on the CPU");
  prop->totalGlobalMem = R().devices[device]->total;
  prop->sharedMemPerBlock = kDefaultSmem;
  prop->sharedMemPerBlockOptin = kOptinSmem;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->maxThreadsPerBlock = 1024;
  prop->clockRate = 1980000;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  PLATEAU_EMULATED_LOCK;
  if (value == nullptr) return Ret(cudaErrorInvalidValue);
  if (BadDevice(device)) return Ret(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor:  // an sm_90, as cudaGetDeviceProperties says
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = kOptinSmem;
      return cudaSuccess;
    case cudaDevAttrMemoryPoolsSupported:
      *value = 1;
      return cudaSuccess;
  }
  return Ret(cudaErrorInvalidValue);
}

cudaError_t cudaDeviceSynchronize() {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  plateau::cuda_emulation::FlushDeviceLocked(plateau_lock_, current_device);
  return Ret(R().sticky);
}

cudaError_t cudaDeviceReset() {
  // Not emulated: nothing here resets, and the backend never calls it.
  return Ret(cudaErrorNotSupported);
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (free_bytes == nullptr || total_bytes == nullptr) return Ret(cudaErrorInvalidValue);
  const auto& d = *R().devices[current_device];
  *total_bytes = d.total;
  *free_bytes = d.total - d.used;
  return cudaSuccess;
}

// cudaFree (and cudaFreeHost) synchronise with the device, as CUDA's do.
cudaError_t cudaMalloc(void** p, size_t bytes) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  return Ret(plateau::cuda_emulation::AllocateLocked(p, bytes, cudaMemoryTypeDevice, nullptr));
}

cudaError_t cudaFree(void* p) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  plateau::cuda_emulation::FlushDeviceLocked(plateau_lock_, current_device);
  auto it = R().allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it != R().allocations.end() && it->second.free_queued) {
    return Ret(cudaErrorInvalidDevicePointer);
  }
  return Ret(plateau::cuda_emulation::FreeLocked(p, cudaMemoryTypeDevice));
}

cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned /*flags*/) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  return Ret(plateau::cuda_emulation::AllocateLocked(p, bytes, cudaMemoryTypeHost, nullptr));
}

cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }

cudaError_t cudaFreeHost(void* p) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  plateau::cuda_emulation::FlushDeviceLocked(plateau_lock_, current_device);
  return Ret(plateau::cuda_emulation::FreeLocked(p, cudaMemoryTypeHost));
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  PLATEAU_EMULATED_LOCK;
  if (attr == nullptr) return Ret(cudaErrorInvalidValue);
  std::memset(attr, 0, sizeof(*attr));
  uintptr_t start = 0;
  const plateau::cuda_emulation::Allocation* a = plateau::cuda_emulation::Find(p, &start);
  attr->type = a != nullptr ? a->type : cudaMemoryTypeUnregistered;
  attr->device = a != nullptr ? a->device : -2;
  if (a != nullptr && a->type == cudaMemoryTypeDevice) attr->devicePointer = const_cast<void*>(p);
  if (a != nullptr && a->type == cudaMemoryTypeHost) {
    attr->devicePointer = attr->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}

cudaError_t cudaMemPoolCreate(cudaMemPool_t* pool, const cudaMemPoolProps* props) {
  PLATEAU_EMULATED_LOCK;
  if (pool == nullptr || props == nullptr || props->allocType != cudaMemAllocationTypePinned ||
      props->location.type != cudaMemLocationTypeDevice || BadDevice(props->location.id)) {
    return Ret(cudaErrorInvalidValue);
  }
  R().pools.push_back(std::make_unique<CUmemPoolHandle_st>());
  *pool = R().pools.back().get();
  (*pool)->device = props->location.id;
  return cudaSuccess;
}

cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
  PLATEAU_EMULATED_LOCK;
  if (pool == nullptr || pool->destroyed) return Ret(cudaErrorInvalidValue);
  pool->destroyed = true;  // what it still holds is freed when freed
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  PLATEAU_EMULATED_LOCK;
  if (pool == nullptr || pool->destroyed || value == nullptr) return Ret(cudaErrorInvalidValue);
  return attr == cudaMemPoolAttrReleaseThreshold ? cudaSuccess : Ret(cudaErrorInvalidValue);
}

// Memory comes back to the device when its free runs, so what the pool
// holds (reserved) is what is in use.
cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  PLATEAU_EMULATED_LOCK;
  if (pool == nullptr || pool->destroyed || value == nullptr) return Ret(cudaErrorInvalidValue);
  switch (attr) {
    case cudaMemPoolAttrReservedMemCurrent:
    case cudaMemPoolAttrUsedMemCurrent:
      *static_cast<uint64_t*>(value) = pool->used;
      return cudaSuccess;
    default:
      return Ret(cudaErrorInvalidValue);
  }
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t /*keep_bytes*/) {
  PLATEAU_EMULATED_LOCK;
  return pool == nullptr || pool->destroyed ? Ret(cudaErrorInvalidValue) : cudaSuccess;
}

// Stream-ordered allocation: the memory exists at once (CUDA's may be
// reused memory whose earlier frees in stream order have run); the free
// runs in stream order.
cudaError_t cudaMallocFromPoolAsync(void** p, size_t bytes, cudaMemPool_t pool,
                                    cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (pool == nullptr || pool->destroyed) return Ret(cudaErrorInvalidValue);
  if (plateau::cuda_emulation::Resolve(stream)->destroyed) {
    return Ret(cudaErrorInvalidResourceHandle);
  }
  return Ret(plateau::cuda_emulation::AllocateLocked(p, bytes, cudaMemoryTypeDevice, pool));
}

cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (plateau::cuda_emulation::Resolve(stream)->destroyed) {
    return Ret(cudaErrorInvalidResourceHandle);
  }
  return Ret(plateau::cuda_emulation::AllocateLocked(p, bytes, cudaMemoryTypeDevice, nullptr));
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (p == nullptr) return cudaSuccess;
  auto it = R().allocations.find(reinterpret_cast<uintptr_t>(p));
  // A second free of the same pointer is refused at the call, as CUDA does.
  if (it == R().allocations.end() || it->second.type != cudaMemoryTypeDevice ||
      it->second.free_queued) {
    return Ret(cudaErrorInvalidDevicePointer);
  }
  const cudaError_t e = plateau::cuda_emulation::EnqueueLocked(
      plateau::cuda_emulation::Resolve(stream), [p] {
        if (plateau::cuda_emulation::FreeLocked(p, cudaMemoryTypeDevice) ==
            cudaErrorInvalidDevicePointer) {
          plateau::cuda_emulation::FaultLocked("cudaFreeAsync of memory no longer allocated");
        }
      });
  if (e == cudaSuccess) it->second.free_queued = true;
  return Ret(e);
}

// A blocking copy: ordered after the legacy stream's work only (the
// backend's streams are non-blocking, so CUDA does not wait for them
// either).
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind /*kind*/) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  plateau::cuda_emulation::FlushWaitingLocked(plateau_lock_, &R().devices[current_device]->legacy,
                                              UINT64_MAX);
  if (bytes > 0 && (dst == nullptr || src == nullptr)) return Ret(cudaErrorInvalidValue);
  if (bytes > 0) std::memmove(dst, src, bytes);
  return Ret(R().sticky);
}

// From or to pageable host memory the copy is synchronous, as CUDA's is
// (it waits for the stream's earlier work, then copies before returning);
// between pinned host and device memory it runs in stream order.
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind /*kind*/,
                            cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return Ret(cudaErrorInvalidValue);
  CUstream_st* s = plateau::cuda_emulation::Resolve(stream);
  if (s->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  if (plateau::cuda_emulation::IsPageable(dst) || plateau::cuda_emulation::IsPageable(src)) {
    plateau::cuda_emulation::FlushWaitingLocked(plateau_lock_, s, UINT64_MAX);
    if (R().sticky == cudaSuccess) std::memmove(dst, src, bytes);
    return Ret(R().sticky);
  }
  return Ret(plateau::cuda_emulation::EnqueueLocked(
      s, [dst, src, bytes] { std::memmove(dst, src, bytes); }));
}

// On the legacy stream, after its earlier work.
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (bytes == 0) return cudaSuccess;
  if (p == nullptr) return Ret(cudaErrorInvalidValue);
  plateau::cuda_emulation::FlushWaitingLocked(plateau_lock_, &R().devices[current_device]->legacy,
                                              UINT64_MAX);
  if (R().sticky == cudaSuccess) std::memset(p, value, bytes);
  return Ret(R().sticky);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (bytes == 0) return cudaSuccess;
  if (p == nullptr) return Ret(cudaErrorInvalidValue);
  return Ret(plateau::cuda_emulation::EnqueueLocked(
      plateau::cuda_emulation::Resolve(stream),
      [p, value, bytes] { std::memset(p, value, bytes); }));
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned /*flags*/) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (stream == nullptr) return Ret(cudaErrorInvalidValue);
  *stream = new CUstream_st;
  (*stream)->device = current_device;
  R().streams.push_back(*stream);
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

// CUDA lets queued work finish after the destroy; here what can run now
// runs first, and what waits behind external work runs when it can (its
// external work starts by itself; the rest with the next device-wide wait).
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  if (stream == nullptr || stream == cudaStreamLegacy || stream->destroyed) {
    return Ret(cudaErrorInvalidResourceHandle);
  }
  plateau::cuda_emulation::FlushLocked(stream, UINT64_MAX);
  stream->destroyed = true;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  CUstream_st* s = plateau::cuda_emulation::Resolve(stream);
  if (s->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  plateau::cuda_emulation::FlushWaitingLocked(plateau_lock_, s, UINT64_MAX);
  return Ret(R().sticky);
}

// A query that finds work still queued answers cudaErrorNotReady, as for a
// GPU busy with it, and the work then runs: the next query answers
// cudaSuccess, so a loop that polls makes progress.
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  CUstream_st* s = plateau::cuda_emulation::Resolve(stream);
  if (s->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  const bool pending = !s->queue.empty();
  plateau::cuda_emulation::FlushLocked(s, UINT64_MAX);
  if (R().sticky != cudaSuccess) return Ret(R().sticky);
  return pending ? cudaErrorNotReady : cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned /*flags*/) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (event == nullptr || event->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  CUstream_st* s = plateau::cuda_emulation::Resolve(stream);
  if (event->stream == nullptr) return s->destroyed ? Ret(cudaErrorInvalidResourceHandle)
                                                    : cudaSuccess;
  // The event's record as of now: a later record does not move this wait.
  CUstream_st::Item wait;
  wait.wait = event->stream;
  wait.wait_seq = event->seq;
  return Ret(plateau::cuda_emulation::EnqueueLocked(s, std::move(wait)));
}

cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device) {
  PLATEAU_EMULATED_LOCK;
  if (device == nullptr) return Ret(cudaErrorInvalidValue);
  CUstream_st* s = plateau::cuda_emulation::Resolve(stream);
  if (s->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  *device = s->device;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (event == nullptr) return Ret(cudaErrorInvalidValue);
  R().events.push_back(std::make_unique<CUevent_st>());
  *event = R().events.back().get();
  (*event)->device = current_device;
  (*event)->timing = (flags & cudaEventDisableTiming) == 0;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  PLATEAU_EMULATED_LOCK;
  if (event == nullptr || event->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  event->destroyed = true;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  PLATEAU_EMULATED_LOCK;
  PLATEAU_EMULATED_STICKY;
  if (event == nullptr || event->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  CUstream_st* s = plateau::cuda_emulation::Resolve(stream);
  // The event and the stream belong to one device, as CUDA requires.
  if (event->device != s->device) return Ret(cudaErrorInvalidResourceHandle);
  CUstream_st::Item item;
  if (event->timing) {
    // Events are never freed (destroyed ones are only marked), so the
    // pointer outlives the item. A later record replaces this one's stamp.
    const uint64_t seq = s->enqueued + 1;
    item.work = [event, s, seq] {
      if (event->stream != s || event->seq != seq) return;
      event->ran_seq = seq;
      event->ran_at = std::chrono::steady_clock::now();
    };
  }
  const bool idle = s->queue.empty();
  const cudaError_t e = plateau::cuda_emulation::EnqueueLocked(s, std::move(item));
  if (e != cudaSuccess) return Ret(e);
  event->stream = s;
  event->seq = s->enqueued;
  // On a GPU a point recorded on an idle stream has run at once (a lazy
  // stamp, at the next flush, would time it late). Only the record item
  // runs: queued work stays lazy.
  if (idle) plateau::cuda_emulation::FlushLocked(s, s->enqueued);
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  PLATEAU_EMULATED_LOCK;
  if (event == nullptr || event->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  if (event->stream != nullptr) {
    plateau::cuda_emulation::FlushWaitingLocked(plateau_lock_, event->stream, event->seq);
  }
  return Ret(R().sticky);
}

// As cudaStreamQuery: cudaErrorNotReady once while the recorded work is
// queued (it then runs).
cudaError_t cudaEventQuery(cudaEvent_t event) {
  PLATEAU_EMULATED_LOCK;
  if (event == nullptr || event->destroyed) return Ret(cudaErrorInvalidResourceHandle);
  const bool pending = event->stream != nullptr && event->stream->executed < event->seq;
  if (pending) plateau::cuda_emulation::FlushLocked(event->stream, event->seq);
  if (R().sticky != cudaSuccess) return Ret(R().sticky);
  return pending ? cudaErrorNotReady : cudaSuccess;
}

// As CUDA's: an invalid handle for an event never recorded, made with
// cudaEventDisableTiming, or of another device than the other;
// cudaErrorNotReady while either point is queued (which, as cudaEventQuery,
// runs it). Times are the host's.
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  PLATEAU_EMULATED_LOCK;
  if (ms == nullptr) return Ret(cudaErrorInvalidValue);
  for (cudaEvent_t e : {start, end}) {
    if (e == nullptr || e->destroyed || !e->timing || e->stream == nullptr) {
      return Ret(cudaErrorInvalidResourceHandle);
    }
  }
  if (start->device != end->device) return Ret(cudaErrorInvalidResourceHandle);
  bool pending = false;
  for (cudaEvent_t e : {start, end}) {
    if (e->stream->executed < e->seq) {
      pending = true;
      plateau::cuda_emulation::FlushLocked(e->stream, e->seq);
    }
  }
  if (R().sticky != cudaSuccess) return Ret(R().sticky);
  if (pending || start->ran_seq != start->seq || end->ran_seq != end->seq) {
    return Ret(cudaErrorNotReady);
  }
  *ms = std::chrono::duration<float, std::milli>(end->ran_at - start->ran_at).count();
  return cudaSuccess;
}

cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void* fn) {
  PLATEAU_EMULATED_LOCK;
  if (attributes == nullptr || fn == nullptr) return Ret(cudaErrorInvalidValue);
  std::memset(attributes, 0, sizeof(*attributes));
  attributes->maxDynamicSharedSizeBytes = plateau::cuda_emulation::DynamicSmemLimit(fn);
  attributes->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, const void* func,
                                                          int blockSize, size_t dynamicSMemSize) {
  PLATEAU_EMULATED_LOCK;
  if (numBlocks == nullptr || func == nullptr || blockSize <= 0 || blockSize > 1024) {
    return Ret(cudaErrorInvalidValue);
  }
  *numBlocks = 0;
  if (dynamicSMemSize > static_cast<size_t>(plateau::cuda_emulation::DynamicSmemLimit(func))) {
    return cudaSuccess;
  }
  constexpr int64_t kSmemPerSm = 228 << 10, kReservedPerBlock = 1 << 10;
  constexpr int64_t kRegistersPerSm = 64 << 10, kWarpRegisters = 256 * 32;  // 255, granule 256
  const int64_t warps = (blockSize + 31) / 32;
  const int64_t by_smem = kSmemPerSm / (static_cast<int64_t>(dynamicSMemSize) + kReservedPerBlock);
  const int64_t by_threads = 2048 / (warps * 32);
  const int64_t by_registers = kRegistersPerSm / (warps * kWarpRegisters);
  *numBlocks = static_cast<int>(std::min({by_smem, by_threads, by_registers, int64_t{32}}));
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* fn, cudaFuncAttribute attr, int value) {
  PLATEAU_EMULATED_LOCK;
  if (fn == nullptr || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value > kOptinSmem) {
    return Ret(cudaErrorInvalidValue);
  }
  R().max_dynamic_smem[{current_device, fn}] = value;
  return cudaSuccess;
}
