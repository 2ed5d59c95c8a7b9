#include "worker/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <set>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "nlohmann/json.hpp"
#include "proto/utf8.h"
#include "worker/file_errors.h"

namespace plateau {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100 << 20;

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Writes all `bytes` at file offset `at`.
absl::Status WriteAll(int fd, const void* data, size_t bytes, uint64_t at, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = pwrite(fd, p, bytes, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(absl::StrCat(path, ": write failed: ", std::strerror(errno)));
    p += n;
    at += n;
    bytes -= n;
  }
  return absl::OkStatus();
}

// Reads all `bytes` at file offset `at`; false on an error or end of file.
// OK; DATA_LOSS (`what`) where the file ends first; FileError where the
// read fails (EIO, ESTALE: the file may be whole, a later attempt may read
// it, so the resume is retried, not refused).
absl::Status ReadAll(int fd, void* data, size_t bytes, uint64_t at, const std::string& path, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    ssize_t n = pread(fd, p, bytes, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return FileError(absl::StrCat(path, ": read failed"), errno);
    if (n == 0) return absl::DataLossError(absl::StrCat(path, ": ", what));
    p += n;
    at += n;
    bytes -= n;
  }
  return absl::OkStatus();
}

// A name from the file as an error shows it: at most 200 bytes. A hostile
// header's names may be megabytes, and the rank's error line would then be
// cut by the agent (worker/agent.cc) and lose its message.
std::string Shown(const std::string& name) {
  constexpr size_t kMax = 200;
  if (name.size() <= kMax) return name;
  // On a character boundary: the message travels in a proto3 string.
  return absl::StrCat(Utf8Prefix(name, kMax), "... (", name.size(), " bytes)");
}

// A dtype that is not "F32": a string as such, anything else by its JSON
// type. Never dump() it: serialising recurses once per level of nesting,
// and a header of a million '[' overflowed the stack.
std::string ShownDtype(const nlohmann::json& dtype) {
  if (dtype.is_string()) return absl::StrCat("\"", Shown(dtype.get<std::string>()), "\"");
  return absl::StrCat("a JSON ", dtype.type_name());
}

}  // namespace

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, const std::vector<TensorSpec>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const TensorSpec& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: bad or duplicate tensor name '", t.name, "'"));
    }
    for (int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor '", t.name, "' has a negative dimension"));
    }
    const uint64_t bytes = Numel(t.shape) * sizeof(float);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    w->begin_.push_back(offset);
    w->numel_.push_back(Numel(t.shape));
    offset += bytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data to 8 bytes
  const uint64_t header_len = text.size();

  w->path_ = path;
  w->tmp_ = absl::StrCat(path, ".tmp.", getpid());
  w->tensors_ = tensors;
  w->written_.assign(tensors.size(), 0);
  w->ranges_.resize(tensors.size());
  w->data_start_ = 8 + header_len;
  // Whatever is under the temporary's name goes first (a killed writer's
  // file of a reused pid, or a link someone planted: truncating through a
  // symbolic or hard link would empty whatever it points at), then a new
  // file, never through a link.
  unlink(w->tmp_.c_str());
  w->fd_ = open(w->tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (w->fd_ < 0) return absl::InternalError(absl::StrCat(w->tmp_, ": cannot create: ", std::strerror(errno)));
  unsigned char len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(header_len >> (8 * i));
  PLATEAU_RETURN_IF_ERROR(WriteAll(w->fd_, len_le, 8, 0, w->tmp_));
  PLATEAU_RETURN_IF_ERROR(WriteAll(w->fd_, text.data(), text.size(), 8, w->tmp_));
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    close(fd_);
    std::remove(tmp_.c_str());
  }
}

absl::Status SafetensorsWriter::Write(size_t tensor, int64_t offset, const float* values, int64_t n) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": written after Commit"));
  if (tensor >= tensors_.size() || offset < 0 || n < 0 || offset + n > numel_[tensor]) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": values [", offset, ", ", offset + n, ") of tensor ",
        tensor < tensors_.size() ? "'" + tensors_[tensor].name + "'" : absl::StrCat(tensor), " are out of range"));
  }
  if (n == 0) return absl::OkStatus();
  // Refuse an overlap with what was written; merge with the neighbours.
  std::map<int64_t, int64_t>& ranges = ranges_[tensor];
  auto next = ranges.lower_bound(offset);  // the first range starting at or after offset
  const bool overlaps = (next != ranges.end() && next->first < offset + n) ||
                        (next != ranges.begin() && std::prev(next)->second > offset);
  if (overlaps) {
    return absl::InternalError(absl::StrCat(path_, ": values [", offset, ", ", offset + n, ") of tensor '",
                                            tensors_[tensor].name, "' were written before"));
  }
  int64_t begin = offset, end = offset + n;
  if (next != ranges.end() && next->first == end) {
    end = next->second;
    next = ranges.erase(next);
  }
  if (next != ranges.begin() && std::prev(next)->second == begin) {
    begin = std::prev(next)->first;
    ranges.erase(std::prev(next));
  }
  ranges[begin] = end;
  written_[tensor] += n;
  return WriteAll(fd_, values, n * sizeof(float), data_start_ + begin_[tensor] + offset * sizeof(float), tmp_);
}

absl::Status SafetensorsWriter::Commit() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": committed twice"));
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (written_[i] != numel_[i]) {
      return absl::InternalError(absl::StrCat(path_, ": tensor '", tensors_[i].name, "' got ", written_[i],
                                              " values written, expected ", numel_[i]));
    }
  }
  absl::Status s;
  if (fsync(fd_) != 0) s = absl::InternalError(absl::StrCat(tmp_, ": fsync failed: ", std::strerror(errno)));
  close(fd_);
  fd_ = -1;
  if (s.ok() && std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    s = absl::InternalError(absl::StrCat(path_, ": rename failed: ", std::strerror(errno)));
  }
  if (!s.ok()) {
    std::remove(tmp_.c_str());
    return s;
  }
  // The rename is durable only once the directory is: without this a
  // power loss could take back a checkpoint reported saved.
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  const int dfd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || fsync(dfd) != 0) {
    s = absl::InternalError(
        absl::StrCat(dir, ": fsync of the directory after writing ", path_, " failed: ", std::strerror(errno)));
  }
  if (dfd >= 0) close(dfd);
  return s;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorView>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  for (const TensorView& t : tensors) {
    if (Numel(t.shape) > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor '", t.name, "' has no data"));
    }
    specs.push_back({t.name, t.shape});
  }
  PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> w, SafetensorsWriter::Create(path, specs, metadata));
  for (size_t i = 0; i < tensors.size(); ++i) {
    PLATEAU_RETURN_IF_ERROR(w->Write(i, 0, tensors[i].data, Numel(tensors[i].shape)));
  }
  return w->Commit();
}

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(const std::string& path) {
  std::unique_ptr<SafetensorsReader> r(new SafetensorsReader());
  r->path_ = path;
  PLATEAU_ASSIGN_OR_RETURN(r->fd_, OpenRegularFile(path));
  struct stat st;
  if (fstat(r->fd_, &st) != 0) return absl::InternalError(absl::StrCat(path, ": stat failed: ", std::strerror(errno)));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  auto corrupt = [&path](const std::string& why) {
    return absl::DataLossError(absl::StrCat(path, ": not a valid safetensors file: ", why));
  };
  if (size < 8) return corrupt("shorter than its 8-byte header length");
  unsigned char len_le[8];
  PLATEAU_RETURN_IF_ERROR(
      ReadAll(r->fd_, len_le, 8, 0, path, "not a valid safetensors file: short read in the header length"));
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t{len_le[i]} << (8 * i);
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return corrupt(absl::StrCat("header length ", header_len, " does not fit the file of ", size, " bytes"));
  }
  std::string text(header_len, '\0');
  PLATEAU_RETURN_IF_ERROR(
      ReadAll(r->fd_, text.data(), header_len, 8, path, "not a valid safetensors file: short read in the header"));
  const uint64_t data_bytes = size - 8 - header_len;
  nlohmann::json header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return corrupt("the header is not a JSON object");

  struct Span { uint64_t begin, end; std::string name; };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return corrupt("__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return corrupt(absl::StrCat("metadata '", Shown(m.key()), "' is not a string"));
        r->metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const nlohmann::json& e = *it;
    const std::string& name = it.key();
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets")) {
      return corrupt(absl::StrCat("tensor '", Shown(name), "' lacks dtype, shape or data_offsets"));
    }
    if (e["dtype"] != "F32") {
      return corrupt(
          absl::StrCat("tensor '", Shown(name), "' has dtype ", ShownDtype(e["dtype"]), ", expected \"F32\""));
    }
    const nlohmann::json& sh = e["shape"];
    const nlohmann::json& off = e["data_offsets"];
    if (!sh.is_array() || !off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return corrupt(absl::StrCat("tensor '", Shown(name), "' has a malformed shape or data_offsets"));
    }
    Entry t;
    uint64_t numel = 1;
    for (const auto& d : sh) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        return corrupt(absl::StrCat("tensor '", Shown(name), "' has a bad dimension"));
      }
      const uint64_t dim = d.get<uint64_t>();
      t.shape.push_back(static_cast<int64_t>(dim));
      // Checked before multiplying: the product must not wrap (a shape of
      // [4, 2^62] is not one of 0 values).
      if (dim != 0 && numel > data_bytes / dim) {
        return corrupt(absl::StrCat("tensor '", Shown(name), "' is larger than the file"));
      }
      numel *= dim;
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_bytes || end - begin != numel * sizeof(float)) {
      return corrupt(absl::StrCat("tensor '", Shown(name), "' data_offsets [", begin, ", ", end,
                                  ") do not match its shape or the ", data_bytes, " data bytes"));
    }
    t.begin = 8 + header_len + begin;
    spans.push_back({begin, end, name});
    r->tensors_.emplace(name, std::move(t));
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      return corrupt(absl::StrCat("tensors '", Shown(spans[i - 1].name), "' and '", Shown(spans[i].name), "' overlap"));
    }
  }
  return r;
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) close(fd_);
}

absl::Status SafetensorsReader::Read(const std::string& name, int64_t offset, float* values, int64_t n) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return absl::NotFoundError(absl::StrCat(path_, ": no tensor '", name, "'"));
  if (offset < 0 || n < 0 || offset + n > Numel(it->second.shape)) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": values [", offset, ", ", offset + n,
                                                   ") of tensor '", name, "' are out of range"));
  }
  return ReadAll(fd_, values, n * sizeof(float), it->second.begin + offset * sizeof(float), path_,
                 absl::StrCat("short read in tensor '", name, "'"));
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  PLATEAU_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> r, SafetensorsReader::Open(path));
  SafetensorsFile out;
  out.metadata = r->metadata();
  for (const auto& [name, e] : r->tensors()) {
    Tensor t;
    t.shape = e.shape;
    t.data.resize(Numel(e.shape));
    PLATEAU_RETURN_IF_ERROR(r->Read(name, 0, t.data.data(), static_cast<int64_t>(t.data.size())));
    out.tensors.emplace(name, std::move(t));
  }
  return out;
}

}  // namespace plateau
