// Causal grouped-query attention with an online softmax (the FlashAttention
// recurrence), on the CPU, tiled as the CUDA kernel will be: a tile of 64
// query rows meets the keys 64 at a time; the 64 x 64 score tile stays in
// cache and no T x T score matrix, nor a score row of the whole block,
// exists. The tile products are the kernel's own loops (not OpenBLAS), so
// that tiles run on the CPU pool's threads at once: AVX2, or AVX-512 chosen
// at run time where the CPU has it. The transposed operands (K^T, V^T) are
// packed into contiguous panels once per key tile for every query tile and
// head of the group; the others are read in place. Each output element is
// one chain of fused multiply-adds in a fixed order whichever kernel runs, so
// the AVX2, AVX-512 and scalar paths give the same bits (attention_test
// checks it).
//
// The unit of work is a *block pair*: the queries a rank holds against one
// block of keys/values, which may be its own or one that arrived over the
// ring (ring attention). Forward folds each K/V block into a running state
// per query row and head (max m, sum l, unnormalised output acc); after the
// last block, Finalize turns the state into the output and the log-sum-exp
// that backward needs. Backward recomputes the scores of each block pair from
// q, k and the saved log-sum-exp; dK and dV of a block accumulate into
// buffers that travel with the block.
//
// Layouts (row-major): q, acc, o, dq: [batch, q_len, heads, head_dim];
// k, v, dk, dv: [batch, kv_len, kv_heads, head_dim]; m, l, lse, delta:
// [batch, q_len, heads]. Query head i reads K/V head i / (heads / kv_heads).
// Row t of sequence b in the query block has global position q_pos0 + t; in
// the K/V block kv_pos0 + t. A key is visible when its position <= the
// query's (causal), and only within the same sequence b.
//
// Every function is deterministic: a fixed tile order, no atomics. `work`
// is caller-provided scratch of AttentionWorkspaceFloats() floats, so that
// the step accounts for it in its live sets. `pool` (kernels/cpu_pool.h):
// forward splits into (sequence, K/V head, query tile) tasks, backward into
// (sequence, K/V head) tasks, each writing its own outputs with its own
// scratch slot, so the bits are the same without a pool and for any pool
// size. Exponentials use kernels/cpu_exp.h (within 2 ulps of std::exp).
#ifndef PLATEAU_KERNELS_MODEL_ATTENTION_H_
#define PLATEAU_KERNELS_MODEL_ATTENTION_H_

#include <cstdint>

#include "kernels/cpu_pool.h"
#include "kernels/model/attention_shape.h"

namespace plateau {


// A block's flops, for PoolFor (kernels/cpu_pool.h): below kPoolMinWork the
// tasks run on the calling thread. Tile products per (query, key, dimension)
// of a head: the forward's two (S = QK^T, PV), the backward's five (S, dV,
// dP, dQ, dK); causal masking is ignored (a bound).
int64_t AttentionForwardFlops(const AttentionShape& s);
int64_t AttentionBackwardFlops(const AttentionShape& s);

// m = -inf, l = 0, acc = 0.
void AttentionInitState(const AttentionShape& s, float* m, float* l,
                        float* acc,
    CpuPool* pool = nullptr);

// Folds the K/V block into the running state.
void AttentionForwardBlock(const AttentionShape& s, const float* q,
                           const float* k, const float* v, float* m, float* l,
                           float* acc, float* work,
    CpuPool* pool = nullptr);

// o = acc / l (in place: acc becomes o), lse = m + log(l). A row that saw no
// key at all (impossible under causal masking with its own block) gets o = 0
// and lse = -inf.
void AttentionFinalize(const AttentionShape& s, const float* m, const float* l,
                       float* acc_to_o, float* lse,
    CpuPool* pool = nullptr);

// delta[row, head] = sum_c o * do: the softmax-backward correction term.
void AttentionDelta(const AttentionShape& s, const float* o, const float* dout,
                    float* delta,
    CpuPool* pool = nullptr);

// Adds this block pair's contribution to dq (queries) and to dk, dv (the
// block's keys and values).
void AttentionBackwardBlock(const AttentionShape& s, const float* q,
                            const float* k, const float* v, const float* dout,
                            const float* lse, const float* delta, float* dq,
                            float* dk, float* dv, float* work,
    CpuPool* pool = nullptr);

// Rotary embedding (docs/MODEL.md, half-split) in place on x [batch, len,
// heads, head_dim], row t of sequence b at position pos0 + t. `inverse`
// applies the transposed rotation, which is the backward.
void RopeApply(float* x, int64_t batch, int64_t len, int64_t heads,
               int64_t head_dim, int64_t pos0, float theta, bool inverse,
    CpuPool* pool = nullptr);

// The instruction set of the tile products. kAuto (the default) picks
// AVX-512 when the CPU has it, else AVX2 (the build's baseline). All give the
// same bits; tests force each one to check that.
enum class AttentionTileIsa { kAuto, kScalar, kAvx2, kAvx512 };

// Forces the tile products' instruction set for this process (tests and
// benchmarks); one the CPU lacks falls back to kAuto.
void SetAttentionTileIsaForTesting(AttentionTileIsa isa);
// True when `isa` can run here (this build and this CPU).
bool AttentionTileIsaAvailable(AttentionTileIsa isa);
// The instruction set the tile products run with now (never kAuto).
AttentionTileIsa AttentionActiveTileIsa();

}  // namespace plateau

#endif  // PLATEAU_KERNELS_MODEL_ATTENTION_H_
