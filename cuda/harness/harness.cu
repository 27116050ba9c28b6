// Standalone check + timing of the FlowTT kernels (no JAX, no XLA).
// Build: scripts/build_harness.sh BUILD_DIR (cmake target flowtt_harness)
// Run:   BUILD_DIR/flowtt_harness [--quick | --s1 | --s1-timing | --only SUBSTR]
//        BUILD_DIR/flowtt_harness --sanitize [SUBSTR]   (small checked cases that launch every
//        kernel of the library, no timing, for compute-sanitizer: cuda/harness/sanitize.cuh,
//        scripts/gpu_race.sh)
// (--only: just the cases whose name contains SUBSTR, checked and timed; their ids are
// those of a full run, their cores and gradients drawn after the skipped cases' ids)
// For every case: host plan (same as flowtt_jax.plan.make_plan), outputs
// poisoned with NaN, all four ops on the GPU, compared with a float64 host
// reference (relative L2 error), backward run twice and compared bitwise.
// Then device-side timing (CUDA events, median of 50) on the S1 workload.
// A profiling build (FLOWTT_STAGE_MASK < 31, cuda/include/ops.h) runs only some backward
// stages: it checks nothing and prints the backward time of those stages (STAGES).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "include/ops.h"

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      exit(2);                                                                                 \
    }                                                                                          \
  } while (0)

using flowtt::TTDims;

// Whether this build runs every backward stage (else outputs are left unwritten).
constexpr bool kAllStages = FLOWTT_STAGE_MASK == 31;

struct Plan {
  std::vector<int> perm, inverse, unique_ids, run_offsets, group_offsets;
  int U = 0, G = 0;
};

Plan make_plan(const std::vector<int>& ids, const TTDims& t) {
  const int n = (int)ids.size();
  Plan p;
  p.perm.resize(n);
  std::iota(p.perm.begin(), p.perm.end(), 0);
  std::stable_sort(p.perm.begin(), p.perm.end(), [&](int a, int b) { return ids[a] < ids[b]; });
  p.inverse.assign(n, 0);
  p.unique_ids.assign(n, 0);
  p.run_offsets.assign(n + 1, n);
  p.group_offsets.assign(n + 1, 0);
  int U = 0;
  for (int j = 0; j < n; ++j) {
    const int id = ids[p.perm[j]];
    if (j == 0 || id != ids[p.perm[j - 1]]) {
      p.unique_ids[U] = id;
      p.run_offsets[U] = j;
      ++U;
    }
    p.inverse[p.perm[j]] = U - 1;
  }
  int G = 0;
  for (int u = 0; u < U; ++u) {
    const long long pre = p.unique_ids[u] / t.p3;
    if (u == 0 || pre != p.unique_ids[u - 1] / t.p3) p.group_offsets[G++] = u;
  }
  for (int g = G; g <= n; ++g) p.group_offsets[g] = U;
  p.U = U;
  p.G = G;
  return p;
}

struct Case {
  std::string name;
  TTDims t;
  long long N;
  std::vector<int> ids;
  std::vector<int> bag_offsets;  // B+1
  bool check = true;
};

// Zipf(alpha) ranks like numpy's rng.zipf (unbounded): ranks below K from an
// exact CDF table, the tail mass past K (K^(1-alpha)/(alpha-1)) from the
// continuous Pareto tail; then rank * 2654435761 mod N when scattered.
std::vector<int> zipf_ids(std::mt19937_64& rng, long long N, double alpha, int n, bool scatter) {
  const long long K = std::min<long long>(N, 10000000);
  std::vector<double> cdf(K);
  double s = 0;
  for (long long k = 0; k < K; ++k) {
    s += 1.0 / std::pow((double)(k + 1), alpha);
    cdf[k] = s;
  }
  const double tail = std::pow((double)K, 1.0 - alpha) / (alpha - 1.0);
  std::uniform_real_distribution<double> U01(0.0, s + tail), V(0.0, 1.0);
  std::vector<int> ids(n);
  for (int i = 0; i < n; ++i) {
    const double x = U01(rng);
    unsigned long long r;
    if (x < s) {
      r = std::lower_bound(cdf.begin(), cdf.end(), x) - cdf.begin();
      if ((long long)r >= K) r = K - 1;
    } else {
      const double v = std::max(V(rng), 1e-300);
      r = (unsigned long long)std::min(K * std::pow(v, -1.0 / (alpha - 1.0)), 9e18);
    }
    unsigned long long id =
        scatter ? (r * 2654435761ULL) % (unsigned long long)N : r % (unsigned long long)N;
    ids[i] = (int)id;
  }
  return ids;
}

// n ids drawn uniformly from [lo, hi].
std::vector<int> uniform_ids(std::mt19937_64& rng, int lo, int hi, int n) {
  std::uniform_int_distribution<int> U(lo, hi);
  std::vector<int> ids(n);
  for (auto& x : ids) x = U(rng);
  return ids;
}

std::vector<int> bags_uniform(std::mt19937_64& rng, int B, int lo, int hi) {
  std::vector<int> off(B + 1, 0);
  std::uniform_int_distribution<int> L(lo, hi);
  for (int b = 0; b < B; ++b) off[b + 1] = off[b] + L(rng);
  return off;
}

// Relative L2 error of a[:len] (default: all) against ref.
double rel_err(const std::vector<float>& a, const std::vector<double>& ref, bool* has_nan,
               size_t len = SIZE_MAX) {
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(len, a.size()); ++i) {
    if (!std::isfinite(a[i])) *has_nan = true;
    const double d = (double)a[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

template <typename T>
T* to_dev(const std::vector<T>& v) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(1, v.size()) * sizeof(T)));
  if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <typename T>
std::vector<T> from_dev(const T* p, size_t n) {
  std::vector<T> v(n);
  CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}
void poison(float* p, size_t n) { CK(cudaMemset(p, 0xFF, n * sizeof(float))); }

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run_case(const Case& c, std::mt19937_64& rng, bool timing) {
  const TTDims& t = c.t;
  const int D = t.D();
  const int n = (int)c.ids.size();
  const int B = (int)c.bag_offsets.size() - 1;
  if (const char* m = flowtt::check_dims(t)) {
    printf("[%s] unsupported: %s\n", c.name.c_str(), m);
    return 1;
  }
  Plan p = make_plan(c.ids, t);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> g1((size_t)t.p1 * t.q1 * t.r1), g2((size_t)t.p2 * t.r1 * t.q2 * t.r2),
      g3((size_t)t.p3 * t.r2 * t.q3);
  const float s1 = 1.f / std::sqrt((float)t.r1), s2 = 1.f / std::sqrt((float)t.r2);
  for (auto& x : g1) x = nd(rng);
  for (auto& x : g2) x = nd(rng) * s1;
  for (auto& x : g3) x = nd(rng) * s2;
  std::vector<float> w(n);
  std::uniform_real_distribution<float> uw(0.5f, 1.5f);
  for (auto& x : w) x = uw(rng);
  std::vector<int> bag_ids(n);
  for (int b = 0; b < B; ++b)
    for (int k = c.bag_offsets[b]; k < c.bag_offsets[b + 1]; ++k) bag_ids[k] = b;
  std::vector<float> dout((size_t)B * D);
  for (auto& x : dout) x = nd(rng);
  std::vector<int> counts = {p.U, p.G};

  float *d_g1 = to_dev(g1), *d_g2 = to_dev(g2), *d_g3 = to_dev(g3), *d_w = to_dev(w),
        *d_dout = to_dev(dout);
  int *d_uids = to_dev(p.unique_ids), *d_goffs = to_dev(p.group_offsets),
      *d_counts = to_dev(counts), *d_inv = to_dev(p.inverse), *d_perm = to_dev(p.perm),
      *d_runs = to_dev(p.run_offsets), *d_bags = to_dev(c.bag_offsets), *d_bagids = to_dev(bag_ids);
  float *d_rows, *d_out, *d_drows, *d_dw, *d_dg1, *d_dg2, *d_dg3;
  CK(cudaMalloc(&d_rows, (size_t)n * D * 4));
  CK(cudaMalloc(&d_out, std::max<size_t>(1, (size_t)B * D) * 4));
  CK(cudaMalloc(&d_drows, (size_t)n * D * 4));
  CK(cudaMalloc(&d_dw, (size_t)n * 4));
  CK(cudaMalloc(&d_dg1, g1.size() * 4));
  CK(cudaMalloc(&d_dg2, g2.size() * 4));
  CK(cudaMalloc(&d_dg3, g3.size() * 4));
  const size_t fs = flowtt::rows_fwd_scratch_bytes(t, n);
  const size_t bs = flowtt::rows_bwd_scratch_bytes(t, n);
  void *d_fs, *d_bs, *d_ps;
  CK(cudaMalloc(&d_ps, flowtt::bag_pool_bwd_scratch_bytes(n, D)));
  CK(cudaMemset(d_ps, 0xAB, flowtt::bag_pool_bwd_scratch_bytes(n, D)));
  CK(cudaMalloc(&d_fs, fs));
  CK(cudaMalloc(&d_bs, bs));
  CK(cudaMemset(d_fs, 0xAB, fs));  // scratch starts dirty
  CK(cudaMemset(d_bs, 0xAB, bs));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));

  poison(d_rows, (size_t)n * D);
  poison(d_out, (size_t)B * D);
  poison(d_drows, (size_t)n * D);
  poison(d_dw, n);
  poison(d_dg1, g1.size());
  poison(d_dg2, g2.size());
  poison(d_dg3, g3.size());
  CK(flowtt::rows_fwd(t, d_g1, d_g2, d_g3, d_uids, d_goffs, d_counts, n, d_rows, d_fs, st));
  CK(flowtt::bag_pool_fwd(d_rows, d_inv, d_w, d_bags, n, B, D, 0, {0, n}, nullptr, nullptr, d_out, st));
  CK(flowtt::bag_pool_bwd(d_dout, d_rows, d_w, d_inv, d_bagids, d_perm, d_runs, d_counts, n, B, D,
                          {0, n}, d_drows, d_dw, d_ps, st));
  CK(flowtt::rows_bwd(t, d_g1, d_g2, d_g3, d_drows, d_uids, d_goffs, d_counts, n, d_dg1, d_dg2,
                      d_dg3, d_bs, st));
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());
  auto rows = from_dev(d_rows, (size_t)n * D);
  auto out = from_dev(d_out, (size_t)B * D);
  auto drows = from_dev(d_drows, (size_t)n * D);
  auto dw = from_dev(d_dw, n);
  auto dg1 = from_dev(d_dg1, g1.size());
  auto dg2 = from_dev(d_dg2, g2.size());
  auto dg3 = from_dev(d_dg3, g3.size());
  // second backward, bitwise
  poison(d_dg1, g1.size());
  poison(d_dg2, g2.size());
  poison(d_dg3, g3.size());
  CK(flowtt::rows_bwd(t, d_g1, d_g2, d_g3, d_drows, d_uids, d_goffs, d_counts, n, d_dg1, d_dg2,
                      d_dg3, d_bs, st));
  CK(cudaStreamSynchronize(st));
  bool bitwise = from_dev(d_dg1, g1.size()) == dg1 && from_dev(d_dg2, g2.size()) == dg2 &&
                 from_dev(d_dg3, g3.size()) == dg3;
  // FNV-1a of the bits: builds that must agree bit for bit (tuning variants) print the same
  auto fnv = [](const std::vector<float>& v) {
    uint64_t h = 1469598103934665603ull;
    for (float x : v) {
      uint32_t b;
      std::memcpy(&b, &x, 4);
      h = (h ^ b) * 1099511628211ull;
    }
    return (unsigned long long)h;
  };
  printf("BITS [%s] rows %016llx out %016llx drows %016llx dg1 %016llx dg2 %016llx dg3 %016llx\n",
         c.name.c_str(), fnv(rows), fnv(out), fnv(drows), fnv(dg1), fnv(dg2), fnv(dg3));

  int fails = 0;
  if (!kAllStages) {
    printf("[%s] profiling build (FLOWTT_STAGE_MASK %d): no checks\n", c.name.c_str(),
           FLOWTT_STAGE_MASK);
  } else if (c.check) {
    const int M = t.q1 * t.q2, R1 = t.r1, R2 = t.r2, Q1 = t.q1, Q2 = t.q2, Q3 = t.q3;
    std::vector<double> rref((size_t)n * D, 0.0);
    std::vector<double> dg1r(g1.size(), 0), dg2r(g2.size(), 0), dg3r(g3.size(), 0);
    std::vector<double> P((size_t)M * R2), T((size_t)M * R2);
    for (int u = 0; u < p.U; ++u) {
      long long id = p.unique_ids[u];
      const int i3 = id % t.p3, i2 = (id / t.p3) % t.p2, i1 = id / ((long long)t.p2 * t.p3);
      const float* G1 = &g1[(size_t)i1 * Q1 * R1];
      const float* G2 = &g2[(size_t)i2 * R1 * Q2 * R2];
      const float* G3 = &g3[(size_t)i3 * R2 * Q3];
      for (int q1 = 0; q1 < Q1; ++q1)
        for (int q2 = 0; q2 < Q2; ++q2)
          for (int b = 0; b < R2; ++b) {
            double s = 0;
            for (int a = 0; a < R1; ++a) s += (double)G1[q1 * R1 + a] * G2[(a * Q2 + q2) * R2 + b];
            P[(q1 * Q2 + q2) * R2 + b] = s;
          }
      const float* dr = &drows[(size_t)u * D];
      for (int m = 0; m < M; ++m)
        for (int q = 0; q < Q3; ++q) {
          double s = 0;
          for (int b = 0; b < R2; ++b) s += P[m * R2 + b] * G3[b * Q3 + q];
          rref[(size_t)u * D + m * Q3 + q] = s;
        }
      for (int m = 0; m < M; ++m)
        for (int b = 0; b < R2; ++b) {
          double s = 0;
          for (int q = 0; q < Q3; ++q) s += (double)dr[m * Q3 + q] * G3[b * Q3 + q];
          T[m * R2 + b] = s;
        }
      for (int b = 0; b < R2; ++b)
        for (int q = 0; q < Q3; ++q) {
          double s = 0;
          for (int m = 0; m < M; ++m) s += P[m * R2 + b] * dr[m * Q3 + q];
          dg3r[(size_t)i3 * R2 * Q3 + b * Q3 + q] += s;
        }
      for (int q1 = 0; q1 < Q1; ++q1)
        for (int a = 0; a < R1; ++a) {
          double s = 0;
          for (int q2 = 0; q2 < Q2; ++q2)
            for (int b = 0; b < R2; ++b)
              s += T[(q1 * Q2 + q2) * R2 + b] * G2[(a * Q2 + q2) * R2 + b];
          dg1r[(size_t)i1 * Q1 * R1 + q1 * R1 + a] += s;
        }
      for (int a = 0; a < R1; ++a)
        for (int q2 = 0; q2 < Q2; ++q2)
          for (int b = 0; b < R2; ++b) {
            double s = 0;
            for (int q1 = 0; q1 < Q1; ++q1)
              s += (double)G1[q1 * R1 + a] * T[(q1 * Q2 + q2) * R2 + b];
            dg2r[(size_t)i2 * R1 * Q2 * R2 + (a * Q2 + q2) * R2 + b] += s;
          }
    }
    std::vector<double> oref((size_t)B * D, 0), drref((size_t)n * D, 0), dwref(n, 0);
    for (int b = 0; b < B; ++b)
      for (int k = c.bag_offsets[b]; k < c.bag_offsets[b + 1]; ++k)
        for (int e = 0; e < D; ++e)
          oref[(size_t)b * D + e] += (double)w[k] * rows[(size_t)p.inverse[k] * D + e];
    for (int k = 0; k < n; ++k) {
      const int u = p.inverse[k], b = bag_ids[k];
      double s = 0;
      for (int e = 0; e < D; ++e) {
        drref[(size_t)u * D + e] += (double)w[k] * dout[(size_t)b * D + e];
        s += (double)dout[(size_t)b * D + e] * rows[(size_t)u * D + e];
      }
      dwref[k] = s;
    }
    bool nan = false;
    // rows / d_rows past num_unique are unspecified by the contract
    const double e_rows = rel_err(rows, rref, &nan, (size_t)p.U * D);
    const double e_out = rel_err(out, oref, &nan);
    const double e_dr = rel_err(drows, drref, &nan, (size_t)p.U * D);
    const double e_dw = rel_err(dw, dwref, &nan);
    const double e1 = rel_err(dg1, dg1r, &nan), e2 = rel_err(dg2, dg2r, &nan),
                 e3 = rel_err(dg3, dg3r, &nan);
    // fused forward: one chunk (bitwise = pool_fwd(rows_fwd)) and small chunks
    double e_bag = 0;
    bool bag_bitwise = true;
    for (long long chunk : {(long long)n, 64LL, 100LL, 1000LL}) {
      const size_t bfs = flowtt::bag_fwd_scratch_bytes(t, n, chunk);
      void* d_bfs;
      CK(cudaMalloc(&d_bfs, bfs));
      CK(cudaMemset(d_bfs, 0xFF, bfs));  // NaN rows buffer: unwritten rows would show
      poison(d_out, (size_t)B * D);
      CK(flowtt::bag_fwd(t, d_g1, d_g2, d_g3, d_uids, d_goffs, d_counts, d_inv, d_w, d_bags, n, B,
                         chunk, d_out, d_bfs, st));
      CK(cudaStreamSynchronize(st));
      auto bag = from_dev(d_out, (size_t)B * D);
      if (chunk == n) bag_bitwise = bag == out;
      e_bag = std::max(e_bag, rel_err(bag, oref, &nan));
      cudaFree(d_bfs);
    }
    const double worst = std::max({e_rows, e_out, e_dr, e_dw, e1, e2, e3, e_bag});
    const bool ok = !nan && worst <= 1e-5 && bitwise && bag_bitwise;
    printf(
        "[%s] n=%d U=%d G=%d B=%d D=%d r=%d,%d | rows %.2e out %.2e drows %.2e dw %.2e "
        "dg1 %.2e dg2 %.2e dg3 %.2e bag_fwd %.2e | nan=%d bitwise=%d bag_bitwise=%d -> %s\n",
        c.name.c_str(), n, p.U, p.G, B, D, t.r1, t.r2, e_rows, e_out, e_dr, e_dw, e1, e2, e3, e_bag,
        (int)nan, (int)bitwise, (int)bag_bitwise, ok ? "PASS" : "FAIL");
    fails += ok ? 0 : 1;
  } else {
    printf("[%s] n=%d U=%d G=%d B=%d (no host check) bitwise=%d\n", c.name.c_str(), n, p.U, p.G, B,
           (int)bitwise);
    fails += bitwise ? 0 : 1;
  }

  if (timing) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    auto time_it = [&](auto fn) {
      for (int i = 0; i < 5; ++i) fn();
      std::vector<float> ts;
      for (int r = 0; r < 50; ++r) {
        CK(cudaEventRecord(e0, st));
        fn();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        ts.push_back(ms);
      }
      return median(ts);
    };
    float t_rows = time_it([&] {
      flowtt::rows_fwd(t, d_g1, d_g2, d_g3, d_uids, d_goffs, d_counts, n, d_rows, d_fs, st);
    });
    float t_pool =
        time_it([&] { flowtt::bag_pool_fwd(d_rows, d_inv, d_w, d_bags, n, B, D, 0, {0, n}, nullptr, nullptr, d_out, st); });
    const long long chunk =  // flowtt_jax.ops.bag_chunk_rows(D, B)
        std::max({64LL, (40LL << 20) / (4 * D), 8LL * B});
    const size_t bfs = flowtt::bag_fwd_scratch_bytes(t, n, chunk);
    void* d_bfs;
    CK(cudaMalloc(&d_bfs, bfs));
    float t_bag = time_it([&] {
      flowtt::bag_fwd(t, d_g1, d_g2, d_g3, d_uids, d_goffs, d_counts, d_inv, d_w, d_bags, n, B,
                      chunk, d_out, d_bfs, st);
    });
    cudaFree(d_bfs);
    float t_pbwd = time_it([&] {
      flowtt::bag_pool_bwd(d_dout, d_rows, d_w, d_inv, d_bagids, d_perm, d_runs, d_counts, n, B, D,
                           {0, n}, d_drows, d_dw, d_ps, st);
    });
    float t_rbwd = time_it([&] {
      flowtt::rows_bwd(t, d_g1, d_g2, d_g3, d_drows, d_uids, d_goffs, d_counts, n, d_dg1, d_dg2,
                       d_dg3, d_bs, st);
    });
    if (!kAllStages)
      printf("STAGES [%s] FLOWTT_STAGE_MASK %d: rows_bwd %.4f ms\n", c.name.c_str(),
             FLOWTT_STAGE_MASK, t_rbwd);
    const int M = t.q1 * t.q2;
    const double flops = 2.0 * p.G * M * t.r2 * t.r1 + 2.0 * p.U * D * t.r2;
    printf("TIMING [%s] bag_fwd (fused, chunk %lld) %.4f ms, scratch %.1f MB\n", c.name.c_str(),
           chunk, t_bag, bfs / 1e6);
    printf(
        "TIMING [%s] rows_fwd %.4f ms  pool_fwd %.4f ms  fwd_total %.4f ms | pool_bwd %.4f ms"
        "  rows_bwd %.4f ms  fwd+bwd %.4f ms | fwd FLOP %.3g (%.1f%% of 60 TFLOP/s fp32 in "
        "rows_fwd) | scratch fwd %.1f MB bwd %.1f MB\n",
        c.name.c_str(), t_rows, t_pool, t_rows + t_pool, t_pbwd, t_rbwd,
        t_rows + t_pool + t_pbwd + t_rbwd, flops, 100.0 * flops / (t_rows * 1e-3) / 60e12, fs / 1e6,
        bs / 1e6);
  }
  cudaFree(d_g1);
  cudaFree(d_g2);
  cudaFree(d_g3);
  cudaFree(d_w);
  cudaFree(d_dout);
  cudaFree(d_uids);
  cudaFree(d_goffs);
  cudaFree(d_counts);
  cudaFree(d_inv);
  cudaFree(d_perm);
  cudaFree(d_runs);
  cudaFree(d_bags);
  cudaFree(d_bagids);
  cudaFree(d_rows);
  cudaFree(d_out);
  cudaFree(d_drows);
  cudaFree(d_dw);
  cudaFree(d_dg1);
  cudaFree(d_dg2);
  cudaFree(d_dg3);
  cudaFree(d_fs);
  cudaFree(d_bs);
  cudaFree(d_ps);
  cudaStreamDestroy(st);
  return fails;
}

#include "sanitize.cuh"  // --sanitize

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--sanitize")
    return sanitize::run(argc > 2 ? std::string(argv[2]) : std::string());
  bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  const bool s1time = argc > 1 && std::string(argv[1]) == "--s1-timing";
  const bool s1only = s1time || (argc > 1 && std::string(argv[1]) == "--s1");
  const std::string only =
      argc > 2 && std::string(argv[1]) == "--only" ? std::string(argv[2]) : std::string();
  std::mt19937_64 rng(12345);
  auto run = [&](const Case& c, bool timing) {  // run_case, unless --only leaves c out
    return !only.empty() && c.name.find(only) == std::string::npos ? 0 : run_case(c, rng, timing);
  };
  int fails = 0;
  auto mk = [](int p1, int p2, int p3, int q1, int q2, int q3, int r) {
    return TTDims{p1, p2, p3, q1, q2, q3, r, r};
  };
  std::vector<Case> cases;
  {  // small uniform with empty bags, D=16 r=8
    Case c{"uniform_D16_r8", mk(10, 10, 10, 2, 2, 4, 8), 1000};
    c.bag_offsets = bags_uniform(rng, 64, 0, 6);
    c.ids = uniform_ids(rng, 0, 999, c.bag_offsets.back());
    cases.push_back(c);
  }
  {  // zipf 1.2 unscattered (hot prefix groups of up to p3 = 50 unique ids), D=32 r=32
    Case c{"zipf1.2_hot_D32_r32", mk(40, 50, 50, 2, 4, 4, 32), 100000};
    c.bag_offsets = bags_uniform(rng, 2000, 1, 27);
    c.ids = zipf_ids(rng, c.N, 1.2, c.bag_offsets.back(), false);
    cases.push_back(c);
  }
  {  // zipf 1.05 unscattered, D=64 r=16
    Case c{"zipf1.05_D64_r16", mk(40, 50, 50, 4, 4, 4, 16), 100000};
    c.bag_offsets = bags_uniform(rng, 1000, 0, 27);
    c.ids = zipf_ids(rng, c.N, 1.05, c.bag_offsets.back(), false);
    cases.push_back(c);
  }
  {  // all-equal ids (last row), D=128 r=64
    Case c{"all_equal_last_D128_r64", mk(20, 20, 25, 4, 4, 8, 64), 10000};
    c.bag_offsets = bags_uniform(rng, 50, 0, 20);
    c.ids.assign(c.bag_offsets.back(), 9999);
    cases.push_back(c);
  }
  {  // single id
    Case c{"single_id_D32_r16", mk(20, 20, 25, 2, 4, 4, 16), 10000};
    c.bag_offsets = {0, 1};
    c.ids = {1234};
    cases.push_back(c);
  }
  {  // N < prod(P): ids near the last row, D=128 r=64 uniform
    Case c{"uniform_lastrows_D128_r64", mk(30, 30, 40, 4, 4, 8, 64), 35000};
    c.bag_offsets = bags_uniform(rng, 500, 0, 27);
    c.ids = uniform_ids(rng, 34000, 34999, c.bag_offsets.back());
    cases.push_back(c);
  }
  if (!s1only)
    for (auto& c : cases) fails += run(c, false);
  if (!quick) {
    // S1: N=1e7, P=200x200x250, D=32 (2x4x4), r=32, 32768 bags len U[1,27], zipf 1.05 scattered
    {
      Case c{"S1_D32_r32_B32768_zipf1.05", mk(200, 200, 250, 2, 4, 4, 32), 10000000};
      c.bag_offsets = bags_uniform(rng, 32768, 1, 27);
      c.ids = zipf_ids(rng, c.N, 1.05, c.bag_offsets.back(), true);
      fails += run(c, !s1only || s1time);
    }
    if (s1only) return fails;
    for (int B : {4096, 65536}) {
      Case c{"D128_r64_B" + std::to_string(B) + "_zipf1.05", mk(200, 200, 250, 4, 4, 8, 64),
             10000000};
      c.bag_offsets = bags_uniform(rng, B, 1, 27);
      c.ids = zipf_ids(rng, c.N, 1.05, c.bag_offsets.back(), true);
      c.check = (B == 4096);
      fails += run(c, true);
    }
    {
      Case c{"S1_uniform", mk(200, 200, 250, 2, 4, 4, 32), 10000000};
      c.bag_offsets = bags_uniform(rng, 32768, 1, 27);
      c.ids = uniform_ids(rng, 0, 9999999, c.bag_offsets.back());
      c.check = false;
      fails += run(c, true);
    }
  }
  printf("HARNESS %s (%d failing cases)\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
