// Table-batched rows kernels, backward (sm_90), docs/batched_contract.md, launched by
// cuda/batched/tb_rows.cu (and on the CPU by the emulation test tests/native/tb_rows_emu_test.cc).
// The kernels see packed core rows only (u_i3, g_i1, g_i2 from the plan), never tables: one launch
// per stage serves every table of a shape group.
//
// Backward (flowtt_tb_rows_bwd), in the contract's summation order, no float atomics:
//   ug[u] (the group of each unique index); the groups radix-sorted by g_i2
//   (cuda/batched/tb_sort.cuh: its cost follows num_groups, not n) and the bucket bounds of each
//   packed g2 row; the bounds of each g1 row over g_i1 (non-decreasing in g); the unique
//   indices radix-sorted by u_i3, the bounds of each g3 row and the group of each sorted
//   index (sg). Then, work stealing over packed rows (a row no group touches is written
//   0), every gradient row summed in a fixed order:
//   dg2[I] (dims with r1 and q2*r2 multiples of 16: on tensor cores instead,
//     cuda/batched/tb_dg2_mma_kernel.cuh): a block per g2 row over its groups (sorted by g_i2,
//     stable: ascending g), in
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
//   dg3[I]: the P cache and dg3 kernels, cuda/batched/tb_dg3_kernels.cuh.
#pragma once

#include "batched/tb_rows.cuh"

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
    if (with_e && lo < hi) tb_stage_g2_row(d, g2, I, ldg2, G2s);
    for (int j0 = lo; j0 < hi; j0 += nbatch) {
      const int nb = min(nbatch, hi - j0);
      __syncthreads();  // the previous batch's G1b / dPs are read
      tb_load_batch_groups(d, sorted_groups, goffs, g_i1, j0, nb, gmax, U, s_gs, s_ge, s_i1, s_g);
      __syncthreads();
      for (int e = tid; e < nb * d.Q1R1; e += kTbThreads) {
        const int k = e / d.Q1R1, r = e - k * d.Q1R1;
        G1b[k * ld1 + r] = __ldg(g1 + (size_t)s_i1[k] * d.Q1R1 + r);
      }
      tb_block_dP_staged(d, nb, s_gs, s_ge, s_pre, s_u, s_i3, Stg, stage_vec != 0, u_i3, g3, d_rows,
                         dPs, d.K, [&](int p0, int nr) {
                           TB_BY_Q3(d.q3, tb_stage_dP_round, d, nb, p0, nr, s_pre, Stg, d.K, dPs);
                         });
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

}  // namespace
}  // namespace flowtt::tb
