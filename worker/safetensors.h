// Checkpoint files in the safetensors format: an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__":
// {string: string}}, then the raw little-endian tensor bytes. Tensors are
// fp32 ("F32"). Any safetensors reader (the Python package, PyTorch) opens
// Plateau checkpoints, with the weight names of docs/MODEL.md.
//
// Writes are atomic (a temporary file, fsync, rename): a crash mid-write
// never leaves a torn checkpoint under the final name. Reads validate the
// header against the file and name the file and tensor on any mismatch.
#ifndef PLATEAU_WORKER_SAFETENSORS_H_
#define PLATEAU_WORKER_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace plateau {

struct TensorView {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // numel(shape) floats
};

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<TensorView>& tensors,
                              const std::map<std::string, std::string>& metadata);

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

// A tensor's name and shape, without its values.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// A file written in pieces, for state too large to hold on the host at
// once (worker/trainer.cc streams checkpoints through it): the header, laid
// out exactly as WriteSafetensors lays out the same tensors, is written by
// Create; then values of any tensor at any offset, in any order; Commit
// syncs and renames the file into place. A value written twice is refused
// when it is written, and Commit fails unless every value of every tensor
// was written (one never written would read back as zero). Host memory: the
// header and, per tensor, the written ranges not yet merged into one.
// Destroyed uncommitted, it removes its temporary file.
class SafetensorsWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, const std::vector<TensorSpec>& tensors,
      const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Values [offset, offset + n) of tensor `tensor` (an index into Create's
  // list).
  absl::Status Write(size_t tensor, int64_t offset, const float* values, int64_t n);
  absl::Status Commit();

 private:
  SafetensorsWriter() = default;

  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t data_start_ = 0;  // 8 + header length
  std::vector<TensorSpec> tensors_;
  std::vector<uint64_t> begin_;     // each tensor's first byte in the data
  std::vector<int64_t> numel_, written_;
  // Per tensor, the written ranges [begin, end), merged where they touch:
  // one range once a tensor's runs arrive in order.
  std::vector<std::map<int64_t, int64_t>> ranges_;
};

// A file read in pieces: Open reads and checks the header against the file
// (as ReadSafetensors does); Read copies any range of one tensor's values.
// Host memory: the header alone.
class SafetensorsReader {
 public:
  struct Entry {
    std::vector<int64_t> shape;
    uint64_t begin = 0;  // byte offset of its first value in the file
  };
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::map<std::string, Entry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Values [offset, offset + n) of the tensor named `name`.
  absl::Status Read(const std::string& name, int64_t offset, float* values, int64_t n) const;

 private:
  SafetensorsReader() = default;

  std::string path_;
  int fd_ = -1;
  std::map<std::string, Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace plateau

#endif  // PLATEAU_WORKER_SAFETENSORS_H_
