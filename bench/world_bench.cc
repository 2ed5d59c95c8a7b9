// The cost of making and closing a CPU world: P ranks (threads of this
// process, as in the tests and the benches) rendezvous through a FileStore,
// connect a full Gloo mesh, pass a barrier and close it again.
//
// Two ways, alternating in one run:
//  - fresh device: what every world did before (a Gloo TCP device per rank,
//    made for the world and destroyed with it), written here with Gloo's own
//    API so that the old path stays measurable;
//  - the communicator: CreateCommunicator as the step uses it (the process's
//    device for the hostname, and the teardown bell; kernels/
//    gloo_communicator.cc says why).
// Both wall times are the whole world, threads started to threads joined;
// the split into making (to the barrier) and closing is the slowest rank's.
//
//   bazel build -c opt //bench:world_bench
//   bazel-out/k8-opt/bin/bench/world_bench [--ranks=2,4] [--worlds=30]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/bench_util.h"
#include "gloo/barrier.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/tcp/device.h"
#include "kernels/communicator.h"
#include "kernels/cpu_stream.h"
#include "kernels/gloo_kv_store.h"
#include "kernels/kv_store.h"
#include "kernels/testing/local_world.h"

namespace plateau::bench {
namespace {

struct WorldTimes {
  double wall_s = 0;   // threads started to joined
  double make_s = 0;   // slowest rank: start to past the barrier
  double close_s = 0;  // slowest rank: past the barrier to closed
  bool ok = true;
};

// Runs `rank_fn(rank, dir, &made_at, &closed_at)` on P threads; returns
// false from a rank that failed.
template <typename RankFn>
WorldTimes RunWorld(int P, const std::string& tag, RankFn rank_fn) {
  const std::string dir = FreshStoreDir(tag);
  std::vector<double> made(P), closed(P);
  std::vector<int> ok(P, 0);
  const double t0 = NowSeconds();
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] { ok[r] = rank_fn(r, dir, &made[r], &closed[r]) ? 1 : 0; });
  }
  for (auto& t : threads) t.join();
  WorldTimes w;
  w.wall_s = NowSeconds() - t0;
  std::error_code ignored;  // a leftover directory is only clutter
  std::filesystem::remove_all(dir, ignored);
  double made_last = 0;
  for (int r = 0; r < P; ++r) {
    w.ok = w.ok && ok[r];
    made_last = std::max(made_last, made[r]);
    w.close_s = std::max(w.close_s, closed[r] - made[r]);
  }
  w.make_s = made_last - t0;
  return w;
}

// Before: a device of its own per rank, destroyed with the world.
bool FreshDeviceRank(int r, int P, const std::string& dir, double* made, double* closed) {
  auto store = FileStore::Create(dir);
  if (!store.ok()) return false;
  std::shared_ptr<KeyValueStore> shared = std::move(*store);
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(r, P);
    GlooStoreAdapter adapter(shared, absl::Seconds(60));
    gloo::rendezvous::PrefixStore prefixed("fresh/world", adapter);
    ctx->connectFullMesh(prefixed, device);
    {
      gloo::BarrierOptions barrier(ctx);  // holds the context until here
      barrier.setTag(0);
      gloo::barrier(barrier);
    }
    *made = NowSeconds();
    ctx.reset();
    device.reset();
    *closed = NowSeconds();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "world_bench: fresh device, rank %d: %s\n", r, e.what());
    return false;
  }
  return true;
}

// Now: the communicator the step uses.
bool CommunicatorRank(int r, int P, const std::string& dir, double* made, double* closed) {
  auto store = FileStore::Create(dir);
  if (!store.ok()) return false;
  CommunicatorOptions co;
  co.backend = BackendKind::kCpu;
  co.rank = r;
  co.size = P;
  co.store = std::move(*store);
  co.prefix = "now";
  co.timeout = absl::Seconds(60);
  auto world = CreateCommunicator(co);
  if (!world.ok()) {
    std::fprintf(stderr, "world_bench: communicator, rank %d: %s\n", r, world.status().ToString().c_str());
    return false;
  }
  CpuStream stream("barrier");
  absl::Status s = (*world)->Barrier(stream);
  if (s.ok()) s = stream.Synchronize();
  *made = NowSeconds();
  world->reset();
  *closed = NowSeconds();
  if (!s.ok()) std::fprintf(stderr, "world_bench: barrier, rank %d: %s\n", r, s.ToString().c_str());
  return s.ok();
}

int Main(int argc, char** argv) {
  std::vector<int> ranks = {2, 4};
  int worlds = 30;
  for (int i = 1; i < argc; ++i) {
    absl::string_view a = argv[i];
    if (absl::ConsumePrefix(&a, "--ranks=")) {
      ranks.clear();
      for (absl::string_view p : absl::StrSplit(a, ',')) {
        int v = 0;
        if (!absl::SimpleAtoi(p, &v) || v < 2 || v > 16) {
          std::fprintf(stderr, "world_bench: --ranks: expected integers in [2, 16], got '%s'\n",
                       std::string(p).c_str());
          return 2;
        }
        ranks.push_back(v);
      }
    } else if (absl::ConsumePrefix(&a, "--worlds=")) {
      if (!absl::SimpleAtoi(a, &worlds) || worlds < 1) {
        std::fprintf(stderr, "world_bench: --worlds: expected an integer >= 1, got '%s'\n", argv[i]);
        return 2;
      }
    } else {
      std::fprintf(stderr, "world_bench: unknown argument '%s' (--ranks=2,4 --worlds=30)\n", argv[i]);
      return 2;
    }
  }
  std::printf("%5s  %-14s %10s %10s %10s   (medians of %d worlds, ms)\n", "ranks", "path", "wall",
              "make", "close", worlds);
  std::string json = "{\"bench\":\"world\",\"runs\":[";
  bool all_ok = true;
  for (size_t k = 0; k < ranks.size(); ++k) {
    const int P = ranks[k];
    std::vector<double> wall[2], make[2], close[2];
    for (int i = 0; i < worlds; ++i) {
      for (int path = 0; path < 2; ++path) {  // alternating, so drift hits both
        WorldTimes w = path == 0 ? RunWorld(P, "fresh",
                                            [P](int r, const std::string& d, double* m, double* c) {
                                              return FreshDeviceRank(r, P, d, m, c);
                                            })
                                 : RunWorld(P, "comm", [P](int r, const std::string& d, double* m, double* c) {
                                     return CommunicatorRank(r, P, d, m, c);
                                   });
        all_ok = all_ok && w.ok;
        wall[path].push_back(w.wall_s);
        make[path].push_back(w.make_s);
        close[path].push_back(w.close_s);
      }
    }
    const char* names[2] = {"fresh device", "communicator"};
    for (int path = 0; path < 2; ++path) {
      std::printf("%5d  %-14s %10.2f %10.2f %10.2f\n", P, names[path], 1e3 * Median(wall[path]),
                  1e3 * Median(make[path]), 1e3 * Median(close[path]));
    }
    const double ratio = Median(wall[0]) / Median(wall[1]);
    std::printf("%5d  %-14s %10.2fx\n", P, "fresh / now", ratio);
    absl::StrAppend(&json, k ? "," : "", "{\"ranks\":", P, ",\"worlds\":", worlds,
                    ",\"fresh_device_wall_ms\":", 1e3 * Median(wall[0]),
                    ",\"fresh_device_close_ms\":", 1e3 * Median(close[0]),
                    ",\"communicator_wall_ms\":", 1e3 * Median(wall[1]),
                    ",\"communicator_close_ms\":", 1e3 * Median(close[1]), ",\"wall_ratio\":", ratio, "}");
  }
  json += "]}";
  std::printf("%s\n", json.c_str());
  if (!all_ok) {
    std::fprintf(stderr, "world_bench: some world failed (above)\n");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace plateau::bench

int main(int argc, char** argv) { return plateau::bench::Main(argc, argv); }
