// A conformance suite for Communicator implementations: every collective,
// every data type (bf16 included), checked against a local computation. The same suite runs
// on Gloo (ranks as threads or as processes) and on NCCL (device memory), so
// the backends are held to one contract.
//
// Each rank's input is a pure function of (seed, rank), so every rank
// computes the expected result of a collective locally from all ranks'
// inputs; no rank trusts another's output. Beyond each rank's own check,
// the ranks compare their all-reduce results bitwise with each other (each
// rank turns the gradient norm's all-reduce into its own clip factor: ranks
// one ulp apart would drift), and one all-reduce runs twice to the same bits.
//
// Test-only code; not thread-compatible beyond one call per rank.
#ifndef PLATEAU_KERNELS_COMM_CONFORMANCE_H_
#define PLATEAU_KERNELS_COMM_CONFORMANCE_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "kernels/communicator.h"
#include "kernels/stream.h"

namespace plateau {
namespace conformance {

// --- Inputs and references -------------------------------------------------

template <typename T>
inline constexpr bool kNoDataType = false;

// The DataType of element type T; a type without one does not compile (a
// silent default would describe its elements with another type's size).
template <typename T>
constexpr DataType DataTypeOf() {
  if constexpr (std::is_same_v<T, float>) {
    return DataType::kFloat32;
  } else if constexpr (std::is_same_v<T, double>) {
    return DataType::kFloat64;
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return DataType::kInt32;
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return DataType::kInt64;
  } else if constexpr (std::is_same_v<T, Bf16>) {
    return DataType::kBfloat16;
  } else {
    static_assert(kNoDataType<T>, "DataTypeOf: T has no DataType (communicator.h)");
    return DataType::kInt64;
  }
}

// An element's value as a double (exact for every type here).
template <typename T>
double ToDouble(T x) {
  if constexpr (std::is_same_v<T, Bf16>) {
    return static_cast<double>(Bf16ToFloat(x));
  } else {
    return static_cast<double>(x);
  }
}

// The element nearest v (v itself for the small integers used).
template <typename T>
T FromDouble(double v) {
  if constexpr (std::is_same_v<T, Bf16>) {
    return FloatToBf16(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

// Floating-point sums differ from the double reference by rounding only
// (inputs in [-1, 1), at most a few ranks); everything else is exact (int64
// inputs stay below 2^41, so their sums are exact in double too).
template <typename T>
constexpr double SumTolerance() {
  if constexpr (std::is_same_v<T, float>) return 1e-5;
  if constexpr (std::is_same_v<T, double>) return 1e-13;
  return 0.0;
}

// How far a sum over `ranks` ranks may be from the double reference, given
// `magnitude`, the sum of the terms' magnitudes. bf16 (communicator.h): each
// combining step adds in fp32 and rounds once to bf16, so P - 1 roundings of
// at most 2^-8 of a partial sum, each partial sum at most the magnitude
// grown by the roundings before it; the other types: SumTolerance.
template <typename T>
double SumBound(int ranks, double magnitude) {
  if constexpr (std::is_same_v<T, Bf16>) {
    return std::max(ranks - 1, 0) * kBf16UnitRoundoff * magnitude * std::pow(1.0 + kBf16UnitRoundoff, ranks);
  } else {
    return SumTolerance<T>();
  }
}

template <typename T>
std::vector<T> Input(int seed, int rank, size_t n) {
  std::mt19937_64 gen(static_cast<uint64_t>(seed) * 1000003u +
                      static_cast<uint64_t>(rank));
  std::vector<T> v(n);
  if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, Bf16>) {
    std::uniform_real_distribution<double> d(-1.0, 1.0);
    for (auto& x : v) x = FromDouble<T>(d(gen));
  } else if constexpr (sizeof(T) == 4) {
    std::uniform_int_distribution<int32_t> d(-1000000, 1000000);
    for (auto& x : v) x = d(gen);
  } else {
    std::uniform_int_distribution<int64_t> d(-(int64_t{1} << 40),
                                             int64_t{1} << 40);
    for (auto& x : v) x = d(gen);
  }
  return v;
}

// op over `ranks` of Input(seed, r, n)[i], accumulated in double; and,
// when `magnitude` is set, the sum of the terms' magnitudes per element
// (what SumBound needs).
template <typename T>
std::vector<double> Reference(int seed, const std::vector<int>& ranks, size_t n, ReduceOp op,
                              std::vector<double>* magnitude = nullptr) {
  std::vector<double> out(n);
  if (magnitude != nullptr) magnitude->assign(n, 0.0);
  for (size_t k = 0; k < ranks.size(); ++k) {
    std::vector<T> in = Input<T>(seed, ranks[k], n);
    for (size_t i = 0; i < n; ++i) {
      const double x = ToDouble(in[i]);
      if (magnitude != nullptr) (*magnitude)[i] += std::abs(x);
      if (k == 0) {
        out[i] = x;
      } else if (op == ReduceOp::kSum) {
        out[i] += x;
      } else if (op == ReduceOp::kMax) {
        out[i] = std::max(out[i], x);
      } else {
        out[i] = std::min(out[i], x);
      }
    }
  }
  return out;
}

// Ranks 0..size-1.
std::vector<int> Iota(int size);

// "" when got matches want (sums: to SumBound over `ranks` ranks of each
// element's `magnitude`, or to SumTolerance without magnitudes; max and min
// exactly); otherwise a description of the first few mismatches.
template <typename T>
std::string Mismatches(const T* got, const double* want, size_t n, ReduceOp op, const double* magnitude = nullptr,
                       int ranks = 0) {
  std::string msg;
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = ToDouble(got[i]);
    const double tol = op != ReduceOp::kSum   ? 0.0
                       : magnitude != nullptr ? SumBound<T>(ranks, magnitude[i])
                                              : SumTolerance<T>();
    if (!(std::abs(g - want[i]) <= tol)) {
      if (bad < 3) {
        absl::StrAppend(&msg, " [", i, "] is ", g, ", expected ", want[i], ";");
      }
      ++bad;
    }
  }
  if (bad > 0) absl::StrAppend(&msg, " ", bad, " of ", n, " elements wrong");
  return msg;
}

// The uneven all-to-all-v pattern: elements rank `src` sends rank `dst`.
// Some pairs are empty (0 -> 1, 0 -> 3, 2 -> 0, and rank 2's block to
// itself) and, for P > 1, the last rank receives nothing at all.
int64_t AllToAllVSplit(int src, int dst, int size);

// An element's value says where it came from and where it was going
// (exact in float32 for the sizes used). A bf16 holds it in its bits:
// source and destination modulo 8 and the index modulo 256, a positive
// finite value (the suite's counts stay below 256).
template <typename T>
T Tagged(int src, int dst, int64_t i) {
  if constexpr (std::is_same_v<T, Bf16>) {
    return Bf16{static_cast<uint16_t>(((src % 8) * 8 + dst % 8) * 256 + i % 256)};
  } else {
    return static_cast<T>(src * 1000000 + dst * 10000 + i);
  }
}

// --- The suite ---------------------------------------------------------------

// The memory collectives run on: host memory on the CPU, device memory on
// CUDA. Copies are synchronous.
class TestMemory {
 public:
  virtual ~TestMemory() = default;
  // nullptr for 0 bytes.
  virtual void* Alloc(size_t bytes) = 0;
  virtual void Free(void* p) = 0;
  virtual void CopyIn(void* dst, const void* host, size_t bytes) = 0;
  virtual void CopyOut(void* host, const void* src, size_t bytes) = 0;
};

class HostMemory final : public TestMemory {
 public:
  void* Alloc(size_t bytes) override;
  void Free(void* p) override;
  void CopyIn(void* dst, const void* host, size_t bytes) override;
  void CopyOut(void* host, const void* src, size_t bytes) override;
};

struct ConformanceOptions {
  int seed = 1;
  // Counts for the reductions and gathers: small, uneven and, when large is
  // set, large ones too: the all-reduce's span several of Gloo's 1 MiB
  // all-reduce segments (300007 elements, 1.2 MB in fp32), and one fp32 sum's
  // reduce-scatter block spans two of the Gloo communicator's 4 MiB
  // reduce-scatter segments (the others' blocks are below one).
  bool large = true;
  // Also make groups (members only): the world reversed, and the odd ranks.
  bool groups = true;
};

// The count of the all-reduce (a sum) the suite runs twice per type, on
// fresh buffers with the same inputs, expecting the same bits: large (1 MiB
// in fp32, many chunks of a ring at any P), and no other case's count.
inline constexpr size_t kRepeatedAllReduceCount = 262147;

// Runs every collective of `comm` on `stream` (all ranks of `comm` call it
// with the same options) and returns what went wrong, one line per failed
// check; empty when everything matched.
std::vector<std::string> RunConformance(Communicator& comm, Stream& stream,
                                        TestMemory& memory,
                                        const ConformanceOptions& options);

}  // namespace conformance
}  // namespace plateau

#endif  // PLATEAU_KERNELS_COMM_CONFORMANCE_H_
