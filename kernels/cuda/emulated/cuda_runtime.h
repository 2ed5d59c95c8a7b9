// The SIMT emulation's stand-in for CUDA's <cuda_runtime.h> (kernels/cuda/simt_emulator.h):
// only the emulated test targets see this folder.
#include "kernels/cuda/simt_emulator.h"
