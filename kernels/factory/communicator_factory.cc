// CreateCommunicator, defined above Gloo and NCCL so that both depend on
// the interface (kernels/communicator.h) and not on each other.
#include "absl/strings/str_cat.h"
#include "kernels/communicator.h"
#include "kernels/gloo_communicator.h"
#include "kernels/status_macros.h"
#ifdef PLATEAU_WITH_CUDA
#include "kernels/nccl/nccl_communicator.h"
#endif

namespace plateau {

absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(
    const CommunicatorOptions& options) {
  PLATEAU_RETURN_IF_ERROR(ValidateCommunicatorOptions(options));
  switch (options.backend) {
    case BackendKind::kCpu:
      return CreateGlooCommunicator(options);
    case BackendKind::kCuda:
#ifdef PLATEAU_WITH_CUDA
      return CreateNcclCommunicator(options);
#else
      return absl::FailedPreconditionError(
          "communicator: the cuda backend (NCCL) was asked for, but this "
          "build has none; rebuild with --config=cuda");
#endif
  }
  return absl::InvalidArgumentError("communicator: unknown backend");
}

}  // namespace plateau
