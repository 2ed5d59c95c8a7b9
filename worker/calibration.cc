#include "worker/calibration.h"

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/text_format.h"
#include "kernels/status_macros.h"

namespace plateau {
absl::StatusOr<Calibration> CalibrationFromProto(const v1::Calibration& p) {
  Calibration c;
  for (const v1::Calibration::GemmPoint& g : p.gemm()) c.gemm.push_back({g.rows(), g.seconds()});
  c.launch_seconds = p.launch_seconds();
  c.h2d_bytes_per_second = p.h2d_bytes_per_second();
  c.d2h_bytes_per_second = p.d2h_bytes_per_second();
  c.adamw_params_per_second = p.adamw_params_per_second();
  c.collective_seconds = p.collective_seconds();
  PLATEAU_RETURN_IF_ERROR(ValidateCalibration(c));
  return c;
}

v1::Calibration CalibrationToProto(const Calibration& c) {
  v1::Calibration p;
  for (const Calibration::GemmPoint& g : c.gemm) {
    v1::Calibration::GemmPoint* q = p.add_gemm();
    q->set_rows(g.rows);
    q->set_seconds(g.seconds);
  }
  p.set_launch_seconds(c.launch_seconds);
  p.set_h2d_bytes_per_second(c.h2d_bytes_per_second);
  p.set_d2h_bytes_per_second(c.d2h_bytes_per_second);
  p.set_adamw_params_per_second(c.adamw_params_per_second);
  p.set_collective_seconds(c.collective_seconds);
  return p;
}

std::string BinaryFingerprint(const std::vector<std::string>& paths) {
  std::vector<std::string> parts;
  for (const std::string& path : paths) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
      parts.push_back(absl::StrCat(path, ":missing"));
      continue;
    }
    parts.push_back(absl::StrCat(static_cast<int64_t>(st.st_size), ":",
                                 static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec));
  }
  return absl::StrJoin(parts, "+");
}

std::vector<std::string> LoadedComputeLibraries() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> libs;
  std::string line;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string name = path.substr(path.rfind('/') + 1);
    for (const char* lib : {"libopenblas", "libblas", "libcublas", "libnccl", "libcudart", "libcuda.", "libgloo"}) {
      if (name.rfind(lib, 0) == 0) libs.insert(path);
    }
  }
  return {libs.begin(), libs.end()};
}

std::string CalibrationCachePath(const std::string& work_dir, BackendKind kind) {
  return absl::StrCat(work_dir, "/calibration-", BackendKindName(kind), ".txtpb");
}

absl::StatusOr<v1::Calibration> LoadOrMeasureCalibration(
    const std::string& work_dir, BackendKind kind, const std::string& describe, const std::string& binary,
    const std::function<absl::StatusOr<v1::Calibration>()>& measure, bool* measured) {
  const std::string path = CalibrationCachePath(work_dir, kind);
  {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    v1::Calibration cached;
    if (in && google::protobuf::TextFormat::ParseFromString(text.str(), &cached) && cached.backend() == describe &&
        cached.binary() == binary && CalibrationFromProto(cached).ok()) {
      *measured = false;
      return cached;
    }
  }
  PLATEAU_ASSIGN_OR_RETURN(v1::Calibration fresh, measure());
  fresh.set_binary(binary);
  PLATEAU_RETURN_IF_ERROR(CalibrationFromProto(fresh).status());
  std::string text;
  google::protobuf::TextFormat::PrintToString(fresh, &text);
  // Written whole, then renamed: a reader never sees half a file.
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "# plateau_worker's calibration (worker/calibration.h); measured again when the backend or\n"
           "# the binaries change. Delete it to measure again.\n"
        << text;
    if (!out.flush()) return absl::UnavailableError(absl::StrCat("calibration cache: cannot write ", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("calibration cache: cannot rename ", tmp, " to ", path, ": ", ec.message()));
  *measured = true;
  return fresh;
}

}  // namespace plateau
