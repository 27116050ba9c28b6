// The op contract (docs/op_contract.md) on XLA FFI buffers, shared by the CPU
// (ffi/cpu/handlers.cc) and CUDA (ffi/cuda/handlers.cc) handlers: every argument check of
// every op (Check<Op>, on any ffi::Buffer type; the operand/result lists of the targets,
// Bind<Op>, are in ffi/binding/op_ffi.h). The platforms add only their own limits (the CUDA
// kernels' supported shapes) and the CPU's checks of the plan's contents.
#pragma once

#include <cstdint>
#include <string>

#include "contract/core_shape.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt {

namespace ffi = xla::ffi;

template <typename Buf>
ffi::Error ReadCoreShape(const Buf& g1, const Buf& g2, const Buf& g3, CoreShape* s) {
  auto a = g1.dimensions(), b = g2.dimensions(), c = g3.dimensions();
  if (a.size() != 4 || b.size() != 4 || c.size() != 4) {
    return ffi::Error::InvalidArgument("cores must be 4-D [p, r_in, q, r_out]");
  }
  if (a[1] != 1 || c[3] != 1 || a[3] != b[1] || b[3] != c[1]) {
    return ffi::Error::InvalidArgument("core ranks do not chain as (1, r1, r2, 1)");
  }
  *s = {a[0], b[0], c[0], a[2], b[2], c[2], a[3], b[3]};
  if (s->rows() >= (int64_t{1} << 31)) {
    return ffi::Error::InvalidArgument("prod(row_shape) exceeds int32 ids");
  }
  return ffi::Error::Success();
}

// n of a 1-D buffer, or -1 when it is not 1-D.
template <typename Buf>
int64_t Length(const Buf& x) {
  auto d = x.dimensions();
  return d.size() == 1 ? d[0] : -1;
}

// unique_ids [n], group_offsets [n+1], counts [2]; sets n.
template <typename Buf>
ffi::Error CheckGroupPlan(const Buf& unique_ids, const Buf& group_offsets, const Buf& counts,
                          int64_t* n) {
  *n = Length(unique_ids);
  if (*n < 1 || Length(group_offsets) != *n + 1 || Length(counts) != 2) {
    return ffi::Error::InvalidArgument(
        "plan arrays must be unique_ids [n], group_offsets [n+1], counts [2] with n >= 1");
  }
  return ffi::Error::Success();
}

template <typename Buf>
ffi::Error CheckMatrix(const Buf& x, int64_t rows, int64_t cols, const char* name) {
  auto d = x.dimensions();
  if (d.size() != 2 || d[0] != rows || d[1] != cols) {
    return ffi::Error::InvalidArgument(std::string(name) + " must be [" + std::to_string(rows) +
                                       ", " + std::to_string(cols) + "]");
  }
  return ffi::Error::Success();
}

// The pooling operands: inverse [n], weights [n], offsets [B+1] and the result out [B, dim]
// (n >= 1); sets num_bags = B.
template <typename FBuf, typename IBuf, typename OBuf>
ffi::Error CheckPooling(const IBuf& inverse, const FBuf& weights, const IBuf& offsets,
                        const OBuf& out, int64_t n, int64_t dim, int64_t* num_bags) {
  *num_bags = Length(offsets) - 1;
  if (n < 1 || Length(inverse) != n || Length(weights) != n || *num_bags < 0) {
    return ffi::Error::InvalidArgument(
        "need inverse [n], weights [n], offsets [B+1] (n = " + std::to_string(n) + ", n >= 1)");
  }
  return CheckMatrix(out, *num_bags, dim, "out");
}

// The core shape and the group plan of the rows ops; sets n.
template <typename FBuf, typename IBuf>
ffi::Error CheckCoresAndPlan(const FBuf& g1, const FBuf& g2, const FBuf& g3, const IBuf& unique_ids,
                             const IBuf& group_offsets, const IBuf& counts, CoreShape* s,
                             int64_t* n) {
  if (ffi::Error e = ReadCoreShape(g1, g2, g3, s); e.failure()) return e;
  return CheckGroupPlan(unique_ids, group_offsets, counts, n);
}

// flowtt_tt_rows_fwd: cores, group plan, rows [n, D]; sets the core shape and n.
template <typename FBuf, typename IBuf, typename OBuf>
ffi::Error CheckRowsFwd(const FBuf& g1, const FBuf& g2, const FBuf& g3, const IBuf& unique_ids,
                        const IBuf& group_offsets, const IBuf& counts, const OBuf& rows,
                        CoreShape* s, int64_t* n) {
  if (ffi::Error e = CheckCoresAndPlan(g1, g2, g3, unique_ids, group_offsets, counts, s, n);
      e.failure()) {
    return e;
  }
  return CheckMatrix(rows, *n, s->dim(), "rows");
}

// flowtt_tt_rows_bwd: cores, d_rows [n, D], group plan, core gradients of the cores'
// shapes; sets the core shape and n.
template <typename FBuf, typename IBuf, typename OBuf>
ffi::Error CheckRowsBwd(const FBuf& g1, const FBuf& g2, const FBuf& g3, const FBuf& d_rows,
                        const IBuf& unique_ids, const IBuf& group_offsets, const IBuf& counts,
                        const OBuf& dg1, const OBuf& dg2, const OBuf& dg3, CoreShape* s,
                        int64_t* n) {
  if (ffi::Error e = CheckCoresAndPlan(g1, g2, g3, unique_ids, group_offsets, counts, s, n);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckMatrix(d_rows, *n, s->dim(), "d_rows"); e.failure()) return e;
  if (dg1.element_count() != g1.element_count() || dg2.element_count() != g2.element_count() ||
      dg3.element_count() != g3.element_count()) {
    return ffi::Error::InvalidArgument("core gradients must have the cores' shapes");
  }
  return ffi::Error::Success();
}

// The window of unique indices [lo, lo + m) of the pooling ops (rows / d_rows [m, dim]):
// 0 <= lo, 1 <= m, lo + m < 2^31.
inline ffi::Error CheckPoolWindow(int64_t lo, int64_t m, const char* op) {
  if (lo < 0 || m < 1 || lo + m >= (int64_t{1} << 31)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": need 0 <= lo, 1 <= m (rows [m, dim]), " +
                                       "lo + m < 2^31; got lo " + std::to_string(lo) + ", m " +
                                       std::to_string(m));
  }
  return ffi::Error::Success();
}

// flowtt_bag_pool_fwd: rows [m, dim] (the uniques [lo, lo + m)), the pooling operands, counts
// [2] (the plan's: the window is capped at num_unique) or [0], prev [B, dim] (added onto) or
// [0, dim], and the output layout (batch 0, or batch >= 1 dividing num_bags:
// cuda/contract/pool_layout.h); sets n, dim, num_bags and m.
template <typename FBuf, typename IBuf, typename OBuf>
ffi::Error CheckPoolFwd(const FBuf& rows, const IBuf& inverse, const FBuf& weights,
                        const IBuf& offsets, const IBuf& counts, const FBuf& prev, const OBuf& out,
                        int64_t batch, int64_t lo, int64_t* n, int64_t* dim, int64_t* num_bags,
                        int64_t* m) {
  *n = Length(inverse);
  *dim = rows.dimensions().size() == 2 ? rows.dimensions()[1] : -1;
  *m = rows.dimensions().size() == 2 ? rows.dimensions()[0] : -1;
  if (ffi::Error e = CheckPooling(inverse, weights, offsets, out, *n, *dim, num_bags);
      e.failure()) {
    return e;
  }
  if (batch < 0 || (batch > 0 && *num_bags % batch != 0)) {
    return ffi::Error::InvalidArgument("flowtt_bag_pool_fwd: batch must be 0 or divide the " +
                                       std::to_string(*num_bags) + " bags, got " +
                                       std::to_string(batch));
  }
  if (Length(counts) != 2 && Length(counts) != 0) {
    return ffi::Error::InvalidArgument("flowtt_bag_pool_fwd: counts must be [2] or [0]");
  }
  const bool no_prev = prev.dimensions().size() == 2 && prev.dimensions()[0] == 0;
  if (ffi::Error e = CheckMatrix(prev, no_prev ? 0 : *num_bags, *dim, "prev"); e.failure()) {
    return e;
  }
  return CheckPoolWindow(lo, *m, "flowtt_bag_pool_fwd");
}

// flowtt_bag_pool_bwd: dout [B, dim], rows [m, dim] (or [0, dim] without the weight
// gradient: only d_weights reads the rows), weights, inverse, bag_ids, perm [n],
// run_offsets [n+1], counts [2], d_rows [m, dim] (the uniques [lo, lo + m)), d_weights [n]
// or [0] (no weight gradient); sets n, dim, num_bags = B and m.
template <typename FBuf, typename IBuf, typename OBuf>
ffi::Error CheckPoolBwd(const FBuf& dout, const FBuf& rows, const FBuf& weights,
                        const IBuf& inverse, const IBuf& bag_ids, const IBuf& perm,
                        const IBuf& run_offsets, const IBuf& counts, const OBuf& d_rows,
                        const OBuf& d_weights, int64_t lo, int64_t* n, int64_t* dim,
                        int64_t* num_bags, int64_t* m) {
  *n = Length(inverse);
  *dim = dout.dimensions().size() == 2 ? dout.dimensions()[1] : -1;
  *num_bags = dout.dimensions().size() == 2 ? dout.dimensions()[0] : -1;
  *m = d_rows.dimensions().size() == 2 ? d_rows.dimensions()[0] : -1;
  if (*n < 1 || Length(weights) != *n || Length(bag_ids) != *n || Length(perm) != *n ||
      Length(run_offsets) != *n + 1 || Length(counts) != 2 ||
      (Length(d_weights) != *n && Length(d_weights) != 0)) {
    return ffi::Error::InvalidArgument(
        "need weights, inverse, bag_ids, perm [n], d_weights [n] or [0], run_offsets [n+1], "
        "counts [2]");
  }
  const bool rows_unused =
      Length(d_weights) == 0 && rows.dimensions().size() == 2 && rows.dimensions()[0] == 0;
  if (ffi::Error e = CheckMatrix(rows, rows_unused ? 0 : *m, *dim, "rows"); e.failure()) return e;
  if (ffi::Error e = CheckMatrix(dout, *num_bags, *dim, "dout"); e.failure()) return e;
  if (ffi::Error e = CheckMatrix(d_rows, *m, *dim, "d_rows"); e.failure()) return e;
  return CheckPoolWindow(lo, *m, "flowtt_bag_pool_bwd");
}

// flowtt_bag_fwd: cores, group plan, pooling operands, out [B, D], chunk_rows >= 1;
// sets the core shape, n and num_bags.
template <typename FBuf, typename IBuf, typename OBuf>
ffi::Error CheckBagFwd(const FBuf& g1, const FBuf& g2, const FBuf& g3, const IBuf& unique_ids,
                       const IBuf& group_offsets, const IBuf& counts, const IBuf& inverse,
                       const FBuf& weights, const IBuf& offsets, const OBuf& out,
                       int64_t chunk_rows, CoreShape* s, int64_t* n, int64_t* num_bags) {
  if (ffi::Error e = CheckCoresAndPlan(g1, g2, g3, unique_ids, group_offsets, counts, s, n);
      e.failure()) {
    return e;
  }
  if (chunk_rows < 1) {
    return ffi::Error::InvalidArgument("flowtt_bag_fwd: chunk_rows must be >= 1, got " +
                                       std::to_string(chunk_rows));
  }
  return CheckPooling(inverse, weights, offsets, out, *n, s->dim(), num_bags);
}

// Whether a flowtt_plan call asks for the forward-only plan: perm and run_offsets [0].
template <typename Buf>
bool ForwardOnly(const Buf& perm, const Buf& run_offsets) {
  return Length(perm) == 0 && Length(run_offsets) == 0;
}

// flowtt_plan: ids [n] (n >= 0, n + 1 < 2^31); outputs perm, inverse, unique_ids [n],
// run_offsets, group_offsets [n+1], counts [2], or perm and run_offsets both [0] (the
// forward-only plan); attrs 1 <= last_extent < 2^31, 1 <= num_rows < 2^31.
template <typename Buf>
ffi::Error CheckPlan(const Buf& ids, const Buf& perm, const Buf& inverse, const Buf& unique_ids,
                     const Buf& run_offsets, const Buf& group_offsets, const Buf& counts,
                     int64_t last_extent, int64_t num_rows) {
  constexpr int64_t kInt32Limit = int64_t{1} << 31;
  const int64_t n = Length(ids);
  if (n < 0 || n + 1 >= kInt32Limit) {
    return ffi::Error::InvalidArgument("flowtt_plan: ids must be 1-D [n] with n + 1 < 2^31");
  }
  const bool sorted = Length(perm) == n && Length(run_offsets) == n + 1;
  if (!(sorted || ForwardOnly(perm, run_offsets)) || Length(inverse) != n ||
      Length(unique_ids) != n || Length(group_offsets) != n + 1 || Length(counts) != 2) {
    return ffi::Error::InvalidArgument(
        "flowtt_plan: outputs must be perm, inverse, unique_ids [n], run_offsets, "
        "group_offsets [n+1], counts [2] (perm and run_offsets both [0]: forward only)");
  }
  if (last_extent < 1 || last_extent >= kInt32Limit || num_rows < 1 || num_rows >= kInt32Limit) {
    return ffi::Error::InvalidArgument(
        "flowtt_plan: need 1 <= last_extent < 2^31 and 1 <= num_rows < 2^31");
  }
  return ffi::Error::Success();
}

}  // namespace flowtt
