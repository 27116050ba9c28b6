// Table-batched rows kernels, backward (sm_90), docs/batched_contract.md, launched by
// cuda/tb_rows.cu (and on the CPU by the emulation test cuda/tb_rows_emu_test.cc). The
// kernels see packed core rows only (u_i3, g_i1, g_i2 from the plan), never tables: one
// launch per stage serves every table of a shape group.
//
// Backward (flowtt_tb_rows_bwd), in the contract's summation order, no float atomics:
//   ug[u] (the group of each unique index); the groups radix-sorted by g_i2
//   (cuda/tb_sort.cuh: its cost follows num_groups, not n) and the bucket bounds of each
//   packed g2 row; the bounds of each g1 row over g_i1 (non-decreasing in g); the unique
//   indices radix-sorted by u_i3, the bounds of each g3 row and the group of each sorted
//   index (sg). Then, work stealing over packed rows (a row no group touches is written
//   0), every gradient row summed in a fixed order:
//   dg2[I]: a block per g2 row over its groups (sorted by g_i2, stable: ascending g), in
//     batches of up to kTbBatch (tb_dg2_batch): dP_g (tb_block_dP_staged: the batch's
//     ids' d_rows and g3 rows staged in shared memory, a thread per element, u
//     ascending), then g1[g_i1]^T . dP_g added into the row kept in shared memory (4x4
//     tiles per thread); and, when every group fits the cache buffer (num_groups <=
//     e_cap), each group's dg1 term E[g] = dP_g . g2[I]^T from the g2 row staged once
//     (tb_dg1_terms_rows for q1 <= 2 and the vector path, one output per thread, else
//     tb_dg1_term, 8 threads per output and a shuffle tree: the same partials and tree,
//     the same bits);
//   dg1[I]: the sum of E[g] over the groups of I, ascending g (tb_dg1_reduce_kernel, a
//     thread per element; the groups of a g1 row are consecutive); past e_cap the merge
//     kernel tb_dg1_kernel instead (blocks of consecutive g1 rows, their group lists
//     merged by g_i2, dP_g and the same tb_dg1_term): the same terms in the same order,
//     so bitwise the same dg1;
//   dg3[I]: a warp per g3 row over its ids in ascending u, in chunks: each id's P (from
//     the P cache tb_pcache_kernel filled, in passes of `cap` groups when they do not all
//     fit; without a cache formed by the warp) and d_rows row staged in the warp's slice,
//     then P^T . d_rows[u] (a sum over m ascending) added per output element in u order.
#pragma once

#include "cuda/tb_rows.cuh"

namespace flowtt::tb {
namespace {  // internal linkage: one copy per including file

// ------------------------------- backward: sorts ------------------------------------

// ug[u] = the group of unique index u < num_unique.
__global__ void tb_ug_kernel(const int* __restrict__ goffs, const int* __restrict__ counts, int n,
                             int* __restrict__ ug) {
  int U, G;
  tb_counts(counts, n, U, G);
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < U; j += gridDim.x * blockDim.x)
    ug[j] = tb_find_group(goffs, G, j);
}

// bounds[k] = the first j in [0, c) with key(j) >= k, for k in [0, P] (c if none), over
// the c = num_groups (which == 1) or num_unique (which == 0) non-decreasing keys
// key(j) = key_src[order[j]] (order null: the identity) clamped into [0, P): position j
// writes the k in (key(j-1), key(j)], position c those in (key(c-1), P]. (g_i1 with the
// identity: non-decreasing for a valid plan; g_i2 / u_i3 through a sorted order.)
__global__ void tb_bounds_kernel(const int* __restrict__ order, const int* __restrict__ key_src,
                                 const int* __restrict__ counts, int which, int n, int P,
                                 int* __restrict__ bounds) {
  int U, G;
  tb_counts(counts, n, U, G);
  const int c = which ? G : U;
  auto key = [&](int j) { return tb_clamp(key_src[order != nullptr ? order[j] : j], 0, P - 1); };
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j <= c; j += gridDim.x * blockDim.x) {
    const int k0 = j == 0 ? -1 : key(j - 1);
    const int k1 = j == c ? P : key(j);
    for (int k = k0 + 1; k <= k1; ++k) bounds[k] = j;
  }
}

// ------------------------------- backward: dg1 --------------------------------------

// dg1[I] = sum over the groups g of I (bounds1), ascending, of dP_g . g2[g_i2[g]]^T.
// A block takes geo.R consecutive g1 rows and merges their group lists by g_i2 (warp 0
// keeps a head per row; a step is the smallest head key and the rows whose head has it):
// within a row g_i2 rises with g, so every row still receives its terms in ascending g,
// while each g2 row is loaded once per step for all the rows that use it. Per super-step
// (up to geo.S steps, geo.KMAX groups): the steps' g2 rows to shared memory, dP of every
// listed group (tb_block_dP), then the groups in list order: threads (a, kp), output
// column a = tid / 8 (+ 32 per pass), kp = tid % 8 splitting the K = q2*r2 terms (float4
// quads kp, kp+8, ...); the 8 partials of each (q1, a) combined by a fixed xor tree and
// added to the row's accumulator, owned by thread kp == 0 of column a (tb_dg1_term).
// The fallback of the dg1 terms path (tb_dg1_reduce_kernel): it returns at once when that
// path ran, i.e. when 0 <= num_groups <= e_cap.
template <int Q1C, int VEC, class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg1_kernel(DD d, TbDg1Geo geo, const float* __restrict__ g2, const float* __restrict__ g3,
                  const float* __restrict__ d_rows, const int* __restrict__ u_i3,
                  const int* __restrict__ g_i2, const int* __restrict__ goffs,
                  const int* __restrict__ counts, int n, const int* __restrict__ bounds1, int e_cap,
                  int* ctr, float* __restrict__ dg1) {
  constexpr int NQ1 = Q1C ? Q1C : kTbQ1Max;
  constexpr int KP = 8;
  constexpr int kNoKey = 0x7fffffff;
  TB_DYNAMIC_SMEM(tb_smem4);
  const int ld2 = tb_align4(d.R1K);
  float* G2s = reinterpret_cast<float*>(tb_smem4);  // [S][ld2]
  float* acc = G2s + geo.S * ld2;                   // [R][q1][r1]
  float* dPs = acc + tb_align4(geo.R * d.Q1R1);     // [KMAX][PSZ]
  __shared__ int s_item, s_cnt, s_steps;
  __shared__ int s_g[kTbDg1MaxList], s_row[kTbDg1MaxList], s_step[kTbDg1MaxList];
  __shared__ int s_gs[kTbDg1MaxList], s_ge[kTbDg1MaxList], s_i2[kTbDg1MaxSteps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, kp = tid % KP;
  int U, G;
  tb_counts(counts, n, U, G);
  if (G <= e_cap) return;
  for (;;) {
    const int blk = tb_claim(ctr, &s_item);
    if ((long long)blk * geo.R >= d.p1) break;
    const int I0 = blk * geo.R, nrows = min(geo.R, d.p1 - I0);
    if (kp == 0) {
      for (int a = tid / KP; a < d.r1; a += kTbThreads / KP)
        for (int r = 0; r < nrows; ++r)
          for (int x1 = 0; x1 < d.q1; ++x1) acc[(r * d.q1 + x1) * d.r1 + a] = 0.f;
    }
    int h = 0, e = 0;  // warp 0, lane r: the next and the end group of row I0 + r
    if (warp == 0 && lane < nrows) {
      h = tb_clamp(bounds1[I0 + lane], 0, G);
      e = tb_clamp(bounds1[I0 + lane + 1], h, G);
    }
    for (;;) {
      __syncthreads();  // the previous super-step is done
      if (warp == 0) {  // the next steps of the merge
        int cnt = 0, steps = 0;
        while (steps < geo.S) {
          const int key = h < e ? tb_clamp(__ldg(g_i2 + h), 0, d.p2 - 1) : kNoKey;
          const int m = __reduce_min_sync(0xffffffffu, key);
          if (m == kNoKey) break;
          const unsigned members = __ballot_sync(0xffffffffu, key == m);
          if (cnt + __popc(members) > geo.KMAX) break;
          if (key == m) {
            const int pos = cnt + __popc(members & ((1u << lane) - 1u));
            s_g[pos] = h;
            s_row[pos] = lane;
            s_step[pos] = steps;
            ++h;
          }
          if (lane == 0) s_i2[steps] = m;
          cnt += __popc(members);
          ++steps;
        }
        if (lane == 0) {
          s_cnt = cnt;
          s_steps = steps;
        }
      }
      __syncthreads();
      const int cnt = s_cnt;
      if (cnt == 0) break;
      for (int st = 0; st < s_steps; ++st) {
        const float* src = g2 + (size_t)s_i2[st] * d.R1K;
        float* dst = G2s + st * ld2;
        if (VEC == 4) {
          for (int i = tid; i < d.R1K / 4; i += kTbThreads)
            reinterpret_cast<float4*>(dst)[i] = __ldg(reinterpret_cast<const float4*>(src) + i);
        } else {
          for (int i = tid; i < d.R1K; i += kTbThreads) dst[i] = __ldg(src + i);
        }
      }
      if (tid < cnt) tb_group_range(goffs, s_g[tid], U, s_gs[tid], s_ge[tid]);
      __syncthreads();
      tb_block_dP(d, cnt, s_gs, s_ge, u_i3, g3, d_rows, dPs);
      __syncthreads();
      for (int k = 0; k < cnt; ++k) {
        float* acc_row = acc + s_row[k] * d.Q1R1;
        for (int pass = 0; pass * 32 < d.r1; ++pass) {
          const int a = pass * 32 + tid / KP;
          float part[NQ1];
          tb_dg1_term<Q1C, VEC>(d, dPs + k * d.PSZ, G2s + s_step[k] * ld2, a, kp, part);
          if (kp == 0 && a < d.r1)
#pragma unroll
            for (int x1 = 0; x1 < NQ1; ++x1)
              if (Q1C || x1 < d.q1) acc_row[x1 * d.r1 + a] += part[x1];
        }
      }
    }
    if (kp == 0) {
      for (int a = tid / KP; a < d.r1; a += kTbThreads / KP)
        for (int r = 0; r < nrows; ++r)
          for (int x1 = 0; x1 < d.q1; ++x1)
            dg1[((size_t)(I0 + r) * d.q1 + x1) * d.r1 + a] = acc[(r * d.q1 + x1) * d.r1 + a];
    }
  }
}

// ------------------------------- backward: dg2 --------------------------------------

// dst = src (0 where src is nullptr) over this thread's part of a [r1][K] row, as the dg2
// kernel's kTbThreads threads own it: VEC == 4, owned = (r1/4)*(K/4) 4x4 tiles, else
// owned = r1*K single elements.
template <int VEC>
__device__ __forceinline__ void tb_copy_owned(float* __restrict__ dst,
                                              const float* __restrict__ src, int K, int owned) {
  const int K4 = K / 4;
  for (int t = threadIdx.x; t < owned; t += kTbThreads) {
    if (VEC == 4) {
      const int a0 = 4 * (t / K4), c0 = 4 * (t % K4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int o = (a0 + i) * K + c0;
        *reinterpret_cast<float4*>(dst + o) =
            src ? *reinterpret_cast<const float4*>(src + o) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    } else {
      dst[t] = src ? src[t] : 0.f;
    }
  }
}

// The dg1 terms E[g_k] = dP_k . g2r^T ([q1][r1]) of a dg2 batch of nb <= kTbBatch groups,
// bitwise tb_dg1_term<Q1C, 4>'s: per output the 8 partials over the float4 quads kp, kp + 8,
// ... (kp = 0..7) combined as its xor tree does, ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3
// + p7)), but every output summed by one thread (no shuffles, each g2 quad loaded once for
// the thread's outputs): lane a (+ 32 per pass) of warp w owns the outputs (k, x1, a) of
// the groups k = w, w + kTbWarps. g2r: the g2 row [r1][ld] in shared memory (ld a multiple
// of 4; K + 4 when K % 8 == 0: the lanes' float4 reads at distinct banks); dPs [nb][PSZ].
template <int Q1C, class DD>
__device__ __forceinline__ void tb_dg1_terms_rows(const DD& d, int nb, const float* dPs,
                                                  const float* g2r, int ld, const int* s_g,
                                                  float* __restrict__ E) {
  constexpr int KP = 8, NG = kTbBatch / kTbWarps;
  static_assert(NG * kTbWarps == kTbBatch, "groups per warp");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, K4 = d.K / 4;
  for (int pass = 0; pass * 32 < d.r1; ++pass) {
    const int a = pass * 32 + lane;
    if (a >= d.r1) break;
    float part[NG][Q1C][KP];
#pragma unroll
    for (int i = 0; i < NG; ++i)
#pragma unroll
      for (int x1 = 0; x1 < Q1C; ++x1)
#pragma unroll
        for (int kp = 0; kp < KP; ++kp) part[i][x1][kp] = 0.f;
    const float4* gr = reinterpret_cast<const float4*>(g2r + a * ld);
    for (int q0 = 0; q0 < K4; q0 += KP) {
#pragma unroll
      for (int kp = 0; kp < KP; ++kp) {
        const int q = q0 + kp;
        if (q < K4) {
          const float4 gv = gr[q];
#pragma unroll
          for (int i = 0; i < NG; ++i) {
            const int k = warp + kTbWarps * i;
            if (k < nb) {
#pragma unroll
              for (int x1 = 0; x1 < Q1C; ++x1) {
                const float4 dv = reinterpret_cast<const float4*>(dPs + k * d.PSZ + x1 * d.K)[q];
                float t = fmaf(dv.x, gv.x, part[i][x1][kp]);
                t = fmaf(dv.y, gv.y, t);
                t = fmaf(dv.z, gv.z, t);
                part[i][x1][kp] = fmaf(dv.w, gv.w, t);
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < NG; ++i) {
      const int k = warp + kTbWarps * i;
      if (k < nb) {
#pragma unroll
        for (int x1 = 0; x1 < Q1C; ++x1) {
          const float* p = part[i][x1];
          E[(size_t)s_g[k] * d.Q1R1 + x1 * d.r1 + a] =
              ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
        }
      }
    }
  }
}

// dg2[I] = sum over the groups of I in ascending g (sorted_groups[bounds2[I] ..
// bounds2[I+1]), a stable sort by g_i2) of g1[g_i1[g]]^T . dP_g. The row [r1][K] is
// accumulated in shared memory, each element owned by one thread: VEC == 4 (r1 and K
// multiples of 4) 4x4 tiles (a0..a0+3, j0..j0+3) per thread, else single elements.
// Q1C: q1 when 1, 2, 4 or 8 (the dg1 terms' registers), else 0. With E (when 0 <= num_groups <=
// e_cap) the block also writes each group's dg1 term E[g] = dP_g . g2[I]^T ([q1][r1], the g2
// row I staged in shared memory once), summed per g1 row by tb_dg1_reduce_kernel: by
// tb_dg1_terms_rows when Q1C is 1 or 2, VEC == 4 and e_vec (g2 16-byte aligned), else by
// tb_dg1_term with VEC = e_vec ? 4 : 1 (the same bits as tb_dg1_terms_rows where both run).
template <int Q1C, int VEC, class DD>
__global__ void __launch_bounds__(kTbThreads, 3)
    tb_dg2_kernel(DD d, const float* __restrict__ g1, const float* __restrict__ g2,
                  const float* __restrict__ g3, const float* __restrict__ d_rows,
                  const int* __restrict__ u_i3, const int* __restrict__ g_i1,
                  const int* __restrict__ goffs, const int* __restrict__ counts, int n,
                  const int* __restrict__ bounds2, const int* __restrict__ sorted_groups, int e_vec,
                  int e_cap, int stage_vec, int nbatch, int* ctr, float* __restrict__ dg2,
                  float* __restrict__ E) {
  TB_DYNAMIC_SMEM(tb_smem4);
  const int ld1 = tb_align4(d.Q1R1);
  int U, G;
  tb_counts(counts, n, U, G);
  const bool with_e = E != nullptr && G <= e_cap;
  // the dg1 terms one per thread (tb_dg1_terms_rows) from the g2 row at row stride K + 4
  // (an odd number of float4s when K % 8 == 0: the lanes' reads at distinct banks), else by
  // tb_dg1_term (stride K)
  const bool e_rows = VEC == 4 && (Q1C == 1 || Q1C == 2) && e_vec;
  const int ldg2 = e_rows && d.K % 8 == 0 ? d.K + 4 : d.K;
  float* acc = reinterpret_cast<float*>(tb_smem4);        // [r1][K]
  float* G2s = acc + tb_align4(d.R1K);                    // [r1][ldg2] (with_e)
  float* G1b = G2s + (with_e ? tb_dg2_g2_floats(d) : 0);  // [nbatch][ld1]
  float* dPs = G1b + nbatch * ld1;                        // [nbatch][PSZ]
  float* Stg = dPs + nbatch * tb_align4(d.PSZ);           // tb_block_dP_staged's
  __shared__ int s_item, s_gs[kTbBatch], s_ge[kTbBatch], s_i1[kTbBatch], s_g[kTbBatch];
  __shared__ int s_pre[kTbBatch + 1], s_u[kTbStageMaxIds], s_i3[kTbStageMaxIds];
  const int tid = threadIdx.x;
  const int K4 = d.K / 4;
  const int owned = VEC == 4 ? (d.r1 / 4) * K4 : d.R1K;  // tiles or elements
  const int gmax = max(G - 1, 0);
  for (;;) {
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.p2) break;
    const int lo = tb_clamp(bounds2[I], 0, n), hi = tb_clamp(bounds2[I + 1], lo, n);
    tb_copy_owned<VEC>(acc, nullptr, d.K, owned);
    if (with_e && lo < hi)
      for (int i = tid; i < d.R1K; i += kTbThreads) {
        const int a = i / d.K;
        G2s[a * ldg2 + (i - a * d.K)] = __ldg(g2 + (size_t)I * d.R1K + i);
      }
    for (int j0 = lo; j0 < hi; j0 += nbatch) {
      const int nb = min(nbatch, hi - j0);
      __syncthreads();  // the previous batch's G1b / dPs are read
      if (tid < nb) {
        const int g = tb_clamp(__ldg(sorted_groups + j0 + tid), 0, gmax);
        tb_group_range(goffs, g, U, s_gs[tid], s_ge[tid]);
        s_i1[tid] = tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1);
        s_g[tid] = g;
      }
      __syncthreads();
      for (int e = tid; e < nb * d.Q1R1; e += kTbThreads) {
        const int k = e / d.Q1R1, r = e - k * d.Q1R1;
        G1b[k * ld1 + r] = __ldg(g1 + (size_t)s_i1[k] * d.Q1R1 + r);
      }
      tb_block_dP_staged(d, nb, s_gs, s_ge, s_pre, s_u, s_i3, Stg, stage_vec != 0, u_i3, g3, d_rows,
                         dPs);
      for (int t = tid; t < owned; t += kTbThreads) {
        if (VEC == 4) {
          const int a0 = 4 * (t / K4), c0 = 4 * (t % K4);
          float v[4][4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float4 x = *reinterpret_cast<const float4*>(acc + (a0 + i) * d.K + c0);
            v[i][0] = x.x;
            v[i][1] = x.y;
            v[i][2] = x.z;
            v[i][3] = x.w;
          }
          for (int k = 0; k < nb; ++k) {
            float term[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int c = 0; c < 4; ++c) term[i][c] = 0.f;
            for (int x1 = 0; x1 < d.q1; ++x1) {
              const float4 gv = *reinterpret_cast<const float4*>(G1b + k * ld1 + x1 * d.r1 + a0);
              const float4 pv = *reinterpret_cast<const float4*>(dPs + k * d.PSZ + x1 * d.K + c0);
              const float ga[4] = {gv.x, gv.y, gv.z, gv.w};
              const float pb[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
              for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int c = 0; c < 4; ++c) term[i][c] = fmaf(ga[i], pb[c], term[i][c]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int c = 0; c < 4; ++c) v[i][c] += term[i][c];
          }
#pragma unroll
          for (int i = 0; i < 4; ++i)
            *reinterpret_cast<float4*>(acc + (a0 + i) * d.K + c0) =
                make_float4(v[i][0], v[i][1], v[i][2], v[i][3]);
        } else {
          const int a = t / d.K, j = t - a * d.K;
          float v = acc[t];
          for (int k = 0; k < nb; ++k) {
            float term = 0.f;
            for (int x1 = 0; x1 < d.q1; ++x1)
              term = fmaf(G1b[k * ld1 + x1 * d.r1 + a], dPs[k * d.PSZ + x1 * d.K + j], term);
            v += term;
          }
          acc[t] = v;
        }
      }
      if (with_e && e_rows) {  // the batch's dg1 terms (dPs, G2s read-only until the next batch)
        if constexpr (VEC == 4 && (Q1C == 1 || Q1C == 2))
          tb_dg1_terms_rows<Q1C>(d, nb, dPs, G2s, ldg2, s_g, E);
      } else if (with_e) {
        for (int k = 0; k < nb; ++k) {
          for (int pass = 0; pass * 32 < d.r1; ++pass) {
            const int a = pass * 32 + tid / 8, kp = tid % 8;
            float part[Q1C ? Q1C : kTbQ1Max];
            if (e_vec)
              tb_dg1_term<Q1C, 4>(d, dPs + k * d.PSZ, G2s, a, kp, part);
            else
              tb_dg1_term<Q1C, 1>(d, dPs + k * d.PSZ, G2s, a, kp, part);
            if (kp == 0 && a < d.r1)
#pragma unroll
              for (int x1 = 0; x1 < (Q1C ? Q1C : kTbQ1Max); ++x1)
                if (Q1C || x1 < d.q1) E[(size_t)s_g[k] * d.Q1R1 + x1 * d.r1 + a] = part[x1];
          }
        }
      }
    }
    tb_copy_owned<VEC>(dg2 + (size_t)I * d.R1K, acc, d.K, owned);
  }
}

// ------------------------------- backward: the P cache -------------------------------

// Pc[g - glo] = P_g = g1[g_i1[g]] . g2[g_i2[g]] as [q1][K] (= [M][r2]) for the groups g in
// [glo, glo + cap) below num_groups (one pass of tb_rows_bwd's dg3 loop), so that dg3 reads
// P_g (PSZ floats) instead of forming it per block; returns at once when glo >= num_groups. Phase 1
// of tb_fwd_tile_kernel without the rows (geometry tb_tile_geo, smem tb_pcache_smem): blocks steal
// packed g2 rows I (ctr), the g2 row staged once for all its groups (sorted_groups[bounds2[I] ..
// bounds2[I+1])), batches of up to geo.GB of them (groups outside the pass dropped), P of a batch
// by one GEMM, stored straight from the registers (float4, r2 % 4 == 0). Every element is
// fmaf(g1[x1][a], g2[a][j], acc) over a ascending from 0, the chain of tb_warp_prefix: the stored P
// is bitwise the P that tb_dg3_kernel forms when it recomputes.
template <class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_pcache_kernel(DD d, TbTileGeo geo, const float* __restrict__ g1,
                     const float* __restrict__ g2, const int* __restrict__ g_i1,
                     const int* __restrict__ counts, int n, const int* __restrict__ bounds2,
                     const int* __restrict__ sorted_groups, int glo, int cap, int* ctr,
                     float* __restrict__ Pc) {
  TB_DYNAMIC_SMEM(tb_smem4);
  float* smem = reinterpret_cast<float*>(tb_smem4);
  float* G2s = smem;                   // [r1][K]
  float* As = G2s + tb_align4(d.R1K);  // [r1][ldA]
  __shared__ int s_item, s_nb;
  __shared__ int s_g[kTbTileGroups], s_i1[kTbTileGroups];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int U, G;
  tb_counts(counts, n, U, G);
  const int gmax = max(G - 1, 0);
  if (glo >= G) return;
  const int ghi = (int)min((long long)glo + cap, (long long)G);
  for (;;) {
    const int I = tb_claim(ctr, &s_item);
    if (I >= d.p2) break;
    const int lo = tb_clamp(bounds2[I], 0, n), hi = tb_clamp(bounds2[I + 1], lo, n);
    bool staged = false;
    for (int j0 = lo; j0 < hi; j0 += geo.GB) {
      const int nc = min(geo.GB, hi - j0);
      __syncthreads();  // the previous batch's As is read
      if (warp == 0) {  // the batch's cached groups, compacted
        int g = 0;
        bool keep = false;
        if (lane < nc) {
          g = tb_clamp(__ldg(sorted_groups + j0 + lane), 0, gmax);
          keep = g >= glo && g < ghi;
        }
        const unsigned kept = __ballot_sync(0xffffffffu, keep);
        if (keep) {
          const int pos = __popc(kept & ((1u << lane) - 1u));
          s_g[pos] = g;
          s_i1[pos] = tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1);
        }
        if (lane == 0) s_nb = __popc(kept);
      }
      __syncthreads();
      const int nb = s_nb;
      if (nb == 0) continue;
      if (!staged) {
        const float4* src = reinterpret_cast<const float4*>(g2 + (size_t)I * d.R1K);
        for (int i = tid; i < d.R1K / 4; i += kTbThreads)
          reinterpret_cast<float4*>(G2s)[i] = __ldg(src + i);
        staged = true;
      }
      tb_batch_P(d, g1, s_i1, nb, geo.ldA, As, G2s,
                 [&](int row0, int c4, int nR, const float (&acc)[kTbRPT][4]) {
#pragma unroll
                   for (int i = 0; i < kTbRPT; ++i) {
                     const int row = row0 + i;
                     if (row < nR) {
                       const int k = row / d.q1, x1 = row - k * d.q1;
                       *reinterpret_cast<float4*>(Pc + (size_t)(s_g[k] - glo) * d.PSZ + x1 * d.K +
                                                  4 * c4) =
                           make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
                     }
                   }
                 });
    }
  }
}

// ------------------------------- backward: dg1 from E ------------------------------

// dg1[I] = sum over the groups g of I (bounds1: g in [bounds1[I], bounds1[I+1]),
// consecutive since g_i1 is non-decreasing in g), ascending, of E[g] (the terms
// tb_dg2_kernel wrote): a thread per output element. The same terms in the same order as
// tb_dg1_kernel, so bitwise its result. Runs when 0 <= num_groups <= e_cap, else returns
// at once (tb_dg1_kernel does the work).
template <class DD>
__global__ void tb_dg1_reduce_kernel(DD d, const float* __restrict__ E, int e_cap,
                                     const int* __restrict__ counts, int n,
                                     const int* __restrict__ bounds1, float* __restrict__ dg1) {
  int U, G;
  tb_counts(counts, n, U, G);
  if (G > e_cap) return;
  const long long total = (long long)d.p1 * d.Q1R1;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const int I = (int)(i / d.Q1R1), e = (int)(i - (long long)I * d.Q1R1);
    const int lo = tb_clamp(bounds1[I], 0, G), hi = tb_clamp(bounds1[I + 1], lo, G);
    float acc = 0.f;
#pragma unroll 4
    for (int g = lo; g < hi; ++g) acc += __ldg(E + (size_t)g * d.Q1R1 + e);
    dg1[i] = acc;
  }
}

// ------------------------------- backward: dg3 --------------------------------------

// sg[h] = the group of the unique index sorted_u[h] (h < num_unique), for dg3.
__global__ void tb_sorted_groups_kernel(const int* __restrict__ sorted_u,
                                        const int* __restrict__ ug, const int* __restrict__ counts,
                                        int n, int* __restrict__ sg) {
  int U, G;
  tb_counts(counts, n, U, G);
  for (int h = blockIdx.x * blockDim.x + threadIdx.x; h < U; h += gridDim.x * blockDim.x)
    sg[h] = __ldg(ug + tb_clamp(__ldg(sorted_u + h), 0, n - 1));
}

// The first h in [lo, hi) with sg[h] >= key (hi if none), sg non-decreasing on [lo, hi)
// (one g3 row's groups: u ascending); every lane gets it. The warp probes 32 evenly spaced
// positions per step. Reads only inside [lo, hi) whatever sg holds.
__device__ __forceinline__ int tb_warp_lower_bound(const int* __restrict__ sg, int lo, int hi,
                                                   int key, int lane) {
  while (hi - lo > 32) {
    const int step = (hi - lo + 31) / 32, pos = lo + lane * step;
    const int c = __popc(__ballot_sync(0xffffffffu, pos < hi && __ldg(sg + pos) < key));
    if (c == 0) return lo;
    hi = min(hi, lo + c * step);
    lo += (c - 1) * step + 1;
  }
  const int pos = lo + lane;
  return lo + __popc(__ballot_sync(0xffffffffu, pos < hi && __ldg(sg + pos) < key));
}

// The terms of a chunk's nc staged ids (slots of `slot` floats: P [M][ldP] then the d_rows
// row at poff) in order, added to lane b's accumulators acc[i][z] (b = lane + 32 i): each
// term sum_m P[m][b] d[m][z] over m ascending. Q3C: q3 when 4 or 8 (float4 reads of the
// d_rows row), else 0 (any q3).
template <int Q3C, class DD>
__device__ __forceinline__ void tb_dg3_chunk_terms(const DD& d, const float* S, int slot, int poff,
                                                   int nc, int lane, float (&acc)[2][kTbQ3Max]) {
  constexpr int NZ = Q3C ? Q3C : kTbQ3Max;
  for (int k = 0; k < nc; ++k) {
    const float* P = S + k * slot;
    const float* dr = P + poff;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = lane + 32 * i;
      if (b >= d.r2) continue;
      float c[NZ];
#pragma unroll
      for (int z = 0; z < NZ; ++z) c[z] = 0.f;
      for (int m = 0; m < d.M; ++m) {
        const float p = P[m * d.ldP + b];
        if (Q3C > 0) {
#pragma unroll
          for (int z4 = 0; z4 < NZ; z4 += 4) {
            const float4 v = *reinterpret_cast<const float4*>(dr + m * Q3C + z4);
            c[z4] = fmaf(p, v.x, c[z4]);
            c[z4 + 1] = fmaf(p, v.y, c[z4 + 1]);
            c[z4 + 2] = fmaf(p, v.z, c[z4 + 2]);
            c[z4 + 3] = fmaf(p, v.w, c[z4 + 3]);
          }
        } else {
#pragma unroll
          for (int z = 0; z < NZ; ++z)
            if (z < d.q3) c[z] = fmaf(p, dr[m * d.q3 + z], c[z]);
        }
      }
#pragma unroll
      for (int z = 0; z < NZ; ++z)
        if (Q3C || z < d.q3) acc[i][z] += c[z];
    }
  }
}

// dg3[I] = sum over the unique indices u of I in ascending u (sorted_u[bounds3[I] ..
// bounds3[I+1]), a stable sort by u_i3) of P_{g(u)}^T . d_rows[u]. A warp per g3 row
// (work stealing by warps): the row's ids in chunks of tb_dg3_chunk(d), the next chunk's
// ids and groups (sg, tb_sorted_groups_kernel) read ahead; per chunk each id's d_rows row
// and P (from the P cache Pc, float4 loads in flight together; without a cache formed by
// the warp, tb_warp_prefix) are staged in the warp's slice; then the ids in order, lane b
// (and b + 32) owning the outputs (b, z): each term a sum over m ascending, added to the
// accumulator. With a cache (cap > 0) one launch is one pass of tb_rows_bwd's loop over
// the groups [glo, glo + cap), whose P the cache holds: a row's ids of those groups are a
// contiguous part of its list (u ascending, so g too: tb_warp_lower_bound finds it), the
// first pass (glo = 0) writes every row, a later one adds its part to the row it reads
// back (the same additions in the same order as one pass over the whole list); a later
// pass at glo >= num_groups returns at once. Without (cap == 0) one launch does every id.
template <int Q1C, int VEC, class DD>
__global__ void __launch_bounds__(kTbThreads)
    tb_dg3_kernel(DD d, const float* __restrict__ g1, const float* __restrict__ g2,
                  const float* __restrict__ d_rows, const int* __restrict__ g_i1,
                  const int* __restrict__ g_i2, const int* __restrict__ counts, int n,
                  const int* __restrict__ bounds3, const int* __restrict__ sorted_u,
                  const int* __restrict__ sg, const float* __restrict__ Pc, int glo, int cap,
                  int dvec, int* ctr, float* __restrict__ dg3) {
  TB_DYNAMIC_SMEM(tb_smem4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int CH = tb_dg3_chunk(d), slot = tb_dg3_slot(d), poff = tb_align4(d.M * d.ldP);
  float* G1s = reinterpret_cast<float*>(tb_smem4) + warp * tb_dg3_slice(d);
  float* S = G1s + tb_align4(d.Q1R1);  // [CH][slot]: P [M][ldP], then the d_rows row [D]
  __shared__ int s_u[kTbWarps][kTbDg3MaxChunk], s_g[kTbWarps][kTbDg3MaxChunk];
  int U, G;
  tb_counts(counts, n, U, G);
  const int gmax = max(G - 1, 0);
  // every id of the pass: P from Pc (tb_pcache_kernel); no groups (a bad plan): P formed
  const bool cached = cap > 0 && G > 0;
  if (glo > 0 && glo >= G) return;  // a pass past the groups (the first writes every row)
  const int ghi = cached ? (int)min((long long)glo + cap, (long long)G) : G;
  const bool split = glo > 0 || ghi < G;  // the pass takes part of the groups
  const int P4 = d.PSZ / 4;               // float4s of a cached P (r2 % 4 == 0 when cap > 0)
  for (;;) {
    const int I = tb_warp_claim(ctr, lane);
    if (I >= d.p3) break;
    int lo = tb_clamp(bounds3[I], 0, n), hi = tb_clamp(bounds3[I + 1], lo, n);
    if (split) {
      lo = tb_warp_lower_bound(sg, lo, hi, glo, lane);
      hi = tb_warp_lower_bound(sg, lo, hi, ghi, lane);
      if (glo > 0 && lo == hi) continue;  // no id of this pass: the row stays
    }
    float acc[2][kTbQ3Max];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = lane + 32 * i;
#pragma unroll
      for (int z = 0; z < kTbQ3Max; ++z)
        acc[i][z] = glo > 0 && b < d.r2 && z < d.q3 ? dg3[(size_t)I * d.S3 + b * d.q3 + z] : 0.f;
    }
    int un = 0, gn = 0;  // lane < CH: the next chunk's id and group
    if (lane < min(CH, hi - lo)) {
      un = __ldg(sorted_u + lo + lane);
      gn = __ldg(sg + lo + lane);
    }
    for (int h0 = lo; h0 < hi; h0 += CH) {
      const int nc = min(CH, hi - h0);
      if (lane < nc) {
        s_u[warp][lane] = tb_clamp(un, 0, n - 1);
        s_g[warp][lane] = tb_clamp(gn, 0, gmax);
      }
      if (lane < min(CH, hi - h0 - CH)) {
        un = __ldg(sorted_u + h0 + CH + lane);
        gn = __ldg(sg + h0 + CH + lane);
      }
      __syncwarp();
      // the cached P (float4 items [0, nc*P4)) and, when dvec, the d_rows rows (float4
      // items after them), eight loads in flight per lane
      const int nP = nc * P4, nI = nP + (dvec ? nc * (d.D / 4) : 0);
      for (int base = lane; base < nI; base += 8 * 32) {
        float4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int e4 = base + 32 * j;
          if (e4 < nP) {
            const int k = e4 / P4, slot_g = tb_clamp(s_g[warp][k] - glo, 0, cap - 1);
            if (cached)
              v[j] = __ldg(reinterpret_cast<const float4*>(Pc + (size_t)slot_g * d.PSZ) +
                           (e4 - k * P4));
          } else if (e4 < nI) {
            const int k = (e4 - nP) / (d.D / 4), q = e4 - nP - k * (d.D / 4);
            v[j] = __ldg(reinterpret_cast<const float4*>(d_rows + (size_t)s_u[warp][k] * d.D) + q);
          }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int e4 = base + 32 * j;
          if (e4 < nP) {
            const int k = e4 / P4, q = e4 - k * P4;
            if (cached) {
              const int m = (4 * q) / d.r2, b = 4 * q - m * d.r2;
              float* dst = S + k * slot + m * d.ldP + b;
              dst[0] = v[j].x;
              dst[1] = v[j].y;
              dst[2] = v[j].z;
              dst[3] = v[j].w;
            }
          } else if (e4 < nI) {
            const int k = (e4 - nP) / (d.D / 4), q = e4 - nP - k * (d.D / 4);
            *reinterpret_cast<float4*>(S + k * slot + poff + 4 * q) = v[j];
          }
        }
      }
      if (!dvec) {
        for (int e = lane; e < nc * d.D; e += 32) {  // the d_rows rows, one float at a time
          const int k = e / d.D, o = e - k * d.D;
          S[k * slot + poff + o] = __ldg(d_rows + (size_t)s_u[warp][k] * d.D + o);
        }
      }
      for (int k = 0; k < nc; ++k) {  // the P not cached, formed by the warp
        const int g = s_g[warp][k];
        if (cached) break;
        __syncwarp();
        tb_warp_load_g1(d, g1, tb_clamp(__ldg(g_i1 + g), 0, d.p1 - 1), G1s, lane);
        __syncwarp();
        tb_warp_prefix<Q1C, VEC>(d, G1s,
                                 g2 + (size_t)tb_clamp(__ldg(g_i2 + g), 0, d.p2 - 1) * d.R1K,
                                 S + k * slot, lane);
      }
      __syncwarp();
      TB_BY_Q3(d.q3, tb_dg3_chunk_terms, d, S, slot, poff, nc, lane, acc);
      __syncwarp();  // the chunk's slots are read
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = lane + 32 * i;
      if (b < d.r2)
#pragma unroll
        for (int z = 0; z < kTbQ3Max; ++z)
          if (z < d.q3) dg3[(size_t)I * d.S3 + b * d.q3 + z] = acc[i][z];
    }
  }
}

}  // namespace
}  // namespace flowtt::tb
