#include "kernels/cuda/wgmma_attention_check.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_attention_wgmma.h"

namespace plateau::cuda_model_ops {
namespace {

float Bf16Value(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Fixed values: multiples of 1/16 in [-1, 1) times `scale` (a power of
// two; exact in bf16), an LCG over every element: any misplaced element
// changes the sums.
std::vector<uint16_t> Bf16Data(size_t n, uint32_t seed, float scale = 1.0f) {
  std::vector<uint16_t> out(n);
  uint32_t x = seed;
  for (uint16_t& e : out) {
    x = x * 1664525u + 1013904223u;
    const float v = static_cast<float>(static_cast<int>(x >> 27) - 16) * 0.0625f * scale;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    e = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// One device buffer (names ending _d below), freed on every path out,
// between two guard bands: kGuardBytes of kGuardByte on each side. A
// kernel that writes outside a buffer without faulting (a row past the
// block's end, a stride off by one) changes a band, which Overrun finds
// after the kernels ran; the outputs inside could still look right.
class DeviceBuffer {
 public:
  static constexpr size_t kGuardBytes = 4096;  // keeps the data 16-byte aligned
  static constexpr unsigned char kGuardByte = 0xA5;

  explicit DeviceBuffer(const char* name) : name_(name) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(base_); }
  template <typename T>
  cudaError_t From(const std::vector<T>& host) {
    bytes_ = host.size() * sizeof(T);
    cudaError_t e = cudaMalloc(&base_, bytes_ + 2 * kGuardBytes);
    if (e != cudaSuccess) return e;
    p_ = static_cast<unsigned char*>(base_) + kGuardBytes;
    e = cudaMemset(base_, kGuardByte, kGuardBytes);
    if (e == cudaSuccess) e = cudaMemset(p_ + bytes_, kGuardByte, kGuardBytes);
    return e == cudaSuccess ? cudaMemcpy(p_, host.data(), bytes_, cudaMemcpyHostToDevice) : e;
  }
  template <typename T>
  cudaError_t To(std::vector<T>* host) const {
    host->resize(bytes_ / sizeof(T));
    return cudaMemcpy(host->data(), p_, bytes_, cudaMemcpyDeviceToHost);
  }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(p_);
  }
  // Where a kernel wrote into a guard band, in *where ("" if nowhere; an
  // earlier finding is kept).
  cudaError_t Overrun(std::string* where) const {
    if (p_ == nullptr || !where->empty()) return cudaSuccess;
    std::vector<unsigned char> before(kGuardBytes), after(kGuardBytes);
    cudaError_t e = cudaMemcpy(before.data(), base_, kGuardBytes, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess) {
      e = cudaMemcpy(after.data(), p_ + bytes_, kGuardBytes, cudaMemcpyDeviceToHost);
    }
    if (e != cudaSuccess) return e;
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (before[kGuardBytes - 1 - i] != kGuardByte) {
        *where =
            std::string(name_) + " written " + std::to_string(i + 1) + " bytes before its start";
        return cudaSuccess;
      }
      if (after[i] != kGuardByte) {
        *where = std::string(name_) + " written at byte " + std::to_string(i) + " past its end (" +
                 std::to_string(bytes_) + " bytes)";
        return cudaSuccess;
      }
    }
    return cudaSuccess;
  }

 private:
  const char* name_;
  void* base_ = nullptr;
  unsigned char* p_ = nullptr;  // base_ + kGuardBytes
  size_t bytes_ = 0;
};

// The check's inputs: one query block and two K/V blocks of a ring (an
// earlier block every query sees, then the queries' own causal block), with
// the accumulators' starting values.
struct Inputs {
  AttentionDims blocks[2];
  std::vector<uint16_t> q, dout;
  std::vector<uint16_t> k[2], v[2];
  std::vector<float> dq0, dk0[2], dv0[2], delta;
};

// One family's outputs: the forward's running state after both blocks, the
// backward's dq after each and dk, dv of each (concatenated).
struct Outputs {
  std::vector<float> m, l, o, dq, dk, dv;
  std::string overrun;  // a buffer written outside (DeviceBuffer::Overrun), else ""
};

// The forward over both blocks from the initial state (m = -inf, l = 0,
// acc = 0), the second block reading the first's state, on the legacy
// stream; copies out m, l, acc.
cudaError_t Forward(const Inputs& in, const AttentionTcStages& stages, Outputs* out) {
  const AttentionDims& s0 = in.blocks[0];
  const size_t rows = s0.batch * s0.q_len * s0.heads;
  DeviceBuffer q_d("q"), m_d("m"), l_d("l"), acc_d("o");
  cudaError_t e = q_d.From(in.q);
  if (e == cudaSuccess) e = m_d.From(std::vector<float>(rows, -INFINITY));
  if (e == cudaSuccess) e = l_d.From(std::vector<float>(rows, 0.0f));
  if (e == cudaSuccess) e = acc_d.From(std::vector<float>(rows * s0.head_dim, 0.0f));
  for (int j = 0; j < 2 && e == cudaSuccess; ++j) {
    DeviceBuffer k_d("k"), v_d("v");
    e = k_d.From(in.k[j]);
    if (e == cudaSuccess) e = v_d.From(in.v[j]);
    if (e != cudaSuccess) break;
    const AttentionDims& s = in.blocks[j];
    const uint16_t *q = q_d.as<uint16_t>(), *k = k_d.as<uint16_t>(), *v = v_d.as<uint16_t>();
    float *m = m_d.as<float>(), *l = l_d.as<float>(), *acc = acc_d.as<float>();
    e = stages.wgmma ? AttentionForwardBlockWg(nullptr, s, stages.forward, q, k, v, m, l, acc)
                     : AttentionForwardBlockTc(nullptr, s, stages, q, k, v, m, l, acc);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    for (const DeviceBuffer* b : {&k_d, &v_d}) {
      if (e == cudaSuccess) e = b->Overrun(&out->overrun);
    }
  }
  for (const DeviceBuffer* b : {&q_d, &m_d, &l_d, &acc_d}) {
    if (e == cudaSuccess) e = b->Overrun(&out->overrun);
  }
  if (e == cudaSuccess) e = m_d.To(&out->m);
  if (e == cudaSuccess) e = l_d.To(&out->l);
  if (e == cudaSuccess) e = acc_d.To(&out->o);
  return e;
}

// The backward over both blocks given lse (the same for both families),
// dq accumulating over them from dq0 and each block's dk, dv from their
// starting values; copies out dq after each block, dk and dv of each.
cudaError_t Backward(const Inputs& in, const AttentionTcStages& stages,
                     const std::vector<float>& lse, Outputs* out) {
  DeviceBuffer q_d("q"), dout_d("dout"), lse_d("lse"), delta_d("delta"), dq_d("dq");
  cudaError_t e = q_d.From(in.q);
  if (e == cudaSuccess) e = dout_d.From(in.dout);
  if (e == cudaSuccess) e = lse_d.From(lse);
  if (e == cudaSuccess) e = delta_d.From(in.delta);
  if (e == cudaSuccess) e = dq_d.From(in.dq0);
  const auto backward = stages.wgmma ? AttentionBackwardBlockWg : AttentionBackwardBlockTc;
  out->dq.clear();
  out->dk.clear();
  out->dv.clear();
  for (int j = 0; j < 2 && e == cudaSuccess; ++j) {
    DeviceBuffer k_d("k"), v_d("v"), dk_d("dk"), dv_d("dv");
    e = k_d.From(in.k[j]);
    if (e == cudaSuccess) e = v_d.From(in.v[j]);
    if (e == cudaSuccess) e = dk_d.From(in.dk0[j]);
    if (e == cudaSuccess) e = dv_d.From(in.dv0[j]);
    if (e == cudaSuccess) {
      e = backward(nullptr, in.blocks[j], stages, q_d.as<uint16_t>(), k_d.as<uint16_t>(), v_d.as<uint16_t>(),
                   dout_d.as<uint16_t>(), lse_d.as<float>(), delta_d.as<float>(), dq_d.as<float>(), dk_d.as<float>(),
                   dv_d.as<float>());
    }
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    for (const DeviceBuffer* b :
         {&k_d, &v_d, &dk_d, &dv_d, &q_d, &dout_d, &lse_d, &delta_d, &dq_d}) {
      if (e == cudaSuccess) e = b->Overrun(&out->overrun);
    }
    std::vector<float> dk, dv;
    if (e == cudaSuccess) e = dk_d.To(&dk);
    if (e == cudaSuccess) e = dv_d.To(&dv);
    out->dk.insert(out->dk.end(), dk.begin(), dk.end());
    out->dv.insert(out->dv.end(), dv.begin(), dv.end());
    // dq after each block (a key dropped from the first shows there before
    // the second's sum can blur it).
    std::vector<float> dq;
    if (e == cudaSuccess) e = dq_d.To(&dq);
    out->dq.insert(out->dq.end(), dq.begin(), dq.end());
  }
  return e;
}

// Where `got` differs from `want` by more than `rel` of the largest |want|
// of its row (`row` consecutive elements: a row's values share a scale, and
// a row of small values is held to its own) plus `rel_each` of |want|
// itself, or is not equal where want is not finite: "" when nowhere.
std::string Differs(const char* name, const std::vector<float>& got, const std::vector<float>& want,
                    size_t row, float rel, float rel_each) {
  if (got.size() != want.size()) return std::string(name) + ": sizes differ";
  for (size_t r0 = 0; r0 < want.size(); r0 += row) {
    float scale = 0.0f;
    for (size_t i = r0; i < r0 + row; ++i) {
      if (std::isfinite(want[i])) scale = std::fmax(scale, std::fabs(want[i]));
    }
    for (size_t i = r0; i < r0 + row; ++i) {
      const float tol = scale * rel + std::fabs(want[i]) * rel_each;
      if (got[i] == want[i] || std::fabs(got[i] - want[i]) <= tol) continue;
      return std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(got[i]) +
             " on wgmma, " + std::to_string(want[i]) + " on mma.sync (tolerance " +
             std::to_string(tol) + ")";
    }
  }
  return "";
}

Inputs MakeInputs(int64_t head_dim) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  Inputs in;
  // {batch, q_len, kv_len, heads, kv_heads, head_dim, q_pos0, kv_pos0, scale}:
  // 70 queries at 150 (a second tile of 6 rows: warps with no row, one
  // with a few), GQA 2 over 2 K/V heads, batch 2; the earlier block's 150
  // keys are three tiles (a double-buffered kernel refills a buffer), the
  // own block's 70 two, on the causal diagonal.
  in.blocks[0] = {2, 70, 150, 4, 2, head_dim, 150, 0, scale};
  in.blocks[1] = {2, 70, 70, 4, 2, head_dim, 150, 150, scale};
  const AttentionDims& s = in.blocks[0];
  const size_t q_size = s.batch * s.q_len * s.heads * head_dim;
  uint32_t seed = 7;
  in.q = Bf16Data(q_size, seed++);
  in.dout = Bf16Data(q_size, seed++);
  // The accumulators start small (at most 2^-8) beside most of what is
  // added (dq, dk ~1e-2, dv more): nonzero, so the kernels' read-and-add
  // is checked, without hiding the added part under the tolerance of a
  // large start.
  for (uint16_t b : Bf16Data(q_size, seed++, 0x1p-8f)) in.dq0.push_back(Bf16Value(b));
  for (int j = 0; j < 2; ++j) {
    const size_t kv_size = s.batch * in.blocks[j].kv_len * s.kv_heads * head_dim;
    in.k[j] = Bf16Data(kv_size, seed++);
    in.v[j] = Bf16Data(kv_size, seed++);
    for (uint16_t b : Bf16Data(kv_size, seed++, 0x1p-8f)) in.dk0[j].push_back(Bf16Value(b));
    for (uint16_t b : Bf16Data(kv_size, seed++, 0x1p-8f)) in.dv0[j].push_back(Bf16Value(b));
  }
  for (uint16_t b : Bf16Data(s.batch * s.q_len * s.heads, seed++)) {
    in.delta.push_back(Bf16Value(b) * 0.5f);
  }
  return in;
}

// The wgmma family's forward and backward; a launch error that does not
// stick (the device still synchronises after it is cleared) is returned in
// *not_run, a fault as the result.
cudaError_t RunWgmma(const Inputs& in, const AttentionTcStages& stages,
                     const std::vector<float>& lse, Outputs* out, std::string* not_run) {
  cudaError_t e = Forward(in, stages, out);
  if (e == cudaSuccess) e = Backward(in, stages, lse, out);
  if (e == cudaSuccess) return e;
  (void)cudaGetLastError();
  const cudaError_t sticky = cudaDeviceSynchronize();
  if (sticky != cudaSuccess) return sticky;
  // Out of memory says nothing of the kernels: an error, not a verdict.
  if (e == cudaErrorMemoryAllocation) return e;
  *not_run = std::string("the wgmma kernels did not run: ") + cudaGetErrorString(e);
  return cudaSuccess;
}

}  // namespace

cudaError_t CheckAttentionWgAgainstTc(int64_t head_dim, const AttentionTcStages& mma,
                                      const AttentionTcStages& wgmma, bool* agrees,
                                      std::string* why) {
  *agrees = false;
  AttentionTcStages mma_only = mma, wg = wgmma;
  mma_only.wgmma = false;
  wg.wgmma = true;
  const Inputs in = MakeInputs(head_dim);
  Outputs want, got;
  cudaError_t e = Forward(in, mma_only, &want);
  if (e != cudaSuccess) return e;
  // The backward's lse from the mma.sync forward (attention.h's
  // AttentionFinalize: m is in natural units), the same for both families.
  std::vector<float> lse(want.m.size());
  for (size_t r = 0; r < lse.size(); ++r) {
    lse[r] = want.l[r] > 0 ? want.m[r] + std::log(want.l[r]) : -INFINITY;
  }
  e = Backward(in, mma_only, lse, &want);
  if (e != cudaSuccess) return e;
  if (!want.overrun.empty()) {
    // The reference itself is wrong: say so rather than compare with it.
    *why = "head_dim " + std::to_string(head_dim) + ": the mma.sync kernels wrote outside a " +
           "buffer: " + want.overrun;
    return cudaSuccess;
  }
  std::string not_run;
  e = RunWgmma(in, wg, lse, &got, &not_run);
  if (e != cudaSuccess) return e;
  if (!not_run.empty()) {
    *why = "head_dim " + std::to_string(head_dim) + ": " + not_run;
    return cudaSuccess;
  }
  if (!got.overrun.empty()) {
    *why = "head_dim " + std::to_string(head_dim) + ": written outside a buffer: " + got.overrun;
    return cudaSuccess;
  }
  // The inputs are multiples of 1/16 in [-1, 1), so every product q . k
  // and dO . v is a multiple of 2^-8 and every sum below 2^7 in size: 16
  // significant bits, exact in fp32 in any order. Both families then run
  // the same code (SoftmaxStep, ProbAndGradTc) on the same S and dP, so m,
  // l, P and dS are expected bit for bit (2^-16 is slack). o, dk and dv
  // differ only by the order of fp32 sums of exact products, a few units
  // of 2^-24 of the sum of their magnitudes (2^-10 of their row's largest
  // value leaves room for cancellation and the tensor cores' truncation:
  // a misread operand or a dropped key moves an output by far more); so does
  // dq (fp32: ring attention rounds it once, after its last hop), checked
  // after the first block and after both.
  const size_t d = head_dim;
  const struct {
    const char* name;
    std::vector<float> Outputs::*member;
    size_t row;
    float rel, rel_each;
  } arrays[] = {{"m", &Outputs::m, 1, 0x1p-16f, 0},   {"l", &Outputs::l, 1, 0x1p-16f, 0},
                {"o", &Outputs::o, d, 0x1p-10f, 0},   {"dk", &Outputs::dk, d, 0x1p-10f, 0},
                {"dv", &Outputs::dv, d, 0x1p-10f, 0}, {"dq", &Outputs::dq, d, 0x1p-10f, 0}};
  for (const auto& a : arrays) {
    const std::string differs =
        Differs(a.name, got.*a.member, want.*a.member, a.row, a.rel, a.rel_each);
    if (!differs.empty()) {
      *why = "head_dim " + std::to_string(head_dim) + ", 70 queries x 150 + 70 keys: " + differs;
      return cudaSuccess;
    }
  }
  *agrees = true;
  return cudaSuccess;
}

}  // namespace plateau::cuda_model_ops
