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

}  // namespace plateau

#endif  // PLATEAU_WORKER_SAFETENSORS_H_
