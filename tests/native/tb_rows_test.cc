// Standalone check of the CPU table-batched rows ops (ffi/cpu/tb_rows.h) and the shared shape
// checks (cuda/contract/tb_contract.h) against a float64 oracle (tests/native/tb_testing.h).
// Build and run (from the repository root):
//   g++ -std=c++17 -O2 -Icuda -Iffi -Itests/native tests/native/tb_rows_test.cc ffi/cpu/tb_rows.cc
//   -o tb_rows_test
//   ./tb_rows_test          (add -fsanitize=address,undefined to prove no out-of-bounds read)
// Per case: outputs poisoned with NaN, plan padding and d_rows past num_unique poisoned
// (a read of either shows), rows and gradients compared with the oracle (relative L2),
// the backward run twice and compared bit for bit. Then invalid plans and shapes must
// give an error. Prints PASS/FAIL lines; exit status 1 on any failure.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "contract/tb_contract.h"
#include "cpu/tb_rows.h"
#include "tb_testing.h"

namespace {

using namespace flowtt::tb;
using namespace flowtt::tb::testing;

cpu::TbPlan View(const TbHostPlan& p) {
  return {p.u_i3.data(), p.g_i1.data(), p.g_i2.data(), p.group_offsets.data(),
          p.n,           p.counts[0],   p.counts[1]};
}

// d_rows [n, D]: random below num_unique, NaN past it (the ops must not read it).
std::vector<float> DRows(const TbHostPlan& p, int64_t D, uint64_t seed) {
  std::vector<float> d = TbRandom(p.n * D, seed);
  for (int64_t i = int64_t(p.U) * D; i < p.n * D; ++i) d[i] = NAN;
  return d;
}

void RunCase(const TbCase& c, const TbHostPlan& p) {
  const TbShape& s = c.s;
  const int64_t D = s.dim();
  const TbCores k = TbRandomCores(s, 11);
  const std::string tag = c.name + " (n=" + std::to_string(p.n) + " U=" + std::to_string(p.U) +
                          " G=" + std::to_string(p.G) + ")";
  // forward
  std::vector<float> rows(p.n * D, NAN);
  std::string err = cpu::TbRowsFwd(s, k.g1.data(), k.g2.data(), k.g3.data(), View(p), rows.data());
  if (!err.empty()) {
    TbReport(false, tag + " fwd: " + err);
    return;
  }
  const std::vector<double> ref = TbRefRows(c, p, k);
  const double e_rows = TbRelErr(rows.data(), ref.data(), ref.size());
  bool tail_zero = true;
  for (int64_t i = int64_t(p.U) * D; i < p.n * D; ++i) tail_zero &= rows[i] == 0.0f;
  char buf[160];
  std::snprintf(buf, sizeof buf, " fwd rel err %.2e, rows past U zero: %s", e_rows,
                tail_zero ? "yes" : "no");
  TbReport(e_rows < kTbTol && tail_zero, tag + buf);
  // backward, twice
  const std::vector<float> d_rows = DRows(p, D, 23);
  std::vector<float> dg[2][3];
  for (int run = 0; run < 2; ++run) {
    dg[run][0].assign(k.g1.size(), NAN);
    dg[run][1].assign(k.g2.size(), NAN);
    dg[run][2].assign(k.g3.size(), NAN);
    err = cpu::TbRowsBwd(s, k.g1.data(), k.g2.data(), k.g3.data(), d_rows.data(), View(p),
                         dg[run][0].data(), dg[run][1].data(), dg[run][2].data());
    if (!err.empty()) {
      TbReport(false, tag + " bwd: " + err);
      return;
    }
  }
  std::vector<double> r1, r2, r3;
  TbRefGrads(c, p, k, d_rows, &r1, &r2, &r3);
  const double e1 = TbRelErr(dg[0][0].data(), r1.data(), r1.size());
  const double e2 = TbRelErr(dg[0][1].data(), r2.data(), r2.size());
  const double e3 = TbRelErr(dg[0][2].data(), r3.data(), r3.size());
  bool same = true;
  for (int i = 0; i < 3; ++i) {
    same &= std::memcmp(dg[0][i].data(), dg[1][i].data(), dg[0][i].size() * sizeof(float)) == 0;
  }
  std::snprintf(buf, sizeof buf,
                " bwd rel err dg1 %.2e dg2 %.2e dg3 %.2e, two runs bitwise equal: %s", e1, e2, e3,
                same ? "yes" : "no");
  TbReport(e1 < kTbTol && e2 < kTbTol && e3 < kTbTol && same, tag + buf);
}

// An invalid plan must give an error from both ops (never a crash or a read out of bounds).
void ExpectPlanError(const TbCase& c, const TbHostPlan& p, const std::string& what) {
  const TbShape& s = c.s;
  const TbCores k = TbRandomCores(s, 3);
  std::vector<float> rows(p.n * s.dim()), d_rows(p.n * s.dim(), 0.0f);
  std::vector<float> d1(k.g1.size()), d2(k.g2.size()), d3(k.g3.size());
  const std::string ef =
      cpu::TbRowsFwd(s, k.g1.data(), k.g2.data(), k.g3.data(), View(p), rows.data());
  const std::string eb = cpu::TbRowsBwd(s, k.g1.data(), k.g2.data(), k.g3.data(), d_rows.data(),
                                        View(p), d1.data(), d2.data(), d3.data());
  TbReport(!ef.empty() && !eb.empty(), "invalid plan rejected: " + what + " [" + ef + "]");
}

void PlanValidation() {
  TbCase c = TbStandardCases()[0];
  const TbHostPlan good = TbMakePlan(c, 0);
  auto bad = [&](const std::string& what, auto edit) {
    TbHostPlan p = good;
    edit(p);
    ExpectPlanError(c, p, what);
  };
  bad("u_i3 = p3", [&](TbHostPlan& p) { p.u_i3[p.U - 1] = (int32_t)c.s.p3; });
  bad("u_i3 < 0", [&](TbHostPlan& p) { p.u_i3[0] = -1; });
  bad("g_i1 = p1", [&](TbHostPlan& p) { p.g_i1[p.G - 1] = (int32_t)c.s.p1; });
  bad("g_i2 < 0", [&](TbHostPlan& p) { p.g_i2[3] = -5; });
  bad("g_i1 decreasing", [&](TbHostPlan& p) { std::swap(p.g_i1[0], p.g_i1[p.G - 1]); });
  bad("num_unique > n", [&](TbHostPlan& p) { p.counts[0] = (int32_t)p.n + 1; });
  bad("num_groups > num_unique", [&](TbHostPlan& p) { p.counts[1] = p.U + 1; });
  bad("num_groups < 0", [&](TbHostPlan& p) { p.counts[1] = -1; });
  bad("group_offsets decreasing",
      [&](TbHostPlan& p) { p.group_offsets[2] = p.group_offsets[1] - 1; });
  bad("group_offsets not ending at num_unique",
      [&](TbHostPlan& p) { p.group_offsets[p.G] = p.U - 1; });
  bad("group_offsets not starting at 0", [&](TbHostPlan& p) { p.group_offsets[0] = 1; });
}

void ShapeValidation() {
  using V = std::vector<int64_t>;
  const V g1{10, 1, 2, 8}, g2{12, 8, 4, 6}, g3{14, 6, 4, 1}, v{5}, go{6}, cnt{2}, rows{5, 32};
  TbShape s;
  int64_t n;
  TbReport(TbCheckFwd(g1, g2, g3, v, v, v, go, cnt, rows, &s, &n).empty() && n == 5 && s.p2 == 12 &&
               s.r2 == 6,
           "shape check accepts a valid forward");
  TbReport(TbCheckBwd(g1, g2, g3, rows, v, v, v, go, cnt, g1, g2, g3, &s, &n).empty(),
           "shape check accepts a valid backward");
  auto rejects = [&](const std::string& e, const char* what) {
    TbReport(!e.empty(), std::string("shape check rejects ") + what + " [" + e + "]");
  };
  rejects(TbCheckFwd(V{10, 2, 8}, g2, g3, v, v, v, go, cnt, rows, &s, &n), "a 3-D core");
  rejects(TbCheckFwd(g1, V{12, 7, 4, 6}, g3, v, v, v, go, cnt, rows, &s, &n), "unchained ranks");
  rejects(TbCheckFwd(V{10, 2, 2, 8}, g2, g3, v, v, v, go, cnt, rows, &s, &n), "g1 r0 != 1");
  rejects(TbCheckFwd(g1, g2, V{0, 6, 4, 1}, v, v, v, go, cnt, rows, &s, &n), "an empty core");
  rejects(TbCheckFwd(g1, g2, g3, v, V{4}, v, go, cnt, rows, &s, &n), "g_i1 of another length");
  rejects(TbCheckFwd(g1, g2, g3, v, v, v, V{5}, cnt, rows, &s, &n), "group_offsets [n]");
  rejects(TbCheckFwd(g1, g2, g3, v, v, v, go, V{3}, rows, &s, &n), "counts [3]");
  rejects(TbCheckFwd(g1, g2, g3, V{0}, V{0}, V{0}, V{1}, cnt, V{0, 32}, &s, &n), "n = 0");
  rejects(TbCheckFwd(g1, g2, g3, v, v, v, go, cnt, V{5, 16}, &s, &n), "rows [n, D/2]");
  rejects(TbCheckBwd(g1, g2, g3, V{4, 32}, v, v, v, go, cnt, g1, g2, g3, &s, &n),
          "d_rows [n-1, D]");
  rejects(TbCheckBwd(g1, g2, g3, rows, v, v, v, go, cnt, g1, g3, g3, &s, &n), "dg2 of g3's shape");
  rejects(TbCheckFwd(V{int64_t{1} << 31, 1, 2, 8}, g2, g3, v, v, v, go, cnt, rows, &s, &n),
          "p1 = 2^31");
}

}  // namespace

int main() {
  for (const TbCase& c : TbStandardCases()) RunCase(c, TbMakePlan(c, kTbPad));
  {  // num_unique = 0: rows and gradients all zero, nothing read
    const auto [c, p] = TbNoUniqueIdsCase(kTbPad);
    RunCase(c, p);
  }
  PlanValidation();
  ShapeValidation();
  return TbExitStatus();
}
