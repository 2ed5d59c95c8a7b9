#include "worker/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace plateau {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100 << 20;

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(absl::StrCat(path, ": write failed: ", std::strerror(errno)));
    p += n;
    bytes -= n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorView>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const TensorView& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: bad or duplicate tensor name '", t.name, "'"));
    }
    for (int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor '", t.name, "' has a negative dimension"));
    }
    const uint64_t bytes = Numel(t.shape) * sizeof(float);
    if (bytes > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor '", t.name, "' has no data"));
    }
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data to 8 bytes
  const uint64_t header_len = text.size();

  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat(tmp, ": cannot create: ", std::strerror(errno)));
  unsigned char len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(header_len >> (8 * i));
  absl::Status s = WriteAll(fd, len_le, 8, tmp);
  if (s.ok()) s = WriteAll(fd, text.data(), text.size(), tmp);
  for (const TensorView& t : tensors) {
    if (!s.ok()) break;
    s = WriteAll(fd, t.data, Numel(t.shape) * sizeof(float), tmp);
  }
  if (s.ok() && fsync(fd) != 0) s = absl::InternalError(absl::StrCat(tmp, ": fsync failed"));
  close(fd);
  if (s.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    s = absl::InternalError(absl::StrCat(path, ": rename failed: ", std::strerror(errno)));
  }
  if (!s.ok()) std::remove(tmp.c_str());
  return s;
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  auto corrupt = [&path](const std::string& why) {
    return absl::DataLossError(absl::StrCat(path, ": not a valid safetensors file: ", why));
  };
  if (size < 8) return corrupt("shorter than its 8-byte header length");
  unsigned char len_le[8];
  in.read(reinterpret_cast<char*>(len_le), 8);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t{len_le[i]} << (8 * i);
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return corrupt(absl::StrCat("header length ", header_len, " does not fit the file of ", size, " bytes"));
  }
  std::string text(header_len, '\0');
  in.read(text.data(), header_len);
  const uint64_t data_bytes = size - 8 - header_len;
  nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return corrupt("the header is not a JSON object");

  SafetensorsFile out;
  struct Span { uint64_t begin, end; std::string name; };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return corrupt("__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return corrupt(absl::StrCat("metadata '", m.key(), "' is not a string"));
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const nlohmann::json& e = *it;
    const std::string& name = it.key();
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets")) {
      return corrupt(absl::StrCat("tensor '", name, "' lacks dtype, shape or data_offsets"));
    }
    if (e["dtype"] != "F32") {
      return corrupt(absl::StrCat("tensor '", name, "' has dtype ", e["dtype"].dump(), ", expected \"F32\""));
    }
    const nlohmann::json& sh = e["shape"];
    const nlohmann::json& off = e["data_offsets"];
    if (!sh.is_array() || !off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return corrupt(absl::StrCat("tensor '", name, "' has a malformed shape or data_offsets"));
    }
    Tensor t;
    uint64_t numel = 1;
    for (const auto& d : sh) {
      if (!d.is_number_unsigned()) return corrupt(absl::StrCat("tensor '", name, "' has a bad dimension"));
      t.shape.push_back(d.get<int64_t>());
      numel *= d.get<uint64_t>();
      if (numel > data_bytes) return corrupt(absl::StrCat("tensor '", name, "' is larger than the file"));
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_bytes || end - begin != numel * sizeof(float)) {
      return corrupt(absl::StrCat("tensor '", name, "' data_offsets [", begin, ", ", end,
                                  ") do not match its shape or the ", data_bytes, " data bytes"));
    }
    t.data.resize(numel);
    in.seekg(8 + header_len + begin);
    in.read(reinterpret_cast<char*>(t.data.data()), end - begin);
    if (!in) return corrupt(absl::StrCat("short read in tensor '", name, "'"));
    spans.push_back({begin, end, name});
    out.tensors.emplace(name, std::move(t));
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      return corrupt(absl::StrCat("tensors '", spans[i - 1].name, "' and '", spans[i].name, "' overlap"));
    }
  }
  return out;
}

}  // namespace plateau
