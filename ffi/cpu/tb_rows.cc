// CPU table-batched rows ops; see tb_rows.h.
#include "cpu/tb_rows.h"

#include <cstring>
#include <vector>

namespace flowtt::tb::cpu {
namespace {

std::string OutOfRange(const char* what, int64_t at, int64_t value, int64_t limit) {
  return std::string("flowtt_tb: ") + what + "[" + std::to_string(at) +
         "] = " + std::to_string(value) + " outside [0, " + std::to_string(limit) + ")";
}

// P [q1, q2*r2] = g1[i1, 0] (q1 x r1) . g2[i2] (r1 x q2*r2); P[x1*K + j] is the prefix
// product's element (m = x1*q2 + j / r2, b = j % r2).
void Prefix(const TbShape& s, const float* g1, const float* g2, int64_t i1, int64_t i2, float* P) {
  const int64_t K = s.q2 * s.r2;
  const float* a = g1 + i1 * s.q1 * s.r1;
  const float* b = g2 + i2 * s.r1 * K;
  std::memset(P, 0, sizeof(float) * s.q1 * K);
  for (int64_t x1 = 0; x1 < s.q1; ++x1) {
    float* out = P + x1 * K;
    for (int64_t k = 0; k < s.r1; ++k) {
      const float av = a[x1 * s.r1 + k];
      const float* brow = b + k * K;
      for (int64_t j = 0; j < K; ++j) out[j] += av * brow[j];
    }
  }
}

}  // namespace

std::string TbCheckPlanValues(const TbShape& s, const TbPlan& p) {
  if (p.num_unique < 0 || p.num_unique > p.n || p.num_groups < 0 || p.num_groups > p.num_unique) {
    return "flowtt_tb: counts (" + std::to_string(p.num_unique) + ", " +
           std::to_string(p.num_groups) +
           ") must satisfy 0 <= num_groups <= num_unique <= n = " + std::to_string(p.n);
  }
  const int32_t* go = p.group_offsets;
  if (go[0] != 0 || go[p.num_groups] != p.num_unique) {
    return "flowtt_tb: group_offsets must run from 0 to num_unique";
  }
  for (int32_t g = 0; g < p.num_groups; ++g) {
    if (go[g + 1] < go[g]) return "flowtt_tb: group_offsets must be non-decreasing";
    if (p.g_i1[g] < 0 || p.g_i1[g] >= s.p1) return OutOfRange("g_i1", g, p.g_i1[g], s.p1);
    if (p.g_i2[g] < 0 || p.g_i2[g] >= s.p2) return OutOfRange("g_i2", g, p.g_i2[g], s.p2);
    if (g > 0 && p.g_i1[g] < p.g_i1[g - 1]) {
      return "flowtt_tb: g_i1 must be non-decreasing over the groups";
    }
  }
  for (int32_t u = 0; u < p.num_unique; ++u) {
    if (p.u_i3[u] < 0 || p.u_i3[u] >= s.p3) return OutOfRange("u_i3", u, p.u_i3[u], s.p3);
  }
  return "";
}

std::string TbRowsFwd(const TbShape& s, const float* g1, const float* g2, const float* g3,
                      const TbPlan& p, float* rows) {
  if (std::string e = TbCheckPlanValues(s, p); !e.empty()) return e;
  const int64_t K = s.q2 * s.r2, M = s.q1 * s.q2, D = s.dim();
  std::vector<float> P(s.q1 * K);
  for (int32_t g = 0; g < p.num_groups; ++g) {
    const int32_t u0 = p.group_offsets[g], u1 = p.group_offsets[g + 1];
    if (u0 == u1) continue;
    Prefix(s, g1, g2, p.g_i1[g], p.g_i2[g], P.data());
    for (int32_t u = u0; u < u1; ++u) {
      const float* c = g3 + int64_t(p.u_i3[u]) * s.r2 * s.q3;  // [r2, q3]
      float* row = rows + int64_t(u) * D;
      std::memset(row, 0, sizeof(float) * D);
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t b = 0; b < s.r2; ++b) {
          const float pv = P[m * s.r2 + b];
          for (int64_t z = 0; z < s.q3; ++z) row[m * s.q3 + z] += pv * c[b * s.q3 + z];
        }
      }
    }
  }
  std::memset(rows + int64_t(p.num_unique) * D, 0, sizeof(float) * (p.n - p.num_unique) * D);
  return "";
}

std::string TbRowsBwd(const TbShape& s, const float* g1, const float* g2, const float* g3,
                      const float* d_rows, const TbPlan& p, float* dg1, float* dg2, float* dg3) {
  if (std::string e = TbCheckPlanValues(s, p); !e.empty()) return e;
  const int64_t K = s.q2 * s.r2, M = s.q1 * s.q2, D = s.dim();
  const int64_t s1 = s.q1 * s.r1, s2 = s.r1 * K, s3 = s.r2 * s.q3;  // core row sizes
  std::memset(dg1, 0, sizeof(float) * s.p1 * s1);
  std::memset(dg2, 0, sizeof(float) * s.p2 * s2);
  std::memset(dg3, 0, sizeof(float) * s.p3 * s3);
  std::vector<float> P(M * s.r2), dP(M * s.r2), term(s2);
  for (int32_t g = 0; g < p.num_groups; ++g) {
    const int32_t u0 = p.group_offsets[g], u1 = p.group_offsets[g + 1];
    if (u0 == u1) continue;
    const int64_t i1 = p.g_i1[g], i2 = p.g_i2[g];
    Prefix(s, g1, g2, i1, i2, P.data());
    std::fill(dP.begin(), dP.end(), 0.0f);
    for (int32_t u = u0; u < u1; ++u) {
      const int64_t i3 = p.u_i3[u];
      const float* c = g3 + i3 * s3;              // [r2, q3]
      const float* dr = d_rows + int64_t(u) * D;  // [M, q3]
      // dP_g += d_rows[u] (x) g3[i3] (the term summed over z)
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t b = 0; b < s.r2; ++b) {
          float t = 0.0f;
          for (int64_t z = 0; z < s.q3; ++z) t += dr[m * s.q3 + z] * c[b * s.q3 + z];
          dP[m * s.r2 + b] += t;
        }
      }
      // dg3[i3] += P_g^T . d_rows[u] (the term summed over m)
      float* d3 = dg3 + i3 * s3;
      for (int64_t b = 0; b < s.r2; ++b) {
        for (int64_t z = 0; z < s.q3; ++z) {
          float t = 0.0f;
          for (int64_t m = 0; m < M; ++m) t += P[m * s.r2 + b] * dr[m * s.q3 + z];
          d3[b * s.q3 + z] += t;
        }
      }
    }
    // dg1[i1] += dP_g . g2[i2]^T (the term summed over j = (q2, r2))
    const float* a = g1 + i1 * s1;
    const float* bcore = g2 + i2 * s2;
    float* d1 = dg1 + i1 * s1;
    for (int64_t x1 = 0; x1 < s.q1; ++x1) {
      for (int64_t k = 0; k < s.r1; ++k) {
        float t = 0.0f;
        for (int64_t j = 0; j < K; ++j) t += dP[x1 * K + j] * bcore[k * K + j];
        d1[x1 * s.r1 + k] += t;
      }
    }
    // dg2[i2] += g1[i1]^T . dP_g (the term summed over q1)
    std::fill(term.begin(), term.end(), 0.0f);
    for (int64_t x1 = 0; x1 < s.q1; ++x1) {
      for (int64_t k = 0; k < s.r1; ++k) {
        const float av = a[x1 * s.r1 + k];
        for (int64_t j = 0; j < K; ++j) term[k * K + j] += av * dP[x1 * K + j];
      }
    }
    float* d2 = dg2 + i2 * s2;
    for (int64_t e = 0; e < s2; ++e) d2[e] += term[e];
  }
  return "";
}

}  // namespace flowtt::tb::cpu
