#include "kernels/cuda/simt_emulator.h"

#include <ucontext.h>

#include <numeric>
#include <random>
#include <vector>

SimtDim3 threadIdx, blockIdx, blockDim, gridDim;

namespace plateau::simt {
namespace {

constexpr size_t kGuardBytes = 4096;
constexpr size_t kStackBytes = 256 << 10;
constexpr int kMaxWarps = 32;

enum class Wait { kNone, kWarp, kBlock };

struct Thread {
  ucontext_t context;
  std::vector<char> stack;
  bool started = false, done = false;
  Wait wait = Wait::kNone;
  uint64_t generation = 0;  // of the barrier it waits at
};

struct Warp {
  uint64_t generation = 0;
  int arrived = 0, kind = 0;
  uint32_t scratch[32][8];
};

struct State {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  uint64_t block_generation = 0;
  int block_arrived = 0;
  ucontext_t scheduler;
  int current = -1;
  const std::function<void()>* body = nullptr;
  std::vector<unsigned char> shared;
  std::string failure;
};
State state;

void Fail(const std::string& what) {
  if (state.failure.empty()) state.failure = what;
}

void YieldToScheduler() { swapcontext(&state.threads[state.current].context, &state.scheduler); }

bool Runnable(int t) {
  const Thread& th = state.threads[t];
  if (th.done) return false;
  switch (th.wait) {
    case Wait::kWarp:
      return state.warps[t / 32].generation != th.generation;
    case Wait::kBlock:
      return state.block_generation != th.generation;
    case Wait::kNone:
      return true;
  }
  return true;
}

void Trampoline() {
  (*state.body)();
  state.threads[state.current].done = true;
}  // returns to uc_link: the scheduler

std::string RunBlock(int threads, const std::vector<int>& order) {
  state.threads.assign(threads, Thread());
  state.warps.assign((threads + 31) / 32, Warp());
  state.block_generation = 0;
  state.block_arrived = 0;
  for (Thread& th : state.threads) {
    th.stack.resize(kStackBytes);
    getcontext(&th.context);
    th.context.uc_stack.ss_sp = th.stack.data();
    th.context.uc_stack.ss_size = th.stack.size();
    th.context.uc_link = &state.scheduler;
    makecontext(&th.context, Trampoline, 0);
  }
  for (;;) {
    int pick = -1;
    for (int t : order) {
      if (Runnable(t)) {
        pick = t;
        break;
      }
    }
    if (pick < 0) break;
    state.current = pick;
    threadIdx = {static_cast<unsigned>(pick), 0, 0};
    Thread& th = state.threads[pick];
    th.started = true;
    th.wait = Wait::kNone;
    swapcontext(&state.scheduler, &th.context);
  }
  for (const Thread& th : state.threads) {
    if (!th.done) {
      Fail("deadlock: a barrier or warp collective that not every thread reached");
      break;
    }
  }
  return state.failure;
}

}  // namespace

unsigned char* SharedMemory() { return state.shared.data(); }

uint32_t (*WarpScratch())[8] { return state.warps[state.current / 32].scratch; }

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
    return;
  }
  th.wait = Wait::kWarp;
  YieldToScheduler();
}

std::string RunGrid(SimtDim3 grid, int threads, int smem_bytes, Schedule schedule,
                    const std::function<void()>& body) {
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
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        // 0xFF bytes: NaN as float and as bf16, so a read of memory the
        // kernel did not write shows in its results.
        state.shared.assign(smem_bytes + kGuardBytes, 0xFF);
        blockIdx = {x, y, z};
        if (!RunBlock(threads, order).empty()) return state.failure;
        for (size_t i = smem_bytes; i < state.shared.size(); ++i) {
          if (state.shared[i] != 0xFF) {
            Fail("a write past the block's shared memory");
            return state.failure;
          }
        }
      }
    }
  }
  return state.failure;
}

}  // namespace plateau::simt

void __syncthreads() {
  using plateau::simt::state;
  plateau::simt::Thread& th = state.threads[state.current];
  th.generation = state.block_generation;
  if (++state.block_arrived == static_cast<int>(state.threads.size())) {
    state.block_arrived = 0;
    ++state.block_generation;
    return;
  }
  th.wait = plateau::simt::Wait::kBlock;
  plateau::simt::YieldToScheduler();
}

float __shfl_xor_sync(unsigned mask, float x, int lane_mask) {
  using namespace plateau::simt;
  if (mask != 0xffffffffu) Fail("__shfl_xor_sync with a partial mask");
  const int lane = threadIdx.x % 32;
  uint32_t(*scratch)[8] = WarpScratch();
  std::memcpy(&scratch[lane][0], &x, 4);
  WarpRendezvous(-1);
  float r;
  std::memcpy(&r, &scratch[lane ^ lane_mask][0], 4);
  WarpRendezvous(-2);  // every lane has read before the next write
  return r;
}
