// Deterministic malformed job specs for the fuzz tests, and the invariants
// every spec must keep, shared by the in-process fuzz test
// (spec_fuzz_test), the gRPC fuzz test (submit_fuzz_test) and the manual
// libFuzzer target (spec_fuzzer).
//
// SpecMutator draws, from one seed, inputs of five kinds: random bytes;
// the valid spec's wire bytes with bit flips, byte changes, truncation,
// duplicated or inserted segments; its text format with random edits
// (deleted, duplicated or replaced characters and tokens); and the valid
// spec with a few fields (any field of JobSpec or its sub-messages, found by
// reflection) set to boundary values (0, -1, 2^k +- 1, INT64_MIN/MAX, NaN,
// +-inf, unknown enum numbers, bad paths) or cleared.
//
// Thread safety: a SpecMutator is used by one thread; the free functions
// have no shared state.
#ifndef PLATEAU_TESTS_SPEC_FUZZ_H_
#define PLATEAU_TESTS_SPEC_FUZZ_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "plateau/v1/job.pb.h"

namespace plateau {
namespace spec_fuzz {

// Valid specs the mutations start from: the demo job, the demo with
// Ring-DTP and checkpoints, a one-rank text job.
std::vector<v1::JobSpec> ValidSeeds();

class SpecMutator {
 public:
  enum class Kind { kRandomBytes, kWireEdit, kTextEdit, kFieldValues };
  struct Input {
    Kind kind;
    std::string bytes;  // kRandomBytes, kWireEdit: wire format; kTextEdit: text format
    v1::JobSpec spec;   // kFieldValues
    std::string what;   // the mutations made, for a failure message
  };

  explicit SpecMutator(uint64_t seed);

  Input Next();
  Input Next(Kind kind);
  // One valid seed with 1-3 fields set to boundary values or cleared.
  v1::JobSpec MutateFields(std::string* what);
  std::string RandomBytes(size_t max_len);
  std::string EditWire(std::string bytes, std::string* what);
  std::string EditText(std::string text, std::string* what);

  std::mt19937_64& rng() { return rng_; }

 private:
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  std::mt19937_64 rng_;
  std::vector<v1::JobSpec> seeds_;
};

const char* KindName(SpecMutator::Kind kind);

// The invariants of the validator on one spec, "" when they hold, else what
// broke: ValidateJobSpec, PlanJob and AdmitJob agree; a refusal is
// INVALID_ARGUMENT or UNIMPLEMENTED (RESOURCE_EXHAUSTED from AdmitJob only,
// naming device_memory_bytes or host_memory_bytes) whose message starts
// with a field of JobSpec ("model.heads: ", "data.shards.paths[1]: "); an
// accepted spec re-validates after a wire and a text-format round trip and
// plans consistently (every live set >= 0, their sum the total, in each
// space). *accepted says whether it was.
std::string CheckSpec(const v1::JobSpec& spec, bool* accepted = nullptr);

// Whether `message` starts with "FIELD: " for a field path of JobSpec.
bool NamesAField(absl::string_view message);

// Parses `data` as a wire-format and as a text-format JobSpec (through
// plateauctl's parser, whose errors must name a place) and checks each spec
// that parses. "" when every invariant holds; *accepted counts the specs
// (0, 1 or 2) the validator accepted.
std::string CheckBytes(absl::string_view data, int* accepted = nullptr);

}  // namespace spec_fuzz
}  // namespace plateau

#endif  // PLATEAU_TESTS_SPEC_FUZZ_H_
