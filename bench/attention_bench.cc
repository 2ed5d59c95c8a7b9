// attention_bench: bf16 attention's block pair (each sequence's own block,
// causal) forward and backward, in the tiled arithmetic (the baseline:
// fp32 products of the loaded values) and on tensor cores
// (ModelKernelsOptions::bf16_attention, kernels/model/model_kernels.h), on
// one backend, in the same run. Per sequence length: milliseconds (best of
// the timed runs), TFLOP/s by the causal model count (forward: Q K^T and
// P V over the visible pairs, 4 D FLOPs per pair; backward 2.5 times that,
// FlashAttention's convention: S = Q K^T again, dP, dV, dQ, dK), MFU
// against the device's bf16 dense peak (by that model count, the
// convention for MFU) where kernels/device_peaks.h knows the card. The
// backward kernels execute more than the model count: on CUDA the dQ
// kernel and the dK/dV kernel each recompute S and dP (7 products, 3.5x
// the forward), so the hardware's rate is 1.4x the model figure; "bwd exec"
// (bwd_executed_tflops, with bwd_executed_products) is the rate of what
// ran (BackwardProducts). The step's MFU (composed_bench, ModelFlopsPerStep)
// counts attention's backward at 2x its forward instead (the 6 N D
// convention), so its attention share is not this bench's model count
// either. Also the tensor-core/tiles time
// ratio, and how far the two outputs lie apart (relative to o's largest
// magnitude: the rounding of P to bf16, ~2^-8, never O(1); past 2^-6 the
// run fails), and so the gradients dq, dk, dv of one backward from zero
// (each relative to its own largest magnitude; the backward's TFLOP/s
// rest on them). On CUDA also the tensor-core kernels single-buffered
// (ModelKernelsOptions::tc_double_buffer = false: the baseline of their
// cp.async pipeline), with the double/single time ratio; their o must be
// the double-buffered o bit for bit; and everything on mma.sync
// (ModelKernelsOptions::tc_wgmma = false, "tc_mma": the baseline of the
// wgmma kernels an H100/H200 takes), with the chosen/mma.sync forward and
// backward time ratios.
//
//   bazel run -c opt --config=cuda //bench:attention_bench -- --backend=cuda
//   bazel run -c opt //bench:attention_bench                 # CPU: a check
//
// On the CPU the tensor-core arithmetic is attention_tc.h's scalar
// reference, so its figures are a check that both paths run, not a speed;
// the CPU's defaults are short sequences for that reason. Ends with a JSON
// line.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/device_peaks.h"
#include "kernels/model/attention_shape.h"
#include "kernels/model/model_kernels.h"
#include "kernels/status_macros.h"

namespace plateau::bench {
namespace {

struct Point {
  int64_t seq_len = 0;
  Bf16Attention arith = Bf16Attention::kTiles;
  bool double_buffer = true;
  bool wgmma = true;  // the kernels may take wgmma (the device decides)
  Timing fwd, bwd;
  double fwd_flops = 0;
  std::vector<float> o;  // the last forward's output, on the host
  // One backward's gradients from zero, on the host (all three fp32).
  std::vector<float> dq, dk, dv;
};

// max |a - base| over max |base|: how far a lies from the baseline's
// values at the baseline's scale; infinite when either holds a value that
// is not finite.
double RelDiff(const std::vector<float>& a, const std::vector<float>& base) {
  double diff = 0, mag = 0;
  for (size_t i = 0; i < a.size() && i < base.size(); ++i) {
    // std::max drops a NaN: a value that is not finite is no agreement.
    if (!std::isfinite(a[i]) || !std::isfinite(base[i])) return INFINITY;
    diff = std::max(diff, std::abs(double{a[i]} - base[i]));
    mag = std::max(mag, std::abs(double{base[i]}));
  }
  if (a.size() != base.size()) return INFINITY;
  return mag > 0 ? diff / mag : diff;
}

// Random bf16 in [-2, 2): scores of a few units at head_dim 128 after the
// 1/sqrt(D) scale, so the softmax is neither flat nor one-hot.
std::vector<Bf16> RandomBf16(int64_t n, uint64_t seed) {
  std::vector<float> f(n);
  FillRandom(f, seed);
  std::vector<Bf16> b(n);
  for (int64_t i = 0; i < n; ++i) b[i] = FloatToBf16(2.0f * f[i]);
  return b;
}

// Matrix products (each 2 D FLOPs per visible pair) the backward kernels
// of `arith` execute on `kind`: 7 where dQ and dK/dV are two passes that
// each recompute S = Q K^T and dP = dO V^T (every CUDA kernel, tiles and
// tensor cores alike: dQ by query tile, dK and dV by key tile, so each sum
// has a fixed order without atomics; and the CPU's tensor-core reference,
// which mirrors them), 5 where one pass computes S and dP once for all
// three gradients (the CPU's tiles, kernels/model/attention.cc). The model
// count is 5 either way.
int BackwardProducts(BackendKind kind, Bf16Attention arith) {
  return kind == BackendKind::kCpu && arith == Bf16Attention::kTiles ? 5 : 7;
}

// A row's name: the arithmetic, "tc_single" for the single-buffered
// tensor-core kernels, "tc_mma" for their forward kept on mma.sync.
const char* Label(Bf16Attention arith, bool double_buffer, bool wgmma) {
  if (arith != Bf16Attention::kTensorCore) return Bf16AttentionName(arith);
  return !double_buffer ? "tc_single" : !wgmma ? "tc_mma" : Bf16AttentionName(arith);
}

absl::StatusOr<Point> Measure(Backend& be, Stream& stream, const AttentionShape& shape,
                              Bf16Attention arith, bool double_buffer, bool wgmma,
                              double min_time_s) {
  ModelKernelsOptions options;
  options.bf16_attention = arith;
  options.tc_double_buffer = double_buffer;
  options.tc_wgmma = wgmma;
  PLATEAU_ASSIGN_OR_RETURN(auto kernels, ModelKernels::Create(be, options));
  if (kernels->Bf16AttentionFor(shape) != arith) {
    return absl::UnimplementedError(
        absl::StrCat(Bf16AttentionName(arith), " does not run this shape here"));
  }
  const int64_t rows = shape.batch * shape.q_len * shape.heads;
  const int64_t q_elems = rows * shape.head_dim;
  const int64_t kv_elems = shape.batch * shape.kv_len * shape.kv_heads * shape.head_dim;
  auto alloc = [&](int64_t bytes) {
    return be.device().Allocate(LiveSet::kActivations, std::max<int64_t>(bytes, 16));
  };
  PLATEAU_ASSIGN_OR_RETURN(Buffer q, alloc(q_elems * 2));
  PLATEAU_ASSIGN_OR_RETURN(Buffer k, alloc(kv_elems * 2));
  PLATEAU_ASSIGN_OR_RETURN(Buffer v, alloc(kv_elems * 2));
  PLATEAU_ASSIGN_OR_RETURN(Buffer dout, alloc(q_elems * 2));
  PLATEAU_ASSIGN_OR_RETURN(Buffer dq, alloc(q_elems * 4));  // fp32: ring attention rounds it once
  PLATEAU_ASSIGN_OR_RETURN(Buffer acc, alloc(q_elems * 4));
  PLATEAU_ASSIGN_OR_RETURN(Buffer dk, alloc(kv_elems * 4));
  PLATEAU_ASSIGN_OR_RETURN(Buffer dv, alloc(kv_elems * 4));
  PLATEAU_ASSIGN_OR_RETURN(Buffer m, alloc(rows * 4));
  PLATEAU_ASSIGN_OR_RETURN(Buffer l, alloc(rows * 4));
  PLATEAU_ASSIGN_OR_RETURN(Buffer lse, alloc(rows * 4));
  PLATEAU_ASSIGN_OR_RETURN(Buffer delta, alloc(rows * 4));
  PLATEAU_ASSIGN_OR_RETURN(Buffer work, alloc(AttentionWorkspaceFloats(shape) * 4));
  // The same data for both arithmetics (fixed seeds); dq, dk, dv start at 0
  // and accumulate over the runs (finite: a few runs of unit gradients).
  for (auto [buf, n, seed] :
       {std::tuple{&q, q_elems, 1}, {&k, kv_elems, 2}, {&v, kv_elems, 3}, {&dout, q_elems, 4}}) {
    const std::vector<Bf16> host = RandomBf16(n, seed);
    PLATEAU_RETURN_IF_ERROR(be.Copy(stream, buf->data(), host.data(), n * 2));
  }
  auto zero_gradients = [&]() -> absl::Status {
    for (auto [buf, bytes] : {std::pair{&dq, q_elems * 4}, {&dk, kv_elems * 4}, {&dv, kv_elems * 4}}) {
      const std::vector<char> zeros(bytes, 0);
      PLATEAU_RETURN_IF_ERROR(be.Copy(stream, buf->data(), zeros.data(), bytes));
      PLATEAU_RETURN_IF_ERROR(stream.Synchronize());  // zeros is freed here
    }
    return absl::OkStatus();
  };
  PLATEAU_RETURN_IF_ERROR(zero_gradients());

  const Bf16* qb = q.as<Bf16>();
  const Bf16* kb = k.as<Bf16>();
  const Bf16* vb = v.as<Bf16>();
  const Bf16* dob = dout.as<Bf16>();
  auto forward = [&]() -> absl::Status {
    PLATEAU_RETURN_IF_ERROR(
        kernels->AttentionInit(stream, shape, m.as<float>(), l.as<float>(), acc.as<float>()));
    PLATEAU_RETURN_IF_ERROR(kernels->AttentionForwardBlockBf16(stream, shape, qb, kb, vb,
                                                               m.as<float>(), l.as<float>(),
                                                               acc.as<float>(), work.as<float>()));
    PLATEAU_RETURN_IF_ERROR(kernels->AttentionFinalize(stream, shape, m.as<float>(), l.as<float>(),
                                                       acc.as<float>(), lse.as<float>()));
    return stream.Synchronize();
  };
  auto backward = [&]() -> absl::Status {
    PLATEAU_RETURN_IF_ERROR(
        kernels->AttentionDeltaBf16(stream, shape, acc.as<float>(), dob, delta.as<float>()));
    PLATEAU_RETURN_IF_ERROR(kernels->AttentionBackwardBlockBf16(stream, shape, qb, kb, vb, dob, lse.as<float>(),
                                                                delta.as<float>(), dq.as<float>(), dk.as<float>(),
                                                                dv.as<float>(), work.as<float>()));
    return stream.Synchronize();
  };
  Point p;
  p.seq_len = shape.q_len;
  p.arith = arith;
  p.double_buffer = double_buffer;
  p.wgmma = wgmma;
  PLATEAU_ASSIGN_OR_RETURN(p.fwd, TimeRuns(forward, 1, 3, min_time_s, 50));
  PLATEAU_ASSIGN_OR_RETURN(p.bwd, TimeRuns(backward, 1, 3, min_time_s, 50));
  const double pairs = static_cast<double>(shape.batch * shape.heads) *
                       static_cast<double>(shape.q_len) * (shape.q_len + 1) / 2.0;
  p.fwd_flops = 4.0 * static_cast<double>(shape.head_dim) * pairs;
  PLATEAU_RETURN_IF_ERROR(forward());
  p.o.resize(q_elems);
  PLATEAU_RETURN_IF_ERROR(be.Copy(stream, p.o.data(), acc.data(), q_elems * 4));
  PLATEAU_RETURN_IF_ERROR(stream.Synchronize());
  // The timed backward runs accumulated into the gradients a number of
  // times that differs by variant: one more from zero, to compare.
  PLATEAU_RETURN_IF_ERROR(zero_gradients());
  PLATEAU_RETURN_IF_ERROR(backward());
  p.dq.resize(q_elems);
  p.dk.resize(kv_elems);
  p.dv.resize(kv_elems);
  PLATEAU_RETURN_IF_ERROR(be.Copy(stream, p.dq.data(), dq.data(), q_elems * 4));
  PLATEAU_RETURN_IF_ERROR(be.Copy(stream, p.dk.data(), dk.data(), kv_elems * 4));
  PLATEAU_RETURN_IF_ERROR(be.Copy(stream, p.dv.data(), dv.data(), kv_elems * 4));
  PLATEAU_RETURN_IF_ERROR(stream.Synchronize());
  return p;
}

int Main(int argc, char** argv) {
  BackendKind kind = BackendKind::kCpu;
  int64_t batch = 1, heads = 16, kv_heads = 4, head_dim = 128;
  double min_time_s = 0.5;
  std::string seq_lens;
  std::map<std::string, int64_t*> ints = {
      {"batch", &batch}, {"heads", &heads}, {"kv_heads", &kv_heads}, {"head_dim", &head_dim}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    bool bad = false;
    if (BackendArg(a, "attention_bench", &kind, &bad)) {
      if (bad) return 2;
      continue;
    }
    const size_t eq = a.find('=');
    const std::string name =
        eq == std::string::npos || a.rfind("--", 0) != 0 ? "" : a.substr(2, eq - 2);
    const std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (name == "seq_lens") {
      seq_lens = value;
    } else if (name == "min_time_s" && absl::SimpleAtod(value, &min_time_s)) {
    } else if (ints.count(name) == 0 || !absl::SimpleAtoi(value, ints[name]) || *ints[name] <= 0) {
      std::fprintf(stderr,
                   "attention_bench: bad argument '%s' (expected --backend=cpu|cuda, "
                   "--seq_lens=N,N, --batch, --heads, --kv_heads, --head_dim: positive "
                   "integers, --min_time_s=S)\n",
                   a.c_str());
      return 2;
    }
  }
  if (heads % kv_heads != 0) {
    std::fprintf(stderr,
                 "attention_bench: --heads (%lld) must be a multiple of --kv_heads (%lld)\n",
                 static_cast<long long>(heads), static_cast<long long>(kv_heads));
    return 2;
  }
  if (seq_lens.empty()) seq_lens = kind == BackendKind::kCuda ? "4096,16384" : "256,512";
  std::vector<int64_t> lens;
  for (absl::string_view s : absl::StrSplit(seq_lens, ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(s, &n) || n <= 0) {
      std::fprintf(stderr, "attention_bench: --seq_lens: expected positive integers, got '%s'\n",
                   seq_lens.c_str());
      return 2;
    }
    lens.push_back(n);
  }

  BackendOptions options;
  options.kind = kind;
  if (kind == BackendKind::kCpu) options.device_memory_bytes = int64_t{8} << 30;
  auto backend = Backend::Create(options);
  if (!backend.ok()) {
    std::fprintf(stderr, "attention_bench: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  Backend& be = **backend;
  auto stream = be.CreateStream("compute");
  if (!stream.ok()) {
    std::fprintf(stderr, "attention_bench: %s\n", stream.status().ToString().c_str());
    return 1;
  }
  std::string device(BackendKindName(kind));
  double peak = 0;
  if (auto view = be.QueryDevice(); view.ok() && !view->name.empty()) {
    device = view->name;
    peak = MfuPeakFlops(0, view->name, view->cc_major, view->cc_minor, /*bf16=*/true);
  }
  std::printf(
      "attention_bench: %s, bf16, batch %lld, heads %lld / kv_heads %lld, head_dim %lld, "
      "causal self block; bf16 dense peak %s\n",
      device.c_str(), static_cast<long long>(batch), static_cast<long long>(heads),
      static_cast<long long>(kv_heads), static_cast<long long>(head_dim),
      peak > 0 ? absl::StrFormat("%.1f TFLOP/s", peak / 1e12).c_str() : "unknown");
  // What the CUDA kernels chose on this device (their buffering): the
  // double/single ratio below means nothing where it chose single.
  std::string chosen;
  if (auto k = ModelKernels::Create(be); k.ok()) chosen = (*k)->Describe();
  if (!chosen.empty()) std::printf("%s\n", chosen.c_str());
  std::printf("\n%8s %-12s %10s %10s %10s %10s %10s %8s %9s %12s %12s\n", "T", "arithmetic", "fwd ms", "bwd ms",
              "fwd TF/s", "bwd TF/s", "bwd exec", "MFU", "time x", "|o diff|", "|grad diff|");
  std::string json = absl::StrCat("{\"bench\":\"attention\",\"when\":", JsonString(NowText()),
                                  ",\"device\":", JsonString(device), ",\"peak_bf16_flops\":", peak,
                                  ",\"batch\":", batch, ",\"heads\":", heads,
                                  ",\"kv_heads\":", kv_heads, ",\"head_dim\":", head_dim,
                                  ",\"kernels\":", JsonString(chosen), ",\"points\":[");
  bool first = true;
  int failures = 0;
  for (int64_t T : lens) {
    AttentionShape shape;
    shape.batch = batch;
    shape.q_len = shape.kv_len = T;
    shape.heads = heads;
    shape.kv_heads = kv_heads;
    shape.head_dim = head_dim;
    shape.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    std::vector<Point> points;
    struct Variant {
      Bf16Attention arith;
      bool double_buffer, wgmma;
    };
    std::vector<Variant> variants = {{Bf16Attention::kTiles, true, true},
                                     {Bf16Attention::kTensorCore, true, true}};
    if (kind == BackendKind::kCuda) {
      variants.push_back({Bf16Attention::kTensorCore, false, true});
      variants.push_back({Bf16Attention::kTensorCore, true, false});
    }
    for (const Variant& v : variants) {
      auto p = Measure(be, **stream, shape, v.arith, v.double_buffer, v.wgmma, min_time_s);
      if (!p.ok()) {
        std::printf("%8lld %-12s %s\n", static_cast<long long>(T),
                    Label(v.arith, v.double_buffer, v.wgmma), p.status().ToString().c_str());
        ++failures;
        continue;
      }
      points.push_back(std::move(*p));
    }
    const Point* tc_double = nullptr;
    const Point* tc_single = nullptr;
    const Point* tc_mma = nullptr;
    for (const Point& p : points) {
      if (p.arith != Bf16Attention::kTensorCore) continue;
      (!p.wgmma ? tc_mma : p.double_buffer ? tc_double : tc_single) = &p;
    }
    for (const Point& p : points) {
      const double fwd_tf = p.fwd_flops / p.fwd.best_s / 1e12;
      // Model counts (the MFU's), then what the backward kernels executed.
      const double bwd_tf = 2.5 * p.fwd_flops / p.bwd.best_s / 1e12;
      const int bwd_products = BackwardProducts(kind, p.arith);
      const double bwd_exec_tf = bwd_products / 2.0 * p.fwd_flops / p.bwd.best_s / 1e12;
      const double total_s = p.fwd.best_s + p.bwd.best_s;
      const double mfu = peak > 0 ? 3.5 * p.fwd_flops / total_s / peak : 0;
      const Point& base = points.front();
      const double ratio = total_s / (base.fwd.best_s + base.bwd.best_s);
      const double rel = RelDiff(p.o, base.o);
      const double grad_rel = std::max({RelDiff(p.dq, base.dq), RelDiff(p.dk, base.dk), RelDiff(p.dv, base.dv)});
      // Wrong is not slow: the two must agree within the rounding of P
      // (and of dS, for the gradients), and single buffering must not
      // change a bit of o.
      const bool agree = rel <= 1.0 / 64;
      const bool grads_agree = grad_rel <= 1.0 / 64;
      const bool same_bits = &p != tc_single || tc_double == nullptr || p.o == tc_double->o;
      if (!agree || !grads_agree || !same_bits) ++failures;
      std::printf("%8lld %-12s %10.2f %10.2f %10.2f %10.2f %10.2f %7.1f%% %9.3f %12.3g %12.3g%s%s%s\n",
                  static_cast<long long>(T), Label(p.arith, p.double_buffer, p.wgmma), p.fwd.best_s * 1e3,
                  p.bwd.best_s * 1e3, fwd_tf, bwd_tf, bwd_exec_tf, 100 * mfu, ratio, rel, grad_rel,
                  agree ? "" : "  WRONG: beyond 2^-6 of max |o|",
                  grads_agree ? "" : "  WRONG: a gradient beyond 2^-6 of its max",
                  same_bits ? "" : "  WRONG: single-buffered o differs from double-buffered");
      // double_buffer only where it means something: CUDA's tensor cores.
      const bool buffered = kind == BackendKind::kCuda && p.arith == Bf16Attention::kTensorCore;
      absl::StrAppendFormat(&json,
                            "%s{\"seq_len\":%d,\"arithmetic\":\"%s\"%s%s,\"fwd_s\":%.6g,"
                            "\"bwd_s\":%.6g,\"fwd_tflops\":%.4g,\"bwd_tflops\":%.4g,"
                            "\"bwd_executed_tflops\":%.4g,\"bwd_executed_products\":%d,"
                            "\"mfu\":%.4g,\"time_ratio_vs_tiles\":%.4g,"
                            "\"o_rel_diff_vs_tiles\":%.3g,\"grad_rel_diff_vs_tiles\":%.3g}",
                            first ? "" : ",", T, Bf16AttentionName(p.arith),
                            !buffered         ? ""
                            : p.double_buffer ? ",\"double_buffer\":true"
                                              : ",\"double_buffer\":false",
                            !buffered ? ""
                            : p.wgmma ? ",\"wgmma\":true"
                                      : ",\"wgmma\":false",
                            p.fwd.best_s, p.bwd.best_s, fwd_tf, bwd_tf, bwd_exec_tf, bwd_products, mfu, ratio, rel,
                            grad_rel);
      first = false;
    }
    if (tc_double != nullptr && tc_single != nullptr) {
      std::printf("%8lld tensor_core double / single buffered: forward %.3f, backward %.3f\n",
                  static_cast<long long>(T), tc_double->fwd.best_s / tc_single->fwd.best_s,
                  tc_double->bwd.best_s / tc_single->bwd.best_s);
    }
    if (tc_double != nullptr && tc_mma != nullptr) {
      std::printf("%8lld tensor_core as chosen (%s) / mma.sync: forward %.3f, backward %.3f\n",
                  static_cast<long long>(T),
                  chosen.find("on wgmma: yes") != std::string::npos ? "wgmma" : "mma.sync",
                  tc_double->fwd.best_s / tc_mma->fwd.best_s,
                  tc_double->bwd.best_s / tc_mma->bwd.best_s);
    }
    std::fflush(stdout);
  }
  absl::StrAppendFormat(&json, "],\"failures\":%d}", failures);
  std::printf("\n%s\n", json.c_str());
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace plateau::bench

int main(int argc, char** argv) { return plateau::bench::Main(argc, argv); }
