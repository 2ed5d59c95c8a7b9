#include "kernels/cuda/wgmma_attention_check.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
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

// Fixed values in [-1, 1) with 5 significant bits (exact in bf16), an LCG
// over every element: any misplaced element changes the sums.
std::vector<uint16_t> Bf16Data(size_t n, uint32_t seed) {
  std::vector<uint16_t> out(n);
  uint32_t x = seed;
  for (uint16_t& e : out) {
    x = x * 1664525u + 1013904223u;
    const float v = static_cast<float>(static_cast<int>(x >> 27) - 16) * 0.0625f;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    e = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// One device buffer (names ending _d below), freed on every path out.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(p_); }
  template <typename T>
  cudaError_t From(const std::vector<T>& host) {
    bytes_ = host.size() * sizeof(T);
    cudaError_t e = cudaMalloc(&p_, bytes_);
    return e == cudaSuccess ? cudaMemcpy(p_, host.data(), bytes_, cudaMemcpyHostToDevice) : e;
  }
  template <typename T>
  cudaError_t To(std::vector<T>* host) const {
    host->resize(bytes_ / sizeof(T));
    return cudaMemcpy(host->data(), p_, bytes_, cudaMemcpyDeviceToHost);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// One family's outputs at one shape.
struct Outputs {
  std::vector<float> m, l, o, dq, dk, dv;
};

// The forward from the initial state, then the backward given lse and
// delta (the same for both families), on the legacy stream; copies out.
cudaError_t Run(const AttentionDims& s, const AttentionTcStages& stages,
                const std::vector<uint16_t>& q, const std::vector<uint16_t>& k,
                const std::vector<uint16_t>& v, const std::vector<uint16_t>& dout,
                const std::vector<float>* lse, const std::vector<float>& delta, Outputs* out) {
  const size_t rows = s.batch * s.q_len * s.heads;
  DeviceBuffer q_d, k_d, v_d, dout_d, m_d, l_d, acc_d, lse_d, delta_d, dq_d, dk_d, dv_d;
  cudaError_t e = q_d.From(q);
  if (e == cudaSuccess) e = k_d.From(k);
  if (e == cudaSuccess) e = v_d.From(v);
  if (e == cudaSuccess) e = dout_d.From(dout);
  if (e == cudaSuccess) e = m_d.From(std::vector<float>(rows, -INFINITY));
  if (e == cudaSuccess) e = l_d.From(std::vector<float>(rows, 0.0f));
  if (e == cudaSuccess) e = acc_d.From(std::vector<float>(rows * s.head_dim, 0.0f));
  if (e != cudaSuccess) return e;
  e = stages.wgmma ? AttentionForwardBlockWg(nullptr, s, stages.forward, q_d.as<uint16_t>(),
                                             k_d.as<uint16_t>(), v_d.as<uint16_t>(),
                                             m_d.as<float>(), l_d.as<float>(), acc_d.as<float>())
                   : AttentionForwardBlockTc(nullptr, s, stages, q_d.as<uint16_t>(),
                                             k_d.as<uint16_t>(), v_d.as<uint16_t>(),
                                             m_d.as<float>(), l_d.as<float>(), acc_d.as<float>());
  if (e == cudaSuccess) e = m_d.To(&out->m);
  if (e == cudaSuccess) e = l_d.To(&out->l);
  if (e == cudaSuccess) e = acc_d.To(&out->o);
  if (e != cudaSuccess || lse == nullptr) return e;

  e = lse_d.From(*lse);
  if (e == cudaSuccess) e = delta_d.From(delta);
  if (e == cudaSuccess) e = dq_d.From(std::vector<uint16_t>(q.size(), 0));
  if (e == cudaSuccess) e = dk_d.From(std::vector<float>(k.size(), 0.0f));
  if (e == cudaSuccess) e = dv_d.From(std::vector<float>(v.size(), 0.0f));
  if (e != cudaSuccess) return e;
  const auto backward = stages.wgmma ? AttentionBackwardBlockWg : AttentionBackwardBlockTc;
  e = backward(nullptr, s, stages, q_d.as<uint16_t>(), k_d.as<uint16_t>(), v_d.as<uint16_t>(),
               dout_d.as<uint16_t>(), lse_d.as<float>(), delta_d.as<float>(), dq_d.as<uint16_t>(),
               dk_d.as<float>(), dv_d.as<float>());
  std::vector<uint16_t> dq_bits;
  if (e == cudaSuccess) e = dq_d.To(&dq_bits);
  if (e == cudaSuccess) e = dk_d.To(&out->dk);
  if (e == cudaSuccess) e = dv_d.To(&out->dv);
  out->dq.clear();
  for (uint16_t b : dq_bits) out->dq.push_back(Bf16Value(b));
  return e;
}

// Where `got` and `want` differ by more than 2^-6 of want's largest
// magnitude (or are not both finite where want is): "" when nowhere.
std::string Differs(const char* name, const std::vector<float>& got,
                    const std::vector<float>& want) {
  if (got.size() != want.size()) return std::string(name) + ": sizes differ";
  float scale = 0.0f;
  for (float w : want) {
    if (std::isfinite(w)) scale = std::fmax(scale, std::fabs(w));
  }
  const float tol = std::ldexp(scale, -6);
  for (size_t i = 0; i < want.size(); ++i) {
    const bool same = got[i] == want[i] || std::fabs(got[i] - want[i]) <= tol;
    if (!same) {
      return std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(got[i]) +
             " on wgmma, " + std::to_string(want[i]) + " on mma.sync (tolerance " +
             std::to_string(tol) + ")";
    }
  }
  return "";
}

}  // namespace

cudaError_t CheckAttentionWgAgainstTc(int64_t head_dim, const AttentionTcStages& mma,
                                      const AttentionTcStages& wgmma, bool* agrees,
                                      std::string* why) {
  *agrees = false;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  // {batch, q_len, kv_len, heads, kv_heads, head_dim, q_pos0, kv_pos0, scale}
  const AttentionDims shapes[] = {
      {1, 80, 80, 2, 1, head_dim, 0, 0, scale},   // the causal diagonal, a partial tile
      {1, 64, 80, 2, 1, head_dim, 80, 0, scale},  // queries after every key
  };
  AttentionTcStages mma_only = mma, wg = wgmma;
  mma_only.wgmma = false;
  wg.wgmma = true;
  uint32_t seed = 7;
  for (const AttentionDims& s : shapes) {
    const size_t q_size = s.batch * s.q_len * s.heads * head_dim;
    const size_t kv_size = s.batch * s.kv_len * s.kv_heads * head_dim;
    const std::vector<uint16_t> q = Bf16Data(q_size, seed++), k = Bf16Data(kv_size, seed++),
                                v = Bf16Data(kv_size, seed++), dout = Bf16Data(q_size, seed++);
    // The backward's lse from the mma.sync forward (every row sees a key
    // here), delta small values of either sign.
    Outputs ref_forward;
    std::vector<float> delta;
    for (uint16_t b : Bf16Data(s.batch * s.q_len * s.heads, seed++)) {
      delta.push_back(Bf16Value(b) * 0.5f);
    }
    cudaError_t e = Run(s, mma_only, q, k, v, dout, nullptr, delta, &ref_forward);
    if (e != cudaSuccess) return e;
    std::vector<float> lse(ref_forward.m.size());
    for (size_t r = 0; r < lse.size(); ++r) {
      lse[r] = ref_forward.l[r] > 0 ? ref_forward.m[r] + std::log(ref_forward.l[r])
                                    : -std::numeric_limits<float>::infinity();
    }
    Outputs want, got;
    e = Run(s, mma_only, q, k, v, dout, &lse, delta, &want);
    if (e == cudaSuccess) e = Run(s, wg, q, k, v, dout, &lse, delta, &got);
    if (e != cudaSuccess) return e;
    const std::pair<const char*, std::vector<float> Outputs::*> arrays[] = {
        {"m", &Outputs::m},   {"l", &Outputs::l},   {"o", &Outputs::o},
        {"dq", &Outputs::dq}, {"dk", &Outputs::dk}, {"dv", &Outputs::dv}};
    for (auto [name, member] : arrays) {
      const std::string d = Differs(name, got.*member, want.*member);
      if (!d.empty()) {
        *why = "head_dim " + std::to_string(head_dim) + ", " + std::to_string(s.q_len) +
               " queries at " + std::to_string(s.q_pos0) + " x " + std::to_string(s.kv_len) +
               " keys: " + d;
        return cudaSuccess;
      }
    }
  }
  *agrees = true;
  return cudaSuccess;
}

}  // namespace plateau::cuda_model_ops
