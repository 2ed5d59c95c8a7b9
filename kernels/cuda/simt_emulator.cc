#include "kernels/cuda/simt_emulator.h"

#include <sys/mman.h>

#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

SimtDim3 threadIdx, blockIdx, blockDim, gridDim;

// The context switch: saves the callee-saved registers, the SSE and x87
// control words and the stack pointer of the running context in *from,
// and resumes the one whose stack pointer is `to`. glibc's swapcontext does
// the same plus two signal-mask system calls, which made a grid of a
// million threads take minutes.
extern "C" void plateau_simt_switch(void** from, void* to);
asm(R"(
  .pushsection .text
  .globl plateau_simt_switch
  .type plateau_simt_switch, @function
plateau_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size plateau_simt_switch, .-plateau_simt_switch
  .popsection
)");

namespace plateau::simt {
namespace {

constexpr size_t kGuardBytes = 4096;
constexpr size_t kStackBytes = 256 << 10;
// The inaccessible guard below each stack: larger than any frame the
// kernels have, so an overflow cannot step over it into the next stack.
constexpr size_t kStackGuardBytes = 64 << 10;
constexpr int kMaxWarps = 32;

enum class Wait { kNone, kWarp, kWarpgroup, kBlock };

// A thread's stack: mapped once and reused by every block (a fresh
// zero-filled stack per thread per block cost more than most kernels), with
// an inaccessible guard below it so an overflow faults rather than writing
// into the next stack.
class Stack {
 public:
  Stack() {
    base_ = static_cast<char*>(mmap(nullptr, kStackBytes + kStackGuardBytes,
                                    PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (base_ == MAP_FAILED) std::abort();
    mprotect(base_, kStackGuardBytes, PROT_NONE);
  }
  ~Stack() { munmap(base_, kStackBytes + kStackGuardBytes); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;

  // The stack pointer that plateau_simt_switch resumes into `entry`: six
  // zeroed callee-saved registers, the default control words below them,
  // `entry` as the return address and a null one above it, so that `entry`
  // starts with the stack aligned as if it had been called.
  void* Start(void (*entry)()) {
    char* top = base_ + kStackGuardBytes + kStackBytes;
#if defined(__SANITIZE_ADDRESS__)
    // A thread stopped mid-kernel (a failed block) leaves its frames'
    // redzones poisoned.
    __asan_unpoison_memory_region(base_ + kStackGuardBytes, kStackBytes);
#endif
    uint64_t* sp = reinterpret_cast<uint64_t*>(top) - 9;
    const uint32_t control[2] = {0x1F80u, 0x037Fu};  // MXCSR, x87 control word
    std::memcpy(sp, control, 8);
    for (int i = 1; i <= 6; ++i) sp[i] = 0;
    sp[7] = reinterpret_cast<uint64_t>(entry);
    sp[8] = 0;
    return sp;
  }

 private:
  char* base_;
};

// A cp.async its thread has not waited for yet (landed already under
// CopyLanding::kAtIssue).
struct PendingCopy {
  unsigned char* dst;
  const unsigned char* src;
  int src_bytes;
  uint64_t group;  // the thread's commits before it was issued
  bool landed;
};

struct Thread {
  void* sp = nullptr;  // saved while switched out
  bool done = false;
  Wait wait = Wait::kNone;
  uint64_t generation = 0;  // of the barrier it waits at
  std::vector<PendingCopy> copies;  // in issue order
  uint64_t committed = 0;           // cp.async groups committed
  // 16-byte chunks of dynamic shared memory its landed copies wrote that
  // it has not fenced for the async proxy yet (FenceProxyAsync).
  std::vector<size_t> unfenced;
};

struct Warp {
  uint64_t generation = 0;
  int arrived = 0, kind = 0;
  uint32_t scratch[32][8];
};

// One wgmma as issued: what every thread of the warpgroup passed.
struct Wgmma {
  uint64_t group;  // the warpgroup's commits before it was issued
  float* d[128];
  const uint32_t* a[128];  // A's registers; null when A is in shared memory
  uint64_t a_desc, b_desc;
  bool a_mn_major, b_mn_major, accumulate;
};

struct Warpgroup {
  uint64_t generation = 0;
  int arrived = 0, kind = 0;
  Wgmma issuing;  // each thread's d and a at the issue
  // Each thread's descriptors and flags (bit 0: A in registers, 1, 2: A's,
  // B's MN-major, 3: accumulate), which must agree.
  uint64_t a_desc[128], b_desc[128];
  int flags[128];
  std::vector<Wgmma> pending;  // issued, not completed; in issue order
  uint64_t committed = 0;
  bool fenced = false;  // a wgmma.fence since the start or the last wait
};

struct State {
  std::vector<std::unique_ptr<Stack>> stacks;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  std::vector<Warpgroup> warpgroups;
  // Per 16-byte chunk of dynamic shared memory: 1 + the thread whose landed
  // cp.async wrote it and has not fenced it for the async proxy, or 0.
  std::vector<int> chunk_writer;
  // Chunks fenced by their writer but with no block barrier since: another
  // thread's wgmma may not see them yet (the emulation's rule: stricter
  // than what the PTX ISA may allow within one warpgroup, and what the
  // kernels keep).
  std::vector<size_t> unpublished;
  std::vector<char> chunk_unpublished;
  uint64_t block_generation = 0;
  int block_arrived = 0;
  int block_or = 0;  // __syncthreads_or's running value
  int block_or_result = 0;
  bool progressed = false;  // a collective completed since the last pick
  void* scheduler_sp = nullptr;
  int current = -1;
  const std::function<void()>* body = nullptr;
  std::vector<unsigned char> shared;
  std::map<const void*, std::vector<unsigned char>> static_shared;
  std::string failure;
  CopyLanding landing = CopyLanding::kAtWait;
  WgmmaCompletion completion = WgmmaCompletion::kAtWait;
};
State state;

void Fail(const std::string& what) {
  if (state.failure.empty()) state.failure = what;
}

void YieldToScheduler() {
  plateau_simt_switch(&state.threads[state.current].sp, state.scheduler_sp);
}

bool Runnable(int t) {
  const Thread& th = state.threads[t];
  if (th.done) return false;
  switch (th.wait) {
    case Wait::kWarp:
      return state.warps[t / 32].generation != th.generation;
    case Wait::kWarpgroup:
      return state.warpgroups[t / 128].generation != th.generation;
    case Wait::kBlock:
      return state.block_generation != th.generation;
    case Wait::kNone:
      return true;
  }
  return true;
}

// Each thread starts here and, done, switches back for good.
void Entry() {
  (*state.body)();
  if (!state.threads[state.current].copies.empty()) {
    Fail("a thread ended with cp.async copies it never waited for");
  }
  if (state.current / 128 < static_cast<int>(state.warpgroups.size()) &&
      !state.warpgroups[state.current / 128].pending.empty()) {
    Fail("a warpgroup ended with wgmma it never waited for");
  }
  state.threads[state.current].done = true;
  YieldToScheduler();
  std::abort();  // never resumed
}

// Runs one block: always the first runnable thread in `order`, as far as it
// goes. Threads before the last pick stay blocked or done until a
// collective completes, so the scan resumes from there and restarts only
// then (linear in the threads for a kernel without collectives).
std::string RunBlock(int threads, const std::vector<int>& order) {
  while (static_cast<int>(state.stacks.size()) < threads) {
    state.stacks.push_back(std::make_unique<Stack>());
  }
  state.threads.assign(threads, Thread());
  state.warps.assign((threads + 31) / 32, Warp());
  state.warpgroups.assign(threads / 128, Warpgroup());
  state.chunk_writer.assign(state.shared.size() / 16, 0);
  state.chunk_unpublished.assign(state.shared.size() / 16, 0);
  state.unpublished.clear();
  state.block_generation = 0;
  state.block_arrived = 0;
  state.block_or = 0;
  state.static_shared.clear();
  for (int t = 0; t < threads; ++t) state.threads[t].sp = state.stacks[t]->Start(Entry);
  size_t cursor = 0;
  for (;;) {
    if (state.progressed) {
      state.progressed = false;
      cursor = 0;
    }
    while (cursor < order.size() && !Runnable(order[cursor])) ++cursor;
    if (cursor == order.size()) break;
    const int pick = order[cursor];
    state.current = pick;
    threadIdx = {static_cast<unsigned>(pick), 0, 0};
    state.threads[pick].wait = Wait::kNone;
    plateau_simt_switch(&state.scheduler_sp, state.threads[pick].sp);
  }
  for (const Thread& th : state.threads) {
    if (!th.done) {
      Fail("deadlock: a barrier or warp collective that not every thread reached");
      break;
    }
  }
  for (const auto& [key, bytes] : state.static_shared) {
    for (size_t i = bytes.size() - kGuardBytes; i < bytes.size(); ++i) {
      if (bytes[i] != 0xFF) {
        Fail("a write past a __shared__ array");
        break;
      }
    }
  }
  return state.failure;
}

}  // namespace

unsigned char* SharedMemory() { return state.shared.data(); }

unsigned char* StaticShared(const void* key, size_t bytes) {
  std::vector<unsigned char>& memory = state.static_shared[key];
  if (memory.empty()) memory.assign(bytes + kGuardBytes, 0xFF);
  return memory.data();
}

uint32_t (*WarpScratch())[8] { return state.warps[state.current / 32].scratch; }

namespace {
float HalfOf(uint32_t word, int h) {
  return __bfloat162float({static_cast<uint16_t>(h ? word >> 16 : word & 0xffffu)});
}

// Whether [p, p + n) lies in the running block's shared memory (dynamic, or
// one __shared__ array), guards excluded.
bool InShared(const void* p, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto within = [&](const std::vector<unsigned char>& memory) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(memory.data());
    return a >= base && a + n <= base + (memory.size() - kGuardBytes);
  };
  if (within(state.shared)) return true;
  for (const auto& [key, memory] : state.static_shared) {
    if (within(memory)) return true;
  }
  return false;
}
}  // namespace

// From the PTX ISA's description of ldmatrix, written out here
// independently of kernels/cuda/mma_layout.h (whose Ldmatrix*Row functions
// the kernels use to pick the rows).
void LdMatrixX4(uint32_t r[4], const void* row, bool trans) {
  const int lane = threadIdx.x % 32;
  uint32_t(*scratch)[8] = WarpScratch();
  const uint64_t address = reinterpret_cast<uintptr_t>(row);
  scratch[lane][0] = static_cast<uint32_t>(address);
  scratch[lane][1] = static_cast<uint32_t>(address >> 32);
  scratch[lane][2] = trans ? 1u : 0u;
  WarpRendezvous(3);
  auto row_of = [&](int source) {
    return reinterpret_cast<const unsigned char*>(uint64_t{scratch[source][0]} |
                                                  uint64_t{scratch[source][1]} << 32);
  };
  bool valid = true;
  for (int source = 0; source < 32; ++source) {
    if (scratch[source][2] != scratch[0][2]) {
      Fail("the lanes of a warp disagree on ldmatrix's .trans");
      valid = false;
    }
    const unsigned char* p = row_of(source);
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0 || !InShared(p, 16)) {
      Fail("ldmatrix: lane " + std::to_string(source) +
           "'s row is not 16 aligned bytes of the block's shared memory");
      valid = false;
    }
  }
  uint32_t out[4] = {0, 0, 0, 0};
  for (int i = 0; valid && i < 4; ++i) {
    for (int h = 0; h < 2; ++h) {
      // (row, column) of matrix i that this lane's half h holds.
      const int mrow = trans ? 2 * (lane % 4) + h : lane / 4;
      const int mcol = trans ? lane / 4 : 2 * (lane % 4) + h;
      uint16_t bits;
      std::memcpy(&bits, row_of(8 * i + mrow) + 2 * mcol, 2);
      out[i] |= uint32_t{bits} << (16 * h);
    }
  }
  WarpRendezvous(4);  // every lane has read the addresses
  for (int i = 0; i < 4; ++i) r[i] = out[i];
}

void SetCopyLanding(CopyLanding landing) { state.landing = landing; }

namespace {
// Lands a copy of the running thread; marks dynamic shared memory it wrote
// as not yet fenced for the async proxy.
void Land(const PendingCopy& c) {
  if (c.src_bytes > 0) std::memcpy(c.dst, c.src, c.src_bytes);
  std::memset(c.dst + c.src_bytes, 0, 16 - c.src_bytes);
  const uintptr_t base = reinterpret_cast<uintptr_t>(state.shared.data());
  const uintptr_t at = reinterpret_cast<uintptr_t>(c.dst);
  if (at >= base && (at - base) / 16 < state.chunk_writer.size()) {
    const size_t chunk = (at - base) / 16;
    state.chunk_writer[chunk] = state.current + 1;
    state.threads[state.current].unfenced.push_back(chunk);
  }
}
}  // namespace

void CpAsync16(void* dst, const void* src, int src_bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    Fail("cp.async of 16 bytes with an address not 16-byte aligned");
    return;
  }
  if (!InShared(dst, 16)) {
    Fail("cp.async to a destination outside the block's shared memory");
    return;
  }
  if (src_bytes < 0 || src_bytes > 16) {
    Fail("cp.async with a src-size outside 0..16");
    return;
  }
  Thread& th = state.threads[state.current];
  const PendingCopy c{static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src),
                      src_bytes, th.committed, state.landing == CopyLanding::kAtIssue};
  if (c.landed) Land(c);
  th.copies.push_back(c);
}

void CpAsyncCommit() { ++state.threads[state.current].committed; }

void CpAsyncWait(int pending) {
  Thread& th = state.threads[state.current];
  const uint64_t keep = static_cast<uint64_t>(std::max(pending, 0));
  const uint64_t landed = th.committed > keep ? th.committed - keep : 0;  // groups below land
  std::vector<PendingCopy> later;
  for (const PendingCopy& c : th.copies) {
    if (c.group >= landed) {
      later.push_back(c);
      continue;
    }
    if (!c.landed) Land(c);
  }
  th.copies = std::move(later);
}

void FenceProxyAsync() {
  Thread& th = state.threads[state.current];
  for (size_t chunk : th.unfenced) {
    if (state.chunk_writer[chunk] != state.current + 1) continue;
    state.chunk_writer[chunk] = 0;
    state.chunk_unpublished[chunk] = 1;
    state.unpublished.push_back(chunk);
  }
  th.unfenced.clear();
}

uint32_t SharedWindowAddress(const void* p) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(state.shared.data());
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if (at < base || at >= base + state.shared.size() - kGuardBytes) {
    Fail("a shared-memory address of a pointer outside the block's dynamic shared memory");
    return 0;
  }
  return static_cast<uint32_t>(at - base);
}

void SetWgmmaCompletion(WgmmaCompletion completion) { state.completion = completion; }

namespace {

// Returns when all 128 threads of the caller's warpgroup have called it
// with the same `kind`.
void WarpgroupRendezvous(int kind) {
  const int g = state.current / 128;
  if (g >= static_cast<int>(state.warpgroups.size())) {
    Fail("a warpgroup instruction in a block that is not whole warpgroups (128 threads)");
    return;
  }
  Warpgroup& w = state.warpgroups[g];
  if (w.arrived == 0) {
    w.kind = kind;
  } else if (w.kind != kind) {
    Fail("the threads of a warpgroup called different warpgroup instructions at one point");
  }
  Thread& th = state.threads[state.current];
  th.generation = w.generation;
  if (++w.arrived == 128) {
    w.arrived = 0;
    ++w.generation;
    state.progressed = true;
    return;
  }
  th.wait = Wait::kWarpgroup;
  YieldToScheduler();
}

// Element (mn, k) of a shared-memory operand from its descriptor (PTX ISA,
// "Matrix Descriptor Format": start address, leading and stride byte
// offsets, each in 16-byte units in bits 0-13, 16-29 and 32-45; base offset
// in bits 49-51; layout type in bits 62-63, 0 = no swizzle), in the
// no-swizzle canonical layouts: 8 x 8 core matrices of 128 contiguous
// bytes, whose 16-byte rows run along K (K-major) or M/N (MN-major);
// neighbouring core matrices are the leading offset apart along K and the
// stride offset apart along M/N. Null (and the block fails) for anything
// else.
const unsigned char* OperandElement(uint64_t desc, bool mn_major, int mn, int k) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fff) << 4;
  const uint32_t leading = static_cast<uint32_t>((desc >> 16) & 0x3fff) << 4;
  const uint32_t stride = static_cast<uint32_t>((desc >> 32) & 0x3fff) << 4;
  if ((desc >> 49 & 7) != 0 || (desc >> 62) != 0) {
    Fail("wgmma descriptor with a base offset or a swizzled layout (the emulation has neither)");
    return nullptr;
  }
  const uint32_t in_core = mn_major ? (k % 8) * 16 + (mn % 8) * 2 : (mn % 8) * 16 + (k % 8) * 2;
  const uint64_t at =
      uint64_t{start} + (mn / 8) * uint64_t{stride} + (k / 8) * uint64_t{leading} + in_core;
  if (at + 2 > state.shared.size() - kGuardBytes) {
    Fail("wgmma operand past the block's dynamic shared memory");
    return nullptr;
  }
  if (state.chunk_writer[at / 16] != 0) {
    Fail("wgmma read shared memory that thread " + std::to_string(state.chunk_writer[at / 16] - 1) +
         " wrote by cp.async and did not fence (fence.proxy.async) after it landed");
    return nullptr;
  }
  if (state.chunk_unpublished[at / 16]) {
    Fail("wgmma read shared memory a cp.async wrote with no block barrier since its fence");
    return nullptr;
  }
  return state.shared.data() + at;
}

float Bf16At(const unsigned char* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return __bfloat162float({bits});
}

// Completes one wgmma: reads A and B as they are now, then writes every
// thread's d. A (64 x 16) from registers as mma.m16n8k16's A per warp (warp
// w rows 16 w ..): element (row, k) in thread 32 (row / 16) + (row % 8) 4 +
// (k % 8) / 2, register (row % 16) / 8 + 2 (k / 8), half k % 2. D (64 x 64):
// float r of thread t is row 16 (t / 32) + (t % 32) / 4 + 8 ((r % 4) / 2),
// column 8 (r / 4) + 2 (t % 4) + r % 2.
void Complete(const Wgmma& op) {
  float a[64][16], b[16][64];
  for (int row = 0; row < 64; ++row) {
    for (int k = 0; k < 16; ++k) {
      if (op.a[0] != nullptr) {
        const int t = 32 * (row / 16) + (row % 8) * 4 + (k % 8) / 2;
        const uint32_t word = op.a[t][(row % 16) / 8 + 2 * (k / 8)];
        a[row][k] = HalfOf(word, k % 2);
      } else {
        const unsigned char* p = OperandElement(op.a_desc, op.a_mn_major, row, k);
        if (p == nullptr) return;
        a[row][k] = Bf16At(p);
      }
    }
  }
  for (int k = 0; k < 16; ++k) {
    for (int n = 0; n < 64; ++n) {
      const unsigned char* p = OperandElement(op.b_desc, op.b_mn_major, n, k);
      if (p == nullptr) return;
      b[k][n] = Bf16At(p);
    }
  }
  for (int t = 0; t < 128; ++t) {
    for (int r = 0; r < 32; ++r) {
      const int row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((r % 4) / 2);
      const int col = 8 * (r / 4) + 2 * (t % 4) + r % 2;
      double sum = op.accumulate ? op.d[t][r] : 0.0;
      for (int k = 0; k < 16; ++k) sum += double{a[row][k]} * double{b[k][col]};
      op.d[t][r] = static_cast<float>(sum);
    }
  }
}

void Issue(float d[32], const uint32_t a[4], uint64_t a_desc, bool a_mn_major, uint64_t b_desc,
           bool b_mn_major, bool accumulate) {
  const int g = state.current / 128, t = state.current % 128;
  if (g < static_cast<int>(state.warpgroups.size())) {
    Warpgroup& w = state.warpgroups[g];
    w.issuing.d[t] = d;
    w.issuing.a[t] = a;
    w.a_desc[t] = a != nullptr ? 0 : a_desc;
    w.b_desc[t] = b_desc;
    w.flags[t] = (a != nullptr) | a_mn_major << 1 | b_mn_major << 2 | accumulate << 3;
  }
  WarpgroupRendezvous(5);
  if (g >= static_cast<int>(state.warpgroups.size())) return;
  Warpgroup& w = state.warpgroups[g];
  if (t == 0) {
    if (!w.fenced) {
      Fail("wgmma issued with no wgmma.fence since the warpgroup's start or its last wait");
    }
    for (int u = 1; u < 128; ++u) {
      if (w.flags[u] != w.flags[0] || w.a_desc[u] != w.a_desc[0] || w.b_desc[u] != w.b_desc[0]) {
        Fail("the threads of a warpgroup issued one wgmma with different operands or flags");
      }
    }
    Wgmma op = w.issuing;
    op.group = w.committed;
    op.a_desc = w.a_desc[0];
    op.b_desc = w.b_desc[0];
    op.a_mn_major = w.flags[0] & 2;
    op.b_mn_major = w.flags[0] & 4;
    op.accumulate = w.flags[0] & 8;
    if (state.completion == WgmmaCompletion::kAtIssue) {
      Complete(op);
    } else {
      w.pending.push_back(op);
    }
  }
  WarpgroupRendezvous(6);  // thread 0 has taken every thread's operands
}

}  // namespace

void WgmmaRs(float d[32], const uint32_t a[4], uint64_t b_desc, bool b_mn_major, bool accumulate) {
  Issue(d, a, 0, false, b_desc, b_mn_major, accumulate);
}

void WgmmaSs(float d[32], uint64_t a_desc, bool a_mn_major, uint64_t b_desc, bool b_mn_major,
             bool accumulate) {
  Issue(d, nullptr, a_desc, a_mn_major, b_desc, b_mn_major, accumulate);
}

void WgmmaFence() {
  WarpgroupRendezvous(7);
  const int g = state.current / 128;
  if (g < static_cast<int>(state.warpgroups.size())) state.warpgroups[g].fenced = true;
}

void WgmmaCommit() {
  WarpgroupRendezvous(8);
  const int g = state.current / 128;
  if (g < static_cast<int>(state.warpgroups.size()) && state.current % 128 == 0) {
    ++state.warpgroups[g].committed;
  }
  WarpgroupRendezvous(9);
}

void WgmmaWait(int pending) {
  WarpgroupRendezvous(10);
  const int g = state.current / 128;
  if (g < static_cast<int>(state.warpgroups.size()) && state.current % 128 == 0) {
    Warpgroup& w = state.warpgroups[g];
    const uint64_t keep = static_cast<uint64_t>(std::max(pending, 0));
    const uint64_t done = w.committed > keep ? w.committed - keep : 0;  // groups below complete
    std::vector<Wgmma> later;
    for (const Wgmma& op : w.pending) {
      if (op.group < done) {
        Complete(op);
      } else {
        later.push_back(op);
      }
    }
    w.pending = std::move(later);
    w.fenced = false;  // the results reach registers other instructions now touch
  }
  WarpgroupRendezvous(11);  // every thread's d is written before any goes on
}

// From the PTX ISA's fragment tables, written out here independently of
// kernels/cuda/mma_layout.h (which the kernels use): A element (row, k) is
// in lane (row % 8) * 4 + (k % 8) / 2, register row / 8 + 2 * (k / 8), half
// k % 2; B element (k, n) in lane n * 4 + (k % 8) / 2, register k / 8, half
// k % 2; C element i of a lane at row lane / 4 + 8 * (i / 2), column
// 2 * (lane % 4) + i % 2.
void MmaM16N8K16Bf16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  const int lane = threadIdx.x % 32;
  uint32_t(*scratch)[8] = WarpScratch();
  for (int i = 0; i < 4; ++i) scratch[lane][i] = a[i];
  for (int i = 0; i < 2; ++i) scratch[lane][4 + i] = b[i];
  WarpRendezvous(1);
  auto A = [&](int row, int k) {
    return HalfOf(scratch[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
  };
  auto B = [&](int k, int n) { return HalfOf(scratch[n * 4 + (k % 8) / 2][4 + k / 8], k % 2); };
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = lane / 4 + 8 * (i / 2), col = 2 * (lane % 4) + i % 2;
    double sum = c[i];
    for (int k = 0; k < 16; ++k) sum += double{A(row, k)} * double{B(k, col)};
    out[i] = static_cast<float>(sum);
  }
  WarpRendezvous(2);  // every lane has read the fragments
  for (int i = 0; i < 4; ++i) c[i] = out[i];
}

void WarpRendezvous(int kind) {
  Warp& w = state.warps[state.current / 32];
  if (w.arrived == 0) {
    w.kind = kind;
  } else if (w.kind != kind) {
    Fail("the lanes of a warp called different collectives at one point");
  }
  Thread& th = state.threads[state.current];
  th.generation = w.generation;
  if (++w.arrived == 32) {
    w.arrived = 0;
    ++w.generation;
    state.progressed = true;
    return;
  }
  th.wait = Wait::kWarp;
  YieldToScheduler();
}

std::string RunGrid(SimtDim3 grid, int threads, int smem_bytes, Schedule schedule,
                    const std::function<void()>& body, int smem_limit) {
  if (threads % 32 != 0 || threads <= 0 || threads > 32 * kMaxWarps) {
    return "threads must be a positive multiple of 32";
  }
  std::vector<int> order(threads);
  std::iota(order.begin(), order.end(), 0);
  if (schedule == Schedule::kReversed) std::reverse(order.begin(), order.end());
  if (schedule == Schedule::kShuffled) std::shuffle(order.begin(), order.end(), std::mt19937(99));
  state.failure.clear();
  state.body = &body;
  blockDim = {static_cast<unsigned>(threads), 1, 1};
  gridDim = grid;
  // Blocks run one at a time, in the schedule's order too: a kernel whose
  // blocks race (one overwriting what another still reads) shows as
  // results that change between schedules.
  std::vector<uint64_t> blocks(uint64_t{grid.x} * grid.y * grid.z);
  std::iota(blocks.begin(), blocks.end(), uint64_t{0});
  if (schedule == Schedule::kReversed) std::reverse(blocks.begin(), blocks.end());
  if (schedule == Schedule::kShuffled) std::shuffle(blocks.begin(), blocks.end(), std::mt19937(7));
  for (uint64_t b : blocks) {
    // 0xFF bytes: NaN as float and as bf16, so a read of memory the kernel
    // did not write shows in its results.
    state.shared.assign(smem_bytes + kGuardBytes, 0xFF);
    blockIdx = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                static_cast<unsigned>(b / grid.x / grid.y)};
    if (!RunBlock(threads, order).empty()) return state.failure;
    for (size_t i = smem_bytes; i < state.shared.size(); ++i) {
      if (state.shared[i] != 0xFF) {
        Fail("a write past the block's shared memory");
        return state.failure;
      }
    }
    if (smem_limit >= 0) {
      size_t total = smem_bytes;
      for (const auto& [key, bytes] : state.static_shared) total += bytes.size() - kGuardBytes;
      if (total > static_cast<size_t>(smem_limit)) {
        Fail("static and dynamic shared memory (" + std::to_string(total) +
             " bytes) past the kernel's limit of " + std::to_string(smem_limit));
        return state.failure;
      }
    }
  }
  return state.failure;
}

}  // namespace plateau::simt

namespace {

// Arrives at the block barrier; returns when every thread has.
void BlockBarrier() {
  using plateau::simt::state;
  plateau::simt::Thread& th = state.threads[state.current];
  th.generation = state.block_generation;
  if (++state.block_arrived == static_cast<int>(state.threads.size())) {
    state.block_arrived = 0;
    ++state.block_generation;
    for (size_t chunk : state.unpublished) state.chunk_unpublished[chunk] = 0;
    state.unpublished.clear();
    state.progressed = true;
    return;
  }
  th.wait = plateau::simt::Wait::kBlock;
  plateau::simt::YieldToScheduler();
}

}  // namespace

void __syncthreads() { BlockBarrier(); }

int __syncthreads_or(int predicate) {
  using plateau::simt::state;
  // Every thread ORs in before the barrier opens; the last to arrive
  // publishes the result and clears the sum for the next call. A thread
  // reads the result before it can reach the next barrier, which cannot
  // open before every thread has read (they all must arrive there).
  if (predicate) state.block_or = 1;
  if (state.block_arrived + 1 == static_cast<int>(state.threads.size())) {
    state.block_or_result = state.block_or;
    state.block_or = 0;
  }
  BlockBarrier();
  return state.block_or_result;
}

float __shfl_xor_sync(unsigned mask, float x, int lane_mask) {
  using namespace plateau::simt;
  if (mask != 0xffffffffu) Fail("__shfl_xor_sync with a partial mask");
  const int lane = threadIdx.x % 32;
  uint32_t(*scratch)[8] = WarpScratch();
  std::memcpy(&scratch[lane][0], &x, 4);
  WarpRendezvous(-1);
  float r;
  std::memcpy(&r, &scratch[lane ^ (lane_mask & 31)][0], 4);  // the low 5 bits, as the hardware
  WarpRendezvous(-2);  // every lane has read before the next write
  return r;
}

unsigned __ballot_sync(unsigned mask, int predicate) {
  using namespace plateau::simt;
  if (mask != 0xffffffffu) Fail("__ballot_sync with a partial mask");
  const int lane = threadIdx.x % 32;
  uint32_t(*scratch)[8] = WarpScratch();
  scratch[lane][0] = predicate ? 1u : 0u;
  WarpRendezvous(-3);
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i) bits |= scratch[i][0] << i;
  WarpRendezvous(-4);  // every lane has read before the next write
  return bits;
}
