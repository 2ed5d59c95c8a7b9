// The `--name=value` command lines of Plateau's daemons and tools.
#ifndef PLATEAU_KERNELS_NAMED_FLAGS_H_
#define PLATEAU_KERNELS_NAMED_FLAGS_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace plateau {

// Reads argv[1..] into `flags`, whose keys are the known names and whose
// values are the defaults. Returns true when --help or -h was given (the
// caller prints its usage); an argument that is not --name=value, or names
// no known flag, is INVALID_ARGUMENT naming it. A flag whose default is
// "false" is a switch: a bare --name means --name=true.
inline absl::StatusOr<bool> ParseNamedFlags(int argc, char** argv,
                                            std::map<std::string, std::string>* flags) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return true;
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq == std::string::npos) {
      auto sw = flags->find(arg.substr(2));
      if (sw != flags->end() && sw->second == "false") {
        sw->second = "true";
        continue;
      }
    }
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("argument '", arg, "': expected --name=value (see --help)"));
    }
    const std::string name = arg.substr(2, eq - 2);
    auto it = flags->find(name);
    if (it == flags->end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    it->second = arg.substr(eq + 1);
  }
  return false;
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_NAMED_FLAGS_H_
