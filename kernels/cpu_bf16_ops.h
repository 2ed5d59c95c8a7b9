// The CPU emulation of bf16 mixed precision: the bf16 twins of cpu_ops.h,
// run by the CPU backend and used as the reference for the CUDA bf16
// kernels. Each op loads its bf16 inputs exactly into fp32, runs the fp32
// twin of cpu_ops.h on them (fp32 arithmetic; the reductions as that twin
// does them), and rounds every stored bf16 element once to nearest even
// (kernels/bf16.h). So each is, by construction, bitwise
// round(fp32 op(loaded inputs)), which is what the tests check, beside a
// double reference with the stated tolerances.
//
// The loaded copies live in scratch of the calling (stream) thread, host
// heap outside the backend's device arena: an artefact of emulating on a
// CPU whose BLAS and kernels take fp32 (cuBLASLt reads bf16 directly), so
// the device peaks the step measures are the buffers the plan lists and
// nothing more. The scratch is kept per thread and grows to the largest
// call; it is not freed between calls.
//
// Arguments are assumed validated (kernels/backend_bf16.cc).
#ifndef PLATEAU_KERNELS_CPU_BF16_OPS_H_
#define PLATEAU_KERNELS_CPU_BF16_OPS_H_

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/cpu_pool.h"

namespace plateau::cpu {

// The per-thread scratch of the loaded copies: slot 0..kBf16ScratchSlots-1,
// at least n floats, valid until the same slot is asked for again on this
// thread. LoadToScratch fills one with the exact fp32 values of src.
inline constexpr int kBf16ScratchSlots = 8;
float* Bf16Scratch(int slot, int64_t n);
const float* LoadToScratch(int slot, const Bf16* src, int64_t n, CpuPool* pool = nullptr);

void ConvertToBf16(Bf16* out, const float* x, int64_t n, CpuPool* pool = nullptr);
void ConvertToFloat(float* out, const Bf16* x, int64_t n, CpuPool* pool = nullptr);

// OpenBLAS sgemm (fp32 products and sums) on the loaded A and B, then
// C = rn(alpha * AB + beta * C) per element for a bf16 C; for an fp32 C,
// sgemm's own epilogue (what cpu::Gemm gives on the loaded inputs).
void GemmBf16(const GemmBf16Args& g);

void SwiGluForwardBf16(Bf16* out, const Bf16* gate, const Bf16* up, int64_t n,
                       CpuPool* pool = nullptr);
void SwiGluBackwardBf16(Bf16* dgate, Bf16* dup, const Bf16* dout, const Bf16* gate,
                        const Bf16* up, int64_t n, CpuPool* pool = nullptr);
void RmsNormForwardBf16(Bf16* out, float* rstd, const Bf16* x, const Bf16* weight, int64_t rows,
                        int64_t cols, float eps, CpuPool* pool = nullptr);
void RmsNormBackwardBf16(Bf16* dx, Bf16* dweight, const Bf16* dout, const Bf16* x,
                         const Bf16* weight, const float* rstd, int64_t rows, int64_t cols,
                         CpuPool* pool = nullptr);

// AdamW of cpu_ops.h on the master with the loaded gradient, then
// working = rn(master).
void AdamWBf16(float* master, const Bf16* grad, float* m, float* v, Bf16* working, int64_t n,
               const AdamWArgs& args, CpuPool* pool = nullptr);

void FillBf16(Bf16* x, int64_t n, float value, CpuPool* pool = nullptr);
// out = rn(a + b) (cpu_ops.h's Add on the loaded values); out may alias.
void AddBf16(Bf16* out, const Bf16* a, const Bf16* b, int64_t n, CpuPool* pool = nullptr);
// cpu_ops.h's SumSquares (double blocks) on the loaded values.
void SumSquaresBf16(float* out, const Bf16* x, int64_t n, CpuPool* pool = nullptr);
// out[i] = rn(((x[0][i] + x[1][i]) + ...) + x[rows-1][i]), row r at x + r * ld:
// the loaded values summed in fp32 in row order, rounded once (what the
// CUDA kernel computes, bit for bit: a fixed order and no FMA).
void SumRowsBf16(Bf16* out, const Bf16* x, int64_t rows, int64_t n, int64_t ld, CpuPool* pool = nullptr);
// out[i] = rn(((out[i] + x[rows[0] ld + i]) + ...) + x[rows[count-1] ld + i]):
// out's loaded value, then the listed rows in list order, summed in fp32 and
// rounded once (what the CUDA kernel computes, bit for bit).
void AddRowsBf16(Bf16* out, const Bf16* x, const int32_t* rows, int64_t count, int64_t ld, int64_t n,
                 CpuPool* pool = nullptr);

}  // namespace plateau::cpu

#endif  // PLATEAU_KERNELS_CPU_BF16_OPS_H_
