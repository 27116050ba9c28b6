// The table-batched part of `flowtt_harness --sanitize` (sanitize.cuh): sections 4 and 5,
// the table-batched op in capacity passes as flowtt_jax.ops.pooled runs it and
// flowtt_tb_rows_fwd / _bwd over their paths. Included by sanitize.cuh after its helpers.
#pragma once

namespace sanitize {

// ---- 4. and 5. the table-batched ops ----

TTDims tb_dims(const flowtt::CoreShape& s) {
  return {(int)s.p1, (int)s.p2, (int)s.p3, (int)s.q1, (int)s.q2, (int)s.q3, (int)s.r1, (int)s.r2};
}

// The plan of a case as flowtt_tb_plan writes it: TbMakePlan's (padding 0) and perm,
// inverse, run_offsets.
struct TbFullPlan {
  tt::TbHostPlan p;
  std::vector<int32_t> perm, inverse, runs;
};

TbFullPlan tb_full_plan(const tt::TbCase& c) {
  TbFullPlan f;
  f.p = tt::TbMakePlan(c, 0);
  const int n = (int)c.ids.size();
  std::vector<int64_t> base(c.tables.size() + 1, 0);
  for (size_t t = 0; t < c.tables.size(); ++t)
    base[t + 1] = base[t] + c.tables[t].p1 * c.tables[t].p2 * c.tables[t].p3;
  std::vector<int64_t> key(n);
  for (int k = 0; k < n; ++k) key[k] = base[c.tab[k]] + c.ids[k];
  f.perm.resize(n);
  std::iota(f.perm.begin(), f.perm.end(), 0);
  std::stable_sort(f.perm.begin(), f.perm.end(), [&](int a, int b) { return key[a] < key[b]; });
  f.inverse.assign(n, 0);
  f.runs.assign(n + 1, n);
  int U = 0;
  for (int j = 0; j < n; ++j) {
    if (j == 0 || key[f.perm[j]] != key[f.perm[j - 1]]) f.runs[U++] = j;
    f.inverse[f.perm[j]] = U - 1;
  }
  return f;
}

// The plan's table metadata (cuda/contract/tb_plan_meta.h), [kTbPlanMetaRows, T], and the
// key spaces' sizes.
struct TbMeta {
  std::vector<int32_t> m;
  int64_t extent = 1, prefix_keys = 0, row_keys = 0;
};

TbMeta tb_meta(const tt::TbCase& c) {
  using namespace flowtt::tb;
  const int T = (int)c.tables.size();
  TbMeta r;
  r.m.assign((size_t)kTbPlanMetaRows * T, 0);
  int64_t prefixes = 0, rows = 0;
  for (int t = 0; t < T; ++t) {
    const tt::TbTable& tb = c.tables[t];
    auto at = [&](int row) -> int32_t& { return r.m[(size_t)row * T + t]; };
    at(kMetaRows) = (int32_t)tb.N;
    at(kMetaP2) = (int32_t)tb.p2;
    at(kMetaP3) = (int32_t)tb.p3;
    at(kMetaO1) = (int32_t)tb.o1;
    at(kMetaO2) = (int32_t)tb.o2;
    at(kMetaO3) = (int32_t)tb.o3;
    at(kMetaPrefixBase) = (int32_t)prefixes;
    at(kMetaRowBase) = (int32_t)(uint32_t)rows;
    prefixes += tb.p1 * tb.p2;
    rows += tb.p1 * tb.p2 * tb.p3;
    r.extent = std::max<int64_t>(r.extent, tb.p3);
  }
  r.prefix_keys = prefixes * r.extent;
  r.row_keys = rows;
  return r;
}

// A plan's arrays on the device (flowtt_tb_plan's outputs, n positions).
struct TbDevPlan {
  int n;
  DBuf<int> perm, inverse, runs, goffs, u_i3, g_i1, g_i2, counts;
  explicit TbDevPlan(int n_)
      : n(n_),
        perm(n_),
        inverse(n_),
        runs(n_ + 1),
        goffs(n_ + 1),
        u_i3(n_),
        g_i1(n_),
        g_i2(n_),
        counts(2) {}
  flowtt::tb::TbPlanOut out() {
    return {perm.p, inverse.p, runs.p, goffs.p, u_i3.p, g_i1.p, g_i2.p, counts.p};
  }
  void poison() {
    for (auto* b : {&perm, &inverse, &runs, &goffs, &u_i3, &g_i1, &g_i2, &counts}) b->poison();
  }
  bool equals(const TbFullPlan& f) const {
    const std::vector<int32_t> counts_ref = f.p.counts;
    return perm.get() == f.perm && inverse.get() == f.inverse && runs.get() == f.runs &&
           goffs.get() == f.p.group_offsets && u_i3.get() == f.p.u_i3 && g_i1.get() == f.p.g_i1 &&
           g_i2.get() == f.p.g_i2 && counts.get() == counts_ref;
  }
};

// flowtt_tb_window's outputs for a window of `size` uniques.
struct TbDevWindow {
  int size;
  DBuf<int> goffs, u_i3, g_i1, g_i2, counts;
  explicit TbDevWindow(int s) : size(s), goffs(s + 1), u_i3(s), g_i1(s), g_i2(s), counts(2) {}
  flowtt::tb::TbWindowOut out() { return {goffs.p, u_i3.p, g_i1.p, g_i2.p, counts.p}; }
};

// The window [lo, lo + size) of a host plan, as TbWindowWrite writes it (the CPU twin's loop).
struct TbHostWindow {
  std::vector<int32_t> goffs, u_i3, g_i1, g_i2, counts;
  int64_t uniques = 0, first = 0;
};

TbHostWindow tb_host_window(const TbFullPlan& f, int n, int lo, int size) {
  using namespace flowtt::tb;
  TbHostWindow w;
  w.goffs.assign(size + 1, 0);
  w.u_i3.assign(size, 0);
  w.g_i1.assign(size, 0);
  w.g_i2.assign(size, 0);
  w.counts.assign(2, 0);
  const TbWindowIn in{f.p.group_offsets.data(),
                      f.p.u_i3.data(),
                      f.p.g_i1.data(),
                      f.p.g_i2.data(),
                      f.p.counts.data(),
                      n,
                      lo,
                      size};
  const TbWindowOut out{w.goffs.data(), w.u_i3.data(), w.g_i1.data(), w.g_i2.data(),
                        w.counts.data()};
  const TbWindowHead h = TbWindowHeadOf(in);
  for (int64_t i = 0; i <= size; ++i) TbWindowWrite(in, h, i, out);
  w.uniques = h.uniques;
  w.first = h.first;
  return w;
}

// Tables of a capacity case's layout, its features' tables and the batch.
struct TbBatchSpec {
  std::string name;
  tt::TbCase layout;  // tables and shapes, no ids
  std::vector<int32_t> feature_tables;
  int batch, maxlen, C;
  double skew;
};

void tb_capacity(const TbBatchSpec& spec, std::mt19937_64& rng) {
  using namespace flowtt::tb;
  const std::string& name = spec.name;
  const int F = (int)spec.feature_tables.size(), T = (int)spec.layout.tables.size();
  const int B = F * spec.batch;
  // ---- the batch: bags of U[0, maxlen] ids, 3 positions before the first bag and 5 past
  // the last (not live), one offset below its predecessor (the op's CSR is the running
  // maximum), ~2% of ids out of their table's range
  std::vector<int32_t> offsets(B + 1, 3);
  for (int j = 0; j < B; ++j) offsets[j + 1] = offsets[j] + (int)(rng() % (spec.maxlen + 1));
  const int n = offsets[B] + 5;
  offsets[B / 2] = std::max(0, offsets[B / 2 - 1] - 2);
  std::vector<int32_t> ids(n, 0), num_rows(T);
  for (int t = 0; t < T; ++t) num_rows[t] = (int32_t)spec.layout.tables[t].N;
  std::uniform_real_distribution<double> x(0.0, 1.0);
  for (int j = 0; j < B; ++j) {
    const int64_t N = num_rows[spec.feature_tables[j / spec.batch]];
    for (int k = std::max(offsets[j], 0); k < std::min(offsets[j + 1], n); ++k) {
      ids[k] = (int32_t)std::min<int64_t>(N - 1, (int64_t)(N * std::pow(x(rng), spec.skew)));
      if (rng() % 50 == 0) ids[k] = rng() % 2 ? -1 : (int32_t)(N + 5);
    }
  }
  // ---- flowtt_tb_bags, both policies, against cpu::MakeTbBags; odd features end a
  // position before their last bag does (ends: that position in no bag)
  std::vector<int32_t> ends(F);
  for (int f = 0; f < F; ++f) ends[f] = offsets[(f + 1) * spec.batch] - (f % 2);
  DBuf<int32_t> d_ids(ids), d_offsets(offsets), d_ft(spec.feature_tables), d_rows_n(num_rows),
      d_ends(ends);
  DBuf<int32_t> b_ids(n), b_tables(n), b_bag(n), b_csr(B + 1);
  DBuf<float> b_live(n);
  std::vector<int32_t> h_ids(n), h_tables(n), h_bag(n), h_csr(B + 1);
  std::vector<float> h_live(n);
  for (bool clip : {true, false}) {  // "zero" last: its outputs feed the rest
    const TbBagsIn in_h{ids.data(),
                        offsets.data(),
                        spec.feature_tables.data(),
                        num_rows.data(),
                        ends.data(),
                        n,
                        B,
                        spec.batch,
                        F,
                        T,
                        clip};
    const TbBagsOut out_h{h_ids.data(), h_tables.data(), h_live.data(), h_bag.data(), h_csr.data()};
    flowtt::cpu::MakeTbBags(in_h, out_h);
    const TbBagsIn in_d{d_ids.p, d_offsets.p, d_ft.p, d_rows_n.p, d_ends.p, n,
                        B,       spec.batch,  F,      T,          clip};
    size_t bytes = 0;
    CK(tb_bags_scratch_bytes(n, B, &bytes));
    DBuf<char> scratch(bytes);
    scratch.fill(0xAB);
    for (auto* b : {&b_ids, &b_tables, &b_bag, &b_csr}) b->poison();
    b_live.poison();
    CK(tb_bags(in_d, TbBagsOut{b_ids.p, b_tables.p, b_live.p, b_bag.p, b_csr.p}, scratch.p, 0));
    sync();
    const bool ok = b_ids.get() == h_ids && b_tables.get() == h_tables && b_bag.get() == h_bag &&
                    b_csr.get() == h_csr && bitwise(b_live.get(), h_live);
    report(ok, fmt("%s: flowtt_tb_bags (%s, n=%d, %d bags) equals cpu::MakeTbBags", name.c_str(),
                   clip ? "clip" : "zero", n, B));
  }
  // ---- flowtt_tb_plan of the live ids: prefix keys, row keys, 64-bit keys
  tt::TbCase c = spec.layout;
  c.name = name;
  c.ids = h_ids;
  c.tab = h_tables;
  const TbFullPlan f = tb_full_plan(c);
  const tt::TbHostPlan& p = f.p;
  const TbMeta meta = tb_meta(c);
  DBuf<int32_t> d_meta(meta.m);
  TbDevPlan plan(n);
  struct Form {
    const char* what;
    bool row_keys;
    int64_t num_keys;
  };
  for (const Form& fm :
       {Form{"64-bit prefix keys", false, int64_t{1} << 33}, Form{"row keys", true, meta.row_keys},
        Form{"prefix keys", false, meta.prefix_keys}}) {
    const TbKeyForm form{TbPlanMeta{d_meta.p, T}, meta.extent, fm.row_keys};
    size_t bytes = 0;
    CK(tb_plan_scratch_bytes(n, fm.num_keys, &bytes));
    DBuf<char> scratch(bytes);
    scratch.fill(0xAB);
    plan.poison();
    CK(build_tb_plan(b_ids.p, b_tables.p, n, form, fm.num_keys, plan.out(), scratch.p, 0));
    sync();
    report(plan.equals(f), fmt("%s: flowtt_tb_plan (%s, %lld keys) n=%d U=%d G=%d equals "
                               "the host plan",
                               name.c_str(), fm.what, (long long)fm.num_keys, n, p.U, p.G));
  }
  // ---- capacity passes
  const TTDims t = tb_dims(c.s);
  if (const char* why = tb_check_dims(t)) {
    report(false, name + ": " + why);
    return;
  }
  const int D = (int)c.s.dim(), C = spec.C;
  const tt::TbCores k = tt::TbRandomCores(c.s, 7);
  const std::vector<double> rows_ref = tt::TbRefRows(c, p, k);
  std::vector<float> w(n);
  std::uniform_real_distribution<float> uw(0.5f, 1.5f);
  std::vector<int> out_rows(n), inverse(f.inverse.begin(), f.inverse.end()),
      csr(h_csr.begin(), h_csr.end());
  for (int q = 0; q < n; ++q) out_rows[q] = (int)PoolOutRow(h_bag[q], B, spec.batch);
  const std::vector<float> dout = randn(rng, (size_t)B * D);
  DBuf<float> g1(k.g1), g2(k.g2), g3(k.g3), d_w(n), d_dout(dout), out((size_t)B * D),
      rows_w((size_t)C * D), d_rows_w((size_t)C * D), dg1(k.g1.size()), dg2(k.g2.size()),
      dg3(k.g3.size()), wts(n);
  DBuf<int> orow(out_rows);
  DBuf<char> fscratch(tb_rows_fwd_scratch_bytes(t, C)), bscratch(tb_rows_bwd_scratch_bytes(t, C)),
      pscratch(flowtt::bag_pool_bwd_scratch_bytes(n, D));
  fscratch.fill(0xAB);
  bscratch.fill(0xAB);
  pscratch.fill(0xAB);
  TbDevWindow win(C);
  int cut = 0;  // the forward's windows whose first prefix group started before lo
  // window lo of the plan: flowtt_tb_window on the device, against the host's
  auto window = [&](int lo, bool forward) {
    for (auto* b : {&win.goffs, &win.u_i3, &win.g_i1, &win.g_i2, &win.counts}) b->poison();
    const TbWindowIn in{plan.goffs.p,  plan.u_i3.p, plan.g_i1.p, plan.g_i2.p,
                        plan.counts.p, n,           lo,          C};
    CK(tb_window(in, win.out(), 0));
    sync();
    const TbHostWindow h = tb_host_window(f, n, lo, C);
    // a window that starts inside a prefix group (its first group cut)
    if (forward && lo > 0 && h.uniques > 0 && f.p.group_offsets[h.first] < lo) ++cut;
    const bool ok = win.goffs.get() == h.goffs && win.u_i3.get() == h.u_i3 &&
                    win.g_i1.get() == h.g_i1 && win.g_i2.get() == h.g_i2 &&
                    win.counts.get() == h.counts;
    if (!ok)
      report(false, fmt("%s: flowtt_tb_window lo=%d size=%d (%s) differs from "
                        "TbWindowWrite's",
                        name.c_str(), lo, C, forward ? "forward" : "backward"));
    return (int)h.uniques;
  };
  // the window's rows on the device (rows_w, poisoned first) against the oracle's
  auto window_rows = [&](int lo, int cnt) {
    rows_w.poison();
    CK(tb_rows_fwd(t, g1.p, g2.p, g3.p, win.u_i3.p, win.g_i1.p, win.g_i2.p, win.goffs.p,
                   win.counts.p, C, rows_w.p, fscratch.p, 0));
    sync();
    const std::vector<double> ref(rows_ref.begin() + (size_t)lo * D,
                                  rows_ref.begin() + (size_t)(lo + cnt) * D);
    return cnt > 0 ? rel(rows_w.get(), ref, (size_t)cnt * D) : 0.0;
  };
  for (bool weighted : {true, false}) {
    for (int q = 0; q < n; ++q) w[q] = h_live[q] * (weighted ? uw(rng) : 1.f);
    wts.set(w);
    // forward: per pass the window, its rows, their pooling onto the previous passes'
    std::vector<double> out_ref((size_t)B * D, 0.0), dr_ref, dw_ref;
    std::vector<double> dg_sum[3] = {std::vector<double>(k.g1.size(), 0.0),
                                     std::vector<double>(k.g2.size(), 0.0),
                                     std::vector<double>(k.g3.size(), 0.0)};
    std::vector<float> d_rows_all((size_t)p.U * D, NAN);
    double e_rows = 0, e_dr = 0, e_dw = 0;
    int passes = 0, empty = 0;
    cut = 0;
    out.poison();
    for (int lo = 0; lo < n; lo += C, ++passes) {
      const int cnt = window(lo, true);
      empty += cnt == 0;
      e_rows = std::max(e_rows, window_rows(lo, cnt));
      CK(flowtt::bag_pool_fwd(rows_w.p, plan.inverse.p, wts.p, b_csr.p, n, B, D, spec.batch,
                              PoolWindow{lo, C}, plan.counts.p, lo == 0 ? nullptr : out.p, out.p,
                              0));
      pool_ref_fwd(csr, B, spec.batch, inverse, w, rows_ref, D, lo, lo + cnt, &out_ref);
    }
    sync();
    const double e_out = rel(out.get(), out_ref);
    // backward: per pass the window again, its rows again (weighted: d_weights reads them),
    // the window's d_rows (and d_weights), the core gradients of the window's plan
    for (int lo = 0; lo < n; lo += C) {
      const int cnt = window(lo, false);
      if (weighted) e_rows = std::max(e_rows, window_rows(lo, cnt));
      d_rows_w.poison();
      d_w.poison();
      CK(flowtt::bag_pool_bwd(d_dout.p, weighted ? rows_w.p : nullptr, wts.p, plan.inverse.p,
                              orow.p, plan.perm.p, plan.runs.p, plan.counts.p, n, B, D,
                              PoolWindow{lo, C}, d_rows_w.p, weighted ? d_w.p : nullptr, pscratch.p,
                              0));
      for (auto* b : {&dg1, &dg2, &dg3}) b->poison();
      CK(tb_rows_bwd(t, g1.p, g2.p, g3.p, d_rows_w.p, win.u_i3.p, win.g_i1.p, win.g_i2.p,
                     win.goffs.p, win.counts.p, C, dg1.p, dg2.p, dg3.p, bscratch.p, 0));
      sync();
      pool_ref_bwd(inverse, w, rows_ref, D, lo, lo + cnt, dout, out_rows, &dr_ref, &dw_ref);
      const std::vector<float> dr = d_rows_w.get((size_t)cnt * D);
      if (cnt > 0) e_dr = std::max(e_dr, rel(dr, dr_ref));
      std::copy(dr.begin(), dr.end(), d_rows_all.begin() + (size_t)lo * D);
      if (weighted) e_dw = std::max(e_dw, rel(d_w.get(), dw_ref));
      const std::vector<float> got[3] = {dg1.get(), dg2.get(), dg3.get()};
      for (int i = 0; i < 3; ++i)
        for (size_t e = 0; e < got[i].size(); ++e) dg_sum[i][e] += got[i][e];
    }
    std::vector<double> r1, r2, r3;
    tt::TbRefGrads(c, p, k, d_rows_all, &r1, &r2, &r3);
    auto rel_d = [](const std::vector<double>& a, const std::vector<double>& ref) {
      const std::vector<float> af(a.begin(), a.end());
      return rel(af, ref);
    };
    const double e1 = rel_d(dg_sum[0], r1), e2 = rel_d(dg_sum[1], r2), e3 = rel_d(dg_sum[2], r3);
    const double worst = std::max({e_rows, e_out, e_dr, e_dw, e1, e2, e3});
    report(worst < tt::kTbTol && empty > 0 && passes > 2,
           fmt("%s: capacity passes %s: %d windows of %d (U=%d, G=%d, %d empty, %d cutting "
               "a group), rows %.2e out %.2e d_rows %.2e d_weights %.2e dg1 %.2e "
               "dg2 %.2e dg3 %.2e",
               name.c_str(), weighted ? "weighted" : "unweighted", passes, C, p.U, p.G, empty, cut,
               e_rows, e_out, e_dr, e_dw, e1, e2, e3));
  }
}

void tb_capacities(std::mt19937_64& rng, const std::function<bool(const std::string&)>& want) {
  {  // compile-time dims (2,4,4) r 32: sorted tiles, dg2 on tensor cores, the P cache; table
     // 2's prefix groups of 500 rows, hot: windows cut them
    TbBatchSpec s{"san_tb_capacity_d32_r32",
                  tt::TbStack("", 2, 4, 4, 32, 32,
                              {{1000, 10, 10, 10}, {5000, 20, 16, 16}, {3000, 3, 2, 500}}),
                  {0, 1, 2, 1},
                  40,
                  14,  // n > 1,024: flowtt_tb_bags over two spans (blocks)
                  256,
                  3.0};
    if (want(s.name)) tb_capacity(s, rng);
  }
  {  // odd shapes (3,1,5) r (5,7): the scalar kernels, pooling D = 15 (scalar lanes)
    TbBatchSpec s{"san_tb_capacity_odd_q315",
                  tt::TbStack("", 3, 1, 5, 5, 7, {{500, 8, 8, 8}, {77, 3, 5, 6}}),
                  {0, 1, 0},
                  30,
                  10,
                  64,
                  2.0};
    if (want(s.name)) tb_capacity(s, rng);
  }
}

// One table-batched case's rows ops over their variants: the forward as sorted tiles and
// chunked, the compile-time dims instances against the run-time ones (bitwise), the
// backward against the oracle (its bitwise reproducibility: cuda/harness/tb_rows_harness.cu).
// misalign: every float operand one float past 16-byte alignment (the scalar kernels, no tiles, no
// P cache, dg2 off tensor cores).
void tb_rows_case(const tt::TbCase& c, bool misalign) {
  using namespace flowtt::tb;
  const tt::TbHostPlan p = tt::TbMakePlan(c, tt::kTbPad);  // padding the ops must never read
  const std::string tag = fmt("%s%s (n=%lld U=%d G=%d)", c.name.c_str(),
                              misalign ? " misaligned" : "", (long long)p.n, p.U, p.G);
  const TTDims t = tb_dims(c.s);
  if (const char* why = tb_check_dims(t)) {
    report(false, tag + ": " + why);
    return;
  }
  const int n = (int)p.n, D = (int)c.s.dim(), off = misalign ? 1 : 0;
  const tt::TbCores k = tt::TbRandomCores(c.s, 11);
  std::vector<float> dr_h = tt::TbRandom((size_t)n * D, 23);
  std::fill(dr_h.begin() + (size_t)p.U * D, dr_h.end(), NAN);  // past num_unique: never read
  DBuf<float> g1(k.g1, off), g2(k.g2, off), g3(k.g3, off), rows((size_t)n * D, off),
      d_rows(dr_h, off), dg1(k.g1.size(), off), dg2(k.g2.size(), off), dg3(k.g3.size(), off);
  DBuf<int> u_i3(p.u_i3), g_i1(p.g_i1), g_i2(p.g_i2), goffs(p.group_offsets), counts(p.counts);
  DBuf<char> scratch(std::max(tb_rows_fwd_scratch_bytes(t, n), tb_rows_bwd_scratch_bytes(t, n)));
  scratch.fill(0xAB);
  auto fwd = [&](bool tiles, bool fixed) {
    rows.poison();
    CK(tb_rows_fwd(t, g1.p, g2.p, g3.p, u_i3.p, g_i1.p, g_i2.p, goffs.p, counts.p, n, rows.p,
                   scratch.p, 0, tiles, fixed));
    sync();
    return rows.get((size_t)p.U * D);
  };
  auto bwd = [&](bool fixed) {
    for (auto* b : {&dg1, &dg2, &dg3}) b->poison();
    CK(tb_rows_bwd(t, g1.p, g2.p, g3.p, d_rows.p, u_i3.p, g_i1.p, g_i2.p, goffs.p, counts.p, n,
                   dg1.p, dg2.p, dg3.p, scratch.p, 0, kTbAllStages, fixed));
    sync();
    return std::vector<std::vector<float>>{dg1.get(), dg2.get(), dg3.get()};
  };
  const std::vector<double> rref = tt::TbRefRows(c, p, k);
  const std::vector<float> tiles = fwd(true, true), chunked = fwd(false, true);
  const double e_t = rel(tiles, rref), e_c = rel(chunked, rref);
  std::vector<double> r1, r2, r3;
  tt::TbRefGrads(c, p, k, dr_h, &r1, &r2, &r3);
  const auto ga = bwd(true);
  const double e1 = rel(ga[0], r1), e2 = rel(ga[1], r2), e3 = rel(ga[2], r3);
  bool fixed_same = true;
  const bool has_fixed = tb_has_fixed_dims(t);
  if (has_fixed) {  // the run-time dims instances: bitwise the same
    const auto gr = bwd(false);
    fixed_same = bitwise(fwd(true, false), tiles) && bitwise(fwd(false, false), chunked) &&
                 bitwise(gr[0], ga[0]) && bitwise(gr[1], ga[1]) && bitwise(gr[2], ga[2]);
  }
  const double worst = std::max({e_t, e_c, e1, e2, e3});
  report(worst < tt::kTbTol && fixed_same,
         fmt("%s: tb rows fwd tiles %.2e chunked %.2e, bwd dg1 %.2e dg2 %.2e dg3 %.2e%s",
             tag.c_str(), e_t, e_c, e1, e2, e3,
             has_fixed ? (fixed_same ? ", run-time dims bitwise equal" : ", run-time dims DIFFER")
                       : ""));
}

void tb_rows_cases(const std::function<bool(const std::string&)>& want) {
  std::mt19937_64 rng(20261203);
  auto two_tables = [&](const std::string& name, int q1, int q2, int q3, int r1, int r2) {
    tt::TbCase c = tt::TbStack(name, q1, q2, q3, r1, r2, {{1000, 10, 10, 10}, {2400, 8, 10, 30}});
    tt::TbAddIds(&c, 0, 250, 3.0, &rng);  // hot prefixes
    tt::TbAddIds(&c, 1, 350, 2.0, &rng);
    for (size_t tb = 0; tb < c.tables.size(); ++tb) tt::TbAddId(&c, (int)tb, c.tables[tb].N - 1);
    return c;
  };
  struct V {
    const char* name;
    int q1, q2, q3, r1, r2;
    bool misalign_too;
  };
  const V list[] = {
      // compile-time dims (Meta-like): tiles, dg2 and its dP rounds on tensor cores, the P
      // cache on tensor cores, E; misaligned: the scalar kernels, dg3 without the P cache
      {"san_tb_q244_r32", 2, 4, 4, 32, 32, true},
      {"san_tb_q224_r16", 2, 2, 4, 16, 16, false},  // compile-time dims (DLRM's)
      {"san_tb_q144_r16_4", 1, 4, 4, 16, 4, true},  // dg2 on tensor cores, dP on FMA; q1 = 1
      {"san_tb_q164_r64", 1, 6, 4, 64, 64, false},  // g2 rows of 24,576: no E, dg1 merges
      {"san_tb_q824_r8", 8, 2, 4, 8, 8, false},     // q1 = 8, dg2 on FMA (float4)
      {"san_tb_q448_r32", 4, 4, 8, 32, 32, false},  // q1 = 4, tiles at q3 = 8
      {"san_tb_q448_r64", 4, 4, 8, 64, 64, false},  // r 64: 4 groups a tile
      {"san_tb_q315_r5_7", 3, 1, 5, 5, 7, false},   // q1 = 3: the generic instances
  };
  for (const V& v : list) {
    if (!want(v.name)) continue;
    const tt::TbCase c = two_tables(v.name, v.q1, v.q2, v.q3, v.r1, v.r2);
    tb_rows_case(c, false);
    if (v.misalign_too) tb_rows_case(c, true);
  }
  if (want("san_tb_shared_g2")) {  // tables 0 and 1 share their packed g2 rows; q3 = 2
    tt::TbCase c =
        tt::TbStack("san_tb_shared_g2", 1, 8, 2, 64, 8, {{640, 8, 8, 10}, {800, 10, 8, 10}});
    c.tables[1].o2 = 0;
    c.s.p2 = 8;
    tt::TbAddIds(&c, 0, 300, 2.0, &rng);
    tt::TbAddIds(&c, 1, 300, 2.0, &rng);
    tb_rows_case(c, false);
  }
  if (want("san_tb_one_group")) {  // one group holding every unique id of table 0
    tt::TbCase c =
        tt::TbStack("san_tb_one_group", 2, 2, 4, 16, 16, {{700, 1, 1, 700}, {50, 5, 5, 2}});
    tt::TbAddIds(&c, 0, 800, 1.0, &rng);
    tt::TbAddIds(&c, 1, 10, 1.0, &rng);
    tb_rows_case(c, false);
  }
}

}  // namespace sanitize
