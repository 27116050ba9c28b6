// Standalone check and timing of the table-batched rows kernels (cuda/include/tb_rows.h), no
// JAX, no XLA. Build (repository root; sm_90, never native):
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icuda -Itests/native cuda/harness/tb_rows_harness.cu \
//        cuda/batched/tb_rows.cu -o tb_rows_harness
// Run: ./tb_rows_harness [--no-meta] [--meta-only] [--meta-check] [--meta-hashed] [--reps N]
//   1. the standard cases of tests/native/tb_testing.h (several tables of different row shapes,
//      hot prefixes, ids at each table's last row, tables sharing g2 rows, one group
//      holding every id, n = 1, no unique ids): outputs poisoned with NaN, plan padding
//      and d_rows past num_unique poisoned, rows and gradients against the float64 oracle
//      (relative L2), the backward run twice and compared bit for bit;
//   2. invalid plans (indices outside their cores, bad counts, garbage offsets): the ops
//      must finish without a CUDA error (run under compute-sanitizer to prove no
//      out-of-bounds access);
//   3. a Meta-like group (240 tables, D = 32, q = (2,4,4), r = 32, n = 4096*240*13.6
//      ids; generator below): rows checked on a sample (all gradients too with
//      --meta-check, float64 on the host, slow), the backward twice bitwise, and
//      device-side timing (CUDA events, median of --reps) of the forward, the backward
//      and its stages; --meta-hashed: the benchmark's ids (hashed ranks, sparse groups).
// Prints PASS/FAIL lines; exit status 1 on any failure.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "include/tb_rows.h"
#include "tb_testing.h"

using namespace flowtt::tb;
using namespace flowtt::tb::testing;

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__);                                                            \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

namespace {

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t count = 0;
  explicit Dev(size_t c) : count(c) { CK(cudaMalloc(&p, std::max<size_t>(c, 1) * sizeof(T))); }
  explicit Dev(const std::vector<T>& v) : Dev(v.size()) {
    CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> get(size_t c) const {
    std::vector<T> v(c);
    CK(cudaMemcpy(v.data(), p, c * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  void poison() { CK(cudaMemset(p, 0xFF, count * sizeof(T))); }  // NaN for floats
};

// d_rows [n, D] on the device: uniform in [-1, 1) from a hash below num_unique, NaN past it.
__device__ __host__ inline float HashUniform(uint64_t i, uint64_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)((z >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

__global__ void FillDRows(float* x, size_t count, size_t valid, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = i < valid ? HashUniform(i, seed) : __int_as_float(0x7fc00000);
}

TbDims Dims(const TbShape& s) {
  return {(int)s.p1, (int)s.p2, (int)s.p3, (int)s.q1, (int)s.q2, (int)s.q3, (int)s.r1, (int)s.r2};
}

// Device copies of one case's cores and plan, outputs and scratch.
struct GpuCase {
  TbDims t;
  int n;
  Dev<float> g1, g2, g3, d_rows, rows, dg1, dg2, dg3;
  Dev<int> u_i3, g_i1, g_i2, goffs, counts;
  Dev<char> scratch;
  GpuCase(const TbCase& c, const TbHostPlan& p, const TbCores& k)
      : t(Dims(c.s)),
        n((int)p.n),
        g1(k.g1),
        g2(k.g2),
        g3(k.g3),
        d_rows((size_t)p.n * c.s.dim()),
        rows((size_t)p.n * c.s.dim()),
        dg1(k.g1.size()),
        dg2(k.g2.size()),
        dg3(k.g3.size()),
        u_i3(p.u_i3),
        g_i1(p.g_i1),
        g_i2(p.g_i2),
        goffs(p.group_offsets),
        counts(p.counts),
        scratch(std::max(tb_rows_fwd_scratch_bytes(t, n), tb_rows_bwd_scratch_bytes(t, n))) {
    FillDRows<<<1024, 256>>>(d_rows.p, d_rows.count, (size_t)p.U * c.s.dim(), 23);
    CK(cudaGetLastError());
  }
  cudaError_t fwd(bool tiles = true, bool fixed = true) {
    return tb_rows_fwd(t, g1.p, g2.p, g3.p, u_i3.p, g_i1.p, g_i2.p, goffs.p, counts.p, n, rows.p,
                       scratch.p, 0, tiles, fixed);
  }
  cudaError_t bwd(unsigned stages = kTbAllStages, bool fixed = true) {
    return tb_rows_bwd(t, g1.p, g2.p, g3.p, d_rows.p, u_i3.p, g_i1.p, g_i2.p, goffs.p, counts.p, n,
                       dg1.p, dg2.p, dg3.p, scratch.p, 0, stages, fixed);
  }
};

std::string Tag(const TbCase& c, const TbHostPlan& p) {
  return c.name + " (n=" + std::to_string(p.n) + " U=" + std::to_string(p.U) +
         " G=" + std::to_string(p.G) + ")";
}

// Forward on the GPU (rows poisoned first; the default path, or the chunked kernel when
// !tiles) vs the oracle, over all unique rows or over `sample` random ones.
void CheckForward(const TbCase& c, const TbHostPlan& p, const TbCores& k, GpuCase& g, int sample,
                  bool tiles) {
  const int64_t D = c.s.dim();
  g.rows.poison();
  CK(g.fwd(tiles));
  CK(cudaDeviceSynchronize());
  const std::vector<float> rows = g.rows.get((size_t)p.U * D);
  double err;
  if (sample <= 0 || sample >= p.U) {
    const std::vector<double> ref = TbRefRows(c, p, k);
    err = TbRelErr(rows.data(), ref.data(), ref.size());
  } else {  // the oracle on a sub-plan of `sample` unique rows
    std::mt19937_64 rng(3);
    TbHostPlan sub = p;
    std::vector<float> got;
    sub.U = sample;
    for (int i = 0; i < sample; ++i) {
      const int64_t u = (int64_t)(rng() % p.U);
      sub.ut[i] = p.ut[u];
      sub.uid[i] = p.uid[u];
      got.insert(got.end(), rows.begin() + u * D, rows.begin() + (u + 1) * D);
    }
    const std::vector<double> ref = TbRefRows(c, sub, k);
    err = TbRelErr(got.data(), ref.data(), ref.size());
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, " fwd%s rel err %.2e%s", tiles ? "" : " (chunked kernel)", err,
                sample > 0 ? " (sampled)" : "");
  TbReport(err < kTbTol, Tag(c, p) + buf);
}

// Backward twice (outputs poisoned before each run): bitwise equal; against the oracle
// when `check`.
void CheckBackward(const TbCase& c, const TbHostPlan& p, const TbCores& k, GpuCase& g, bool check) {
  std::vector<float> out[2][3];
  for (int run = 0; run < 2; ++run) {
    g.dg1.poison();
    g.dg2.poison();
    g.dg3.poison();
    CK(g.bwd());
    CK(cudaDeviceSynchronize());
    out[run][0] = g.dg1.get(g.dg1.count);
    out[run][1] = g.dg2.get(g.dg2.count);
    out[run][2] = g.dg3.get(g.dg3.count);
  }
  bool same = true;
  for (int i = 0; i < 3; ++i)
    same &= std::memcmp(out[0][i].data(), out[1][i].data(), out[0][i].size() * 4) == 0;
  char buf[160];
  if (!check) {
    bool finite = true;
    for (int i = 0; i < 3; ++i)
      for (float v : out[0][i]) finite &= std::isfinite(v);
    std::snprintf(buf, sizeof buf, " bwd all written and finite: %s, two runs bitwise equal: %s",
                  finite ? "yes" : "no", same ? "yes" : "no");
    TbReport(finite && same, Tag(c, p) + buf);
    return;
  }
  const std::vector<float> dr = g.d_rows.get((size_t)p.U * c.s.dim());
  std::vector<double> r1, r2, r3;
  TbRefGrads(c, p, k, dr, &r1, &r2, &r3);
  const double e1 = TbRelErr(out[0][0].data(), r1.data(), r1.size());
  const double e2 = TbRelErr(out[0][1].data(), r2.data(), r2.size());
  const double e3 = TbRelErr(out[0][2].data(), r3.data(), r3.size());
  std::snprintf(buf, sizeof buf,
                " bwd rel err dg1 %.2e dg2 %.2e dg3 %.2e, two runs bitwise equal: %s", e1, e2, e3,
                same ? "yes" : "no");
  TbReport(e1 < kTbTol && e2 < kTbTol && e3 < kTbTol && same, Tag(c, p) + buf);
}

// Dims with compile-time instances (tb_has_fixed_dims): the forward (both kernels) and
// the backward of those instances bitwise equal to the run-time dims instances'.
void CheckFixedDims(const TbCase& c, const TbHostPlan& p, GpuCase& g) {
  if (!tb_has_fixed_dims(g.t)) return;
  auto run = [&](bool fixed) {
    std::vector<std::vector<float>> out;
    for (bool tiles : {true, false}) {
      g.rows.poison();
      CK(g.fwd(tiles, fixed));
      CK(cudaDeviceSynchronize());
      out.push_back(g.rows.get((size_t)p.U * c.s.dim()));
    }
    g.dg1.poison();
    g.dg2.poison();
    g.dg3.poison();
    CK(g.bwd(kTbAllStages, fixed));
    CK(cudaDeviceSynchronize());
    out.push_back(g.dg1.get(g.dg1.count));
    out.push_back(g.dg2.get(g.dg2.count));
    out.push_back(g.dg3.get(g.dg3.count));
    return out;
  };
  const auto a = run(true), b = run(false);
  bool same = true;
  for (size_t i = 0; i < a.size(); ++i)
    same &= a[i].size() == b[i].size() &&
            std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) == 0;
  TbReport(same, Tag(c, p) +
                     " compile-time dims: rows (tile, chunked), dg1, dg2, dg3 bitwise "
                     "equal to the run-time dims kernels'");
}

void StandardCases() {
  std::vector<std::pair<TbCase, TbHostPlan>> runs;
  for (const TbCase& c : TbStandardCases()) runs.push_back({c, TbMakePlan(c, kTbPad)});
  runs.push_back(TbNoUniqueIdsCase(kTbPad));  // num_unique = 0
  for (auto& [c, p] : runs) {
    if (const char* why = tb_check_dims(Dims(c.s))) {
      TbReport(false, Tag(c, p) + ": " + why);
      continue;
    }
    const TbCores k = TbRandomCores(c.s, 11);
    GpuCase g(c, p, k);
    CheckForward(c, p, k, g, 0, true);
    CheckForward(c, p, k, g, 0, false);
    CheckBackward(c, p, k, g, true);
    CheckFixedDims(c, p, g);
  }
}

// Invalid plans: no CUDA error (and, under compute-sanitizer, no invalid access).
void InvalidPlans() {
  const TbCase c = TbStandardCases()[0];
  const TbCores k = TbRandomCores(c.s, 5);
  auto check = [&](const std::string& what, const TbHostPlan& p) {
    GpuCase g(c, p, k);
    cudaError_t e1 = g.fwd(), e2 = g.bwd();
    cudaError_t e3 = cudaDeviceSynchronize();
    TbReport(e1 == cudaSuccess && e2 == cudaSuccess && e3 == cudaSuccess,
             "invalid plan, no fault: " + what);
  };
  TbForEachInvalidPlan(TbMakePlan(c, kTbPad), kTbPad, check);
}

// Meta-like group: 240 tables, N log-uniform in 10^[4, 7.6], row shapes near-balanced
// (p3 = ceil(N^(1/3)), p2 = ceil(sqrt(N/p3)), p1 = ceil(N/(p2 p3))), 4096 * 13.6 ids per
// table: 93% Pareto ranks with alpha = 2 (id = rank - 1: hot ids share prefixes), 7%
// uniform. Gives n = 13.4M, about 1.0M unique rows and 0.6M groups. hashed: the
// benchmark's draw instead (benchmarks/workloads.py): bounded Zipf-like ranks (exponent
// 1.1) hashed over the table, id = rank * 2654435761 mod N (hot ids spread over prefixes,
// most groups of one or two ids): about 3M unique rows and 1.3M groups.
TbCase MetaCase(bool hashed) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> x(0, 1);
  std::vector<std::vector<int64_t>> shapes;
  for (int t = 0; t < 240; ++t) {
    const int64_t N = (int64_t)std::pow(10.0, 4.0 + 3.6 * x(rng));
    const int64_t p3 = (int64_t)std::ceil(std::cbrt((double)N));
    const int64_t p2 = (int64_t)std::ceil(std::sqrt((double)N / p3));
    const int64_t p1 = (N + p2 * p3 - 1) / (p2 * p3);
    shapes.push_back({N, p1, p2, p3});
  }
  TbCase c = TbStack("meta240_d32_r32", 2, 4, 4, 32, 32, shapes);
  for (int t = 0; t < 240; ++t) {
    const int64_t N = c.tables[t].N;
    for (int k = 0; k < 4096 * 136 / 10; ++k) {
      int64_t id;
      if (hashed) {  // bounded Pareto(a = 0.1) rank in [1, N], hashed
        const double a = 0.1,
                     r = std::pow(1.0 - x(rng) * (1.0 - std::pow((double)N, -a)), -1.0 / a);
        id = (int64_t)(((uint64_t)std::min<double>(r, (double)N) * 2654435761ull) % (uint64_t)N);
      } else {
        const double r = 1.0 / (1.0 - x(rng));  // Pareto(alpha = 2) rank >= 1
        id = std::min<int64_t>((int64_t)r - 1, N - 1);
        if (x(rng) < 0.07) id = std::min<int64_t>((int64_t)(x(rng) * N), N - 1);
      }
      TbAddId(&c, t, id);
    }
  }
  return c;
}

template <typename F>
double MedianMs(int reps, F&& launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(launch());  // warm-up
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    CK(launch());
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void Meta(bool full_check, bool hashed, int reps) {
  const auto t0 = std::chrono::steady_clock::now();
  const TbCase c = MetaCase(hashed);
  const TbHostPlan p = TbMakePlan(c, 0);
  const TbCores k = {TbRandom(c.s.p1 * 2 * 32, 1, 0.5f), TbRandom(c.s.p2 * 32 * 4 * 32, 2, 0.2f),
                     TbRandom(c.s.p3 * 32 * 4, 3, 0.2f)};
  GpuCase g(c, p, k);
  std::printf("meta: %s P = (%ld, %ld, %ld), host setup %.1f s\n", Tag(c, p).c_str(), (long)c.s.p1,
              (long)c.s.p2, (long)c.s.p3,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("meta: scratch fwd %zu B, bwd %.1f MB (n = %d)\n",
              tb_rows_fwd_scratch_bytes(g.t, g.n), tb_rows_bwd_scratch_bytes(g.t, g.n) / 1e6, g.n);
  CheckForward(c, p, k, g, full_check ? 0 : 4000, true);
  CheckForward(c, p, k, g, full_check ? 0 : 4000, false);
  CheckBackward(c, p, k, g, full_check);
  CheckFixedDims(c, p, g);
  const double fwd = MedianMs(reps, [&] { return g.fwd(); });
  const double fwd_chunked = MedianMs(reps, [&] { return g.fwd(false); });
  const double bwd = MedianMs(reps, [&] { return g.bwd(); });
  const double sorts = MedianMs(reps, [&] { return g.bwd(0); });
  const double b1 = MedianMs(reps, [&] { return g.bwd(1); });
  const double b2 = MedianMs(reps, [&] { return g.bwd(2); });
  const double b3 = MedianMs(reps, [&] { return g.bwd(4); });
  std::printf(
      "meta timing (median of %d, ms): fwd %.3f (chunked kernel %.3f)  bwd %.3f = "
      "sorts+bounds %.3f + dg1 %.3f + dg2 %.3f + dg3 %.3f\n",
      reps, fwd, fwd_chunked, bwd, sorts, b1 - sorts, b2 - sorts, b3 - sorts);
  if (tb_has_fixed_dims(g.t))
    std::printf("meta timing, run-time dims kernels (median of %d, ms): fwd %.3f  bwd %.3f\n", reps,
                MedianMs(reps, [&] { return g.fwd(true, false); }),
                MedianMs(reps, [&] { return g.bwd(kTbAllStages, false); }));
}

}  // namespace

int main(int argc, char** argv) {
  bool meta = true, standard = true, meta_check = false, hashed = false;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--no-meta")
      meta = false;
    else if (a == "--meta-only")
      standard = false;
    else if (a == "--meta-check")
      meta_check = true;
    else if (a == "--meta-hashed")
      hashed = true;
    else if (a == "--reps" && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(
          stderr, "usage: %s [--no-meta] [--meta-only] [--meta-check] [--meta-hashed] [--reps N]\n",
          argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  if (standard) {
    StandardCases();
    InvalidPlans();
  }
  if (meta) Meta(meta_check, hashed, reps);
  return TbExitStatus();
}
