// Test helpers for the tensor-core attention arithmetic
// (kernels/model/attention_tc.h, kernels/cuda/cuda_attention_tc.h): random
// bf16 block-pair data for ring attention's flow, the five ops run through a
// ModelKernels on a DeviceSide, and exact attention in double over all the
// blocks with, per output element, the magnitude it sums, which the
// tolerances are stated against.
//
// Magnitudes (double, from the exact probabilities p of the whole row):
//   o:  sum_c p_c |v_c|                       (o itself is sum_c p_c v_c)
//   dv: sum_r p_rc |dO_r|
//   dq: scale sum_c p_rc (|dp_rc| + dmag_r) |k_c|, dk likewise over r with |q_r|,
// where dmag_r = sum_e mag_o[r, e] |dO[r, e]| bounds |delta_r| and what an
// error in o does to it. Rounding each probability (or dS) to bf16 moves an
// output by at most about one bf16 unit (2^-8) of its magnitude per rounding
// on its path; a wrong index moves it by the magnitude itself.
#ifndef PLATEAU_KERNELS_TESTING_ATTENTION_TC_TESTING_H_
#define PLATEAU_KERNELS_TESTING_ATTENTION_TC_TESTING_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/model/attention_shape.h"
#include "kernels/model/model_kernels.h"
#include "kernels/testing/bf16_testing.h"
#include "kernels/testing/device_side.h"

namespace plateau {

struct AttnTcCase {
  const char* name;
  int64_t batch, q_len, kv_len, heads, kv_heads, head_dim, q_pos0;
  std::vector<int64_t> kv_pos0s;  // the K/V blocks, in the order they fold
};
inline void PrintTo(const AttnTcCase& c, std::ostream* os) { *os << c.name; }

struct AttnTcData {
  std::vector<AttentionShape> shapes;
  int64_t rows = 0, q_size = 0, kv_size = 0;
  std::vector<Bf16> q, dout, dq0;
  std::vector<std::vector<Bf16>> k, v;
  std::vector<std::vector<float>> dk0, dv0;
};

inline AttnTcData MakeAttnTcData(const AttnTcCase& c, uint32_t seed) {
  AttnTcData d;
  for (int64_t p : c.kv_pos0s) {
    AttentionShape s;
    s.batch = c.batch;
    s.q_len = c.q_len;
    s.kv_len = c.kv_len;
    s.heads = c.heads;
    s.kv_heads = c.kv_heads;
    s.head_dim = c.head_dim;
    s.q_pos0 = c.q_pos0;
    s.kv_pos0 = p;
    s.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    d.shapes.push_back(s);
  }
  d.rows = c.batch * c.q_len * c.heads;
  d.q_size = d.rows * c.head_dim;
  d.kv_size = c.batch * c.kv_len * c.kv_heads * c.head_dim;
  // Scores of a few units (q, k ~ N(0, 1.5^2), scaled by 1/sqrt(d)): peaked
  // rows and flat ones, so the rounding of p matters.
  d.q = RandomBf16(d.q_size, seed++, 1.5f);
  d.dout = RandomBf16(d.q_size, seed++);
  d.dq0 = RandomBf16(d.q_size, seed++, 0.25f);
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    d.k.push_back(RandomBf16(d.kv_size, seed++, 1.5f));
    d.v.push_back(RandomBf16(d.kv_size, seed++));
    d.dk0.push_back(Loaded(RandomBf16(d.kv_size, seed++, 0.25f)));
    d.dv0.push_back(Loaded(RandomBf16(d.kv_size, seed++, 0.25f)));
  }
  return d;
}

struct AttnTcOut {
  std::vector<float> m, l, o, lse, delta, dq;  // dq fp32, as ring attention sums it
  std::vector<std::vector<float>> dk, dv;
};

// Init, ForwardBlockBf16 over the blocks, Finalize, DeltaBf16 and
// BackwardBlockBf16 over the blocks, on one side, every output starting as
// NaN (dk, dv, dq start from the data's values: the ops add).
inline AttnTcOut RunAttnTc(DeviceSide& side, ModelKernels& k, const AttnTcData& d) {
  AttnTcOut out;
  const AttentionShape& s0 = d.shapes[0];
  float* m = side.Poisoned(d.rows);
  float* l = side.Poisoned(d.rows);
  float* acc = side.Poisoned(d.q_size);
  EXPECT_TRUE(k.AttentionInit(side.s(), s0, m, l, acc).ok());
  const Bf16* q = side.UploadBf16(d.q);
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    float* work = side.Poisoned(std::max<int64_t>(AttentionWorkspaceFloats(d.shapes[j]), 1));
    const absl::Status st =
        k.AttentionForwardBlockBf16(side.s(), d.shapes[j], q, side.UploadBf16(d.k[j]),
                                    side.UploadBf16(d.v[j]), m, l, acc, work);
    EXPECT_TRUE(st.ok()) << st;
  }
  out.m = side.Download(m, d.rows);
  out.l = side.Download(l, d.rows);
  float* lse = side.Poisoned(d.rows);
  EXPECT_TRUE(k.AttentionFinalize(side.s(), s0, m, l, acc, lse).ok());
  out.o = side.Download(acc, d.q_size);
  out.lse = side.Download(lse, d.rows);
  const Bf16* dout = side.UploadBf16(d.dout);
  float* delta = side.Poisoned(d.rows);
  EXPECT_TRUE(k.AttentionDeltaBf16(side.s(), s0, acc, dout, delta).ok());
  out.delta = side.Download(delta, d.rows);
  float* dq = side.Upload(Loaded(d.dq0));
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    float* work = side.Poisoned(std::max<int64_t>(AttentionWorkspaceFloats(d.shapes[j]), 1));
    float* dk = side.Upload(d.dk0[j]);
    float* dv = side.Upload(d.dv0[j]);
    const absl::Status st =
        k.AttentionBackwardBlockBf16(side.s(), d.shapes[j], q, side.UploadBf16(d.k[j]),
                                     side.UploadBf16(d.v[j]), dout, lse, delta, dq, dk, dv, work);
    EXPECT_TRUE(st.ok()) << st;
    out.dk.push_back(side.Download(dk, d.kv_size));
    out.dv.push_back(side.Download(dv, d.kv_size));
  }
  out.dq = side.Download(dq, d.q_size);
  return out;
}

// Exact attention over all the blocks (double, on the loaded bf16 values),
// the start values of dq, dk, dv added, and each output's magnitude.
struct AttnExact {
  std::vector<double> o, lse, dq, mag_o, mag_dq;
  std::vector<std::vector<double>> dk, dv, mag_dk, mag_dv;
};

inline AttnExact ExactAttention(const AttnTcData& d) {
  const AttentionShape& s0 = d.shapes[0];
  const int64_t D = s0.head_dim, group = s0.heads / s0.kv_heads;
  const int64_t qs = s0.heads * D, ks = s0.kv_heads * D;
  const std::vector<float> q = Loaded(d.q), dout = Loaded(d.dout);
  std::vector<std::vector<float>> k, v;
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    k.push_back(Loaded(d.k[j]));
    v.push_back(Loaded(d.v[j]));
  }
  AttnExact x;
  x.o.assign(d.q_size, 0.0);
  x.mag_o.assign(d.q_size, 0.0);
  x.lse.assign(d.rows, -std::numeric_limits<double>::infinity());
  x.mag_dq.assign(d.q_size, 0.0);
  x.dq.resize(d.q_size);
  for (int64_t i = 0; i < d.q_size; ++i) x.dq[i] = Bf16ToFloat(d.dq0[i]);
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    x.dk.emplace_back(d.dk0[j].begin(), d.dk0[j].end());
    x.dv.emplace_back(d.dv0[j].begin(), d.dv0[j].end());
    x.mag_dk.emplace_back(d.kv_size, 0.0);
    x.mag_dv.emplace_back(d.kv_size, 0.0);
  }
  struct Key {
    size_t block;
    int64_t off;  // the key's row offset in k[block] / v[block]
    double score, p, dp;
  };
  std::vector<Key> keys;
  for (int64_t b = 0; b < s0.batch; ++b) {
    for (int64_t r = 0; r < s0.q_len; ++r) {
      for (int64_t h = 0; h < s0.heads; ++h) {
        const int64_t row = (b * s0.q_len + r) * s0.heads + h;
        const int64_t qoff = (b * s0.q_len + r) * qs + h * D;
        keys.clear();
        double mx = -std::numeric_limits<double>::infinity();
        for (size_t j = 0; j < d.shapes.size(); ++j) {
          const AttentionShape& s = d.shapes[j];
          for (int64_t c = 0; c < s.kv_len && s.kv_pos0 + c <= s.q_pos0 + r; ++c) {
            const int64_t off = (b * s.kv_len + c) * ks + (h / group) * D;
            double dot = 0, dp = 0;
            for (int64_t e = 0; e < D; ++e) {
              dot += double{q[qoff + e]} * k[j][off + e];
              dp += double{dout[qoff + e]} * v[j][off + e];
            }
            keys.push_back({j, off, double{s.scale} * dot, 0.0, dp});
            mx = std::max(mx, keys.back().score);
          }
        }
        if (keys.empty()) continue;  // o = 0, lse = -inf, no gradient
        double sum = 0;
        for (const Key& key : keys) sum += std::exp(key.score - mx);
        x.lse[row] = mx + std::log(sum);
        for (Key& key : keys) {
          key.p = std::exp(key.score - x.lse[row]);
          for (int64_t e = 0; e < D; ++e) {
            x.o[qoff + e] += key.p * v[key.block][key.off + e];
            x.mag_o[qoff + e] += key.p * std::abs(v[key.block][key.off + e]);
          }
        }
        double delta = 0, dmag = 0;
        for (int64_t e = 0; e < D; ++e) {
          delta += x.o[qoff + e] * dout[qoff + e];
          dmag += x.mag_o[qoff + e] * std::abs(dout[qoff + e]);
        }
        const double scale = d.shapes[0].scale;
        for (const Key& key : keys) {
          const double ds = key.p * (key.dp - delta);
          const double dsmag = key.p * (std::abs(key.dp) + dmag);
          for (int64_t e = 0; e < D; ++e) {
            const double kv = k[key.block][key.off + e];
            x.dq[qoff + e] += scale * ds * kv;
            x.mag_dq[qoff + e] += scale * dsmag * std::abs(kv);
            x.dk[key.block][key.off + e] += scale * ds * q[qoff + e];
            x.mag_dk[key.block][key.off + e] += scale * dsmag * std::abs(q[qoff + e]);
            x.dv[key.block][key.off + e] += key.p * dout[qoff + e];
            x.mag_dv[key.block][key.off + e] += key.p * std::abs(dout[qoff + e]);
          }
        }
      }
    }
  }
  return x;
}

// |got - want| <= rel * mag + floor for every element; infinities must be
// equal, NaN never passes. Also reports, through *worst (when given), the
// largest |got - want| / mag over elements with mag > 0.
inline ::testing::AssertionResult WithinMagnitude(const std::vector<float>& got,
                                                  const std::vector<double>& want,
                                                  const std::vector<double>& mag, double rel,
                                                  double floor, const std::string& what,
                                                  double* worst = nullptr) {
  if (got.size() != want.size() || mag.size() != want.size()) {
    return ::testing::AssertionFailure() << what << ": sizes";
  }
  int64_t bad = 0, first = -1;
  double w = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;
    const double err = std::abs(double{got[i]} - want[i]);
    if (!(err <= rel * mag[i] + floor)) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
    if (mag[i] > 0 && std::isfinite(err)) w = std::max(w, err / mag[i]);
  }
  if (worst != nullptr) *worst = w;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << want.size() << " outside " << rel << " x magnitude + "
         << floor << "; first [" << first << "]: got " << got[first] << ", exact " << want[first]
         << ", magnitude " << mag[first];
}

// The same against another run's values (the magnitudes from the exact run).
inline ::testing::AssertionResult WithinMagnitude(const std::vector<float>& got,
                                                  const std::vector<float>& want,
                                                  const std::vector<double>& mag, double rel,
                                                  double floor, const std::string& what) {
  return WithinMagnitude(got, std::vector<double>(want.begin(), want.end()), mag, rel, floor, what);
}

inline double MaxAbsFinite(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) {
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

// `got` against exact attention, the bounds attention_tc_test derives for
// the tensor-core arithmetic: o within 2^-6 of its magnitude (the rounded
// probabilities and their sum), lse 2^-7, the gradients 2^-5 (lse's,
// delta's and dS's roundings on top; dq, dk and dv stay fp32 across the
// pairs), each plus an fp32 floor. *worst_o: the largest |o - exact| /
// magnitude.
inline void ExpectNearExact(const AttnTcOut& got, const AttnTcData& d, const AttnExact& x, double* worst_o = nullptr) {
  EXPECT_TRUE(WithinMagnitude(got.o, x.o, x.mag_o, 0x1p-6, 1e-6 * MaxAbsFinite(x.mag_o),
                              "o vs exact", worst_o));
  EXPECT_TRUE(WithinMagnitude(got.lse, x.lse, std::vector<double>(d.rows, 1.0), 0x1p-7, 1e-6,
                              "lse vs exact"));
  EXPECT_TRUE(WithinMagnitude(got.dq, x.dq, x.mag_dq, 0x1p-5, 1e-6 * MaxAbsFinite(x.mag_dq), "dq vs exact"));
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    EXPECT_TRUE(WithinMagnitude(got.dk[j], x.dk[j], x.mag_dk[j], 0x1p-5,
                                1e-6 * MaxAbsFinite(x.mag_dk[j]),
                                "dk vs exact, block " + std::to_string(j)));
    EXPECT_TRUE(WithinMagnitude(got.dv[j], x.dv[j], x.mag_dv[j], 0x1p-5,
                                1e-6 * MaxAbsFinite(x.mag_dv[j]),
                                "dv vs exact, block " + std::to_string(j)));
  }
}

// `got` against another run of the same arithmetic (the CPU twin): every
// output within 2^-6 of its magnitude. The two sum in different orders, so
// a probability or dS can round to the neighbouring bf16 value on one side
// only; an index slip moves an output by its whole magnitude.
inline void ExpectNearTwin(const AttnTcOut& got, const AttnTcOut& twin, const AttnTcData& d, const AttnExact& x) {
  EXPECT_TRUE(WithinMagnitude(got.o, twin.o, x.mag_o, 0x1p-6, 1e-6 * MaxAbsFinite(x.mag_o), "o"));
  EXPECT_TRUE(WithinMagnitude(got.lse, twin.lse, std::vector<double>(d.rows, 1.0), 0x1p-7, 1e-6, "lse"));
  EXPECT_TRUE(WithinMagnitude(got.dq, twin.dq, x.mag_dq, 0x1p-6, 1e-6 * MaxAbsFinite(x.mag_dq), "dq"));
  for (size_t j = 0; j < d.shapes.size(); ++j) {
    EXPECT_TRUE(WithinMagnitude(got.dk[j], twin.dk[j], x.mag_dk[j], 0x1p-6,
                                1e-6 * MaxAbsFinite(x.mag_dk[j]),
                                "dk, block " + std::to_string(j)));
    EXPECT_TRUE(WithinMagnitude(got.dv[j], twin.dv[j], x.mag_dv[j], 0x1p-6,
                                1e-6 * MaxAbsFinite(x.mag_dv[j]),
                                "dv, block " + std::to_string(j)));
  }
}

}  // namespace plateau

#endif  // PLATEAU_KERNELS_TESTING_ATTENTION_TC_TESTING_H_
