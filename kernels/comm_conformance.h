// A conformance suite for Communicator implementations: every collective,
// every data type, checked against a local computation. The same suite runs
// on Gloo (ranks as threads or as processes) and on NCCL (device memory), so
// the backends are held to one contract.
//
// Each rank's input is a pure function of (seed, rank), so every rank
// computes the expected result of a collective locally from all ranks'
// inputs; no rank trusts another's output.
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
#include "kernels/communicator.h"
#include "kernels/stream.h"

namespace plateau {
namespace conformance {

// --- Inputs and references -------------------------------------------------

template <typename T>
constexpr DataType DataTypeOf() {
  if constexpr (std::is_same_v<T, float>) return DataType::kFloat32;
  if constexpr (std::is_same_v<T, double>) return DataType::kFloat64;
  if constexpr (std::is_same_v<T, int32_t>) return DataType::kInt32;
  return DataType::kInt64;
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

template <typename T>
std::vector<T> Input(int seed, int rank, size_t n) {
  std::mt19937_64 gen(static_cast<uint64_t>(seed) * 1000003u +
                      static_cast<uint64_t>(rank));
  std::vector<T> v(n);
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<double> d(-1.0, 1.0);
    for (auto& x : v) x = static_cast<T>(d(gen));
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

// op over `ranks` of Input(seed, r, n)[i], accumulated in double.
template <typename T>
std::vector<double> Reference(int seed, const std::vector<int>& ranks,
                              size_t n, ReduceOp op) {
  std::vector<double> out(n);
  for (size_t k = 0; k < ranks.size(); ++k) {
    std::vector<T> in = Input<T>(seed, ranks[k], n);
    for (size_t i = 0; i < n; ++i) {
      const double x = static_cast<double>(in[i]);
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

// "" when got matches want (to SumTolerance for sums, exactly otherwise);
// otherwise a description of the first few mismatches.
template <typename T>
std::string Mismatches(const T* got, const double* want, size_t n,
                       ReduceOp op) {
  const double tol = op == ReduceOp::kSum ? SumTolerance<T>() : 0.0;
  std::string msg;
  int bad = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(got[i]);
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
// (exact in float32 for the sizes used).
template <typename T>
T Tagged(int src, int dst, int64_t i) {
  return static_cast<T>(src * 1000000 + dst * 10000 + i);
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
  // Counts for the reductions and gathers: small, uneven and (when large is
  // set) several of Gloo's 1 MiB ring segments.
  bool large = true;
  // Also make groups (members only): the world reversed, and the odd ranks.
  bool groups = true;
};

// Runs every collective of `comm` on `stream` (all ranks of `comm` call it
// with the same options) and returns what went wrong, one line per failed
// check; empty when everything matched.
std::vector<std::string> RunConformance(Communicator& comm, Stream& stream,
                                        TestMemory& memory,
                                        const ConformanceOptions& options);

}  // namespace conformance
}  // namespace plateau

#endif  // PLATEAU_KERNELS_COMM_CONFORMANCE_H_
