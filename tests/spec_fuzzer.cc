// libFuzzer target over the spec parsers and the validator: the same
// invariants as spec_fuzz_test (tests/spec_fuzz.h CheckBytes), with
// coverage-guided inputs. A manual tool, not a test:
//
//   bazel --output_base=/tmp/plateau-fuzz build --config=fuzz //tests:spec_fuzzer
//   mkdir -p /tmp/corpus && cp tools/demo_job.txtpb /tmp/corpus/
//   bazel-bin/tests/spec_fuzzer -max_total_time=60 -timeout=10 /tmp/corpus
//
// Without --config=fuzz it builds as a reproducer: it runs the files named
// on its command line through the same check and exits 1 on a violation.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/stubs/logging.h"
#include "tests/spec_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // proto3's parser logs every non-UTF-8 string it refuses.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  const std::string broke =
      plateau::spec_fuzz::CheckBytes(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!broke.empty()) {
    std::fprintf(stderr, "invariant broken: %s\n", broke.c_str());
    std::abort();
  }
  return 0;
}

#ifndef PLATEAU_LIBFUZZER
int main(int argc, char** argv) {
  int bad = 0;
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    const std::string bytes = s.str();
    const std::string broke =
        plateau::spec_fuzz::CheckBytes(bytes);
    std::printf("%s: %s\n", argv[i], broke.empty() ? "ok" : broke.c_str());
    bad += !broke.empty();
  }
  return bad == 0 ? 0 : 1;
}
#endif
