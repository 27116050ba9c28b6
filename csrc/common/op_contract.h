// Shape checks of the op contract (docs/op_contract.md) on XLA FFI buffers
// (any ffi::Buffer type),
// shared by the CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/core_shape.h"
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
    return ffi::Error::InvalidArgument("need inverse [n], weights [n], offsets [B+1] (n = " +
                                       std::to_string(n) + ", n >= 1)");
  }
  return CheckMatrix(out, *num_bags, dim, "out");
}

// flowtt_bag_fwd past the group plan and the cores (they give n and dim = D): the pooling
// operands and chunk_rows >= 1; sets num_bags = B.
template <typename FBuf, typename IBuf, typename OBuf>
ffi::Error CheckBagFwd(const IBuf& inverse, const FBuf& weights, const IBuf& offsets,
                       const OBuf& out, int64_t n, int64_t dim, int64_t chunk_rows,
                       int64_t* num_bags) {
  if (chunk_rows < 1) {
    return ffi::Error::InvalidArgument("flowtt_bag_fwd: chunk_rows must be >= 1, got " +
                                       std::to_string(chunk_rows));
  }
  return CheckPooling(inverse, weights, offsets, out, n, dim, num_bags);
}

// flowtt_plan: ids [n] (n >= 0, n + 1 < 2^31); outputs perm, inverse, unique_ids [n],
// run_offsets, group_offsets [n+1], counts [2]; attrs 1 <= last_extent < 2^31,
// 1 <= num_rows < 2^31.
template <typename Buf>
ffi::Error CheckPlan(const Buf& ids, const Buf& perm, const Buf& inverse, const Buf& unique_ids,
                     const Buf& run_offsets, const Buf& group_offsets, const Buf& counts,
                     int64_t last_extent, int64_t num_rows) {
  constexpr int64_t kInt32Limit = int64_t{1} << 31;
  const int64_t n = Length(ids);
  if (n < 0 || n + 1 >= kInt32Limit) {
    return ffi::Error::InvalidArgument("flowtt_plan: ids must be 1-D [n] with n + 1 < 2^31");
  }
  if (Length(perm) != n || Length(inverse) != n || Length(unique_ids) != n ||
      Length(run_offsets) != n + 1 || Length(group_offsets) != n + 1 || Length(counts) != 2) {
    return ffi::Error::InvalidArgument(
        "flowtt_plan: outputs must be perm, inverse, unique_ids [n], run_offsets, "
        "group_offsets [n+1], counts [2]");
  }
  if (last_extent < 1 || last_extent >= kInt32Limit || num_rows < 1 || num_rows >= kInt32Limit) {
    return ffi::Error::InvalidArgument(
        "flowtt_plan: need 1 <= last_extent < 2^31 and 1 <= num_rows < 2^31");
  }
  return ffi::Error::Success();
}

// Operand and result lists of the targets, appended to a binding that may
// already hold context arguments (the CUDA stream, the scratch allocator).
// Trailing operands past the contract's are accepted and ignored (RemainingArgs).
using F32Buffer = ffi::Buffer<ffi::F32>;
using S32Buffer = ffi::Buffer<ffi::S32>;

template <typename Binding>
auto BindRowsFwd(Binding b) {  // g1 g2 g3 unique_ids group_offsets counts -> rows
  return std::move(b)
      .template Arg<F32Buffer>().template Arg<F32Buffer>().template Arg<F32Buffer>()
      .template Arg<S32Buffer>().template Arg<S32Buffer>().template Arg<S32Buffer>()
      .RemainingArgs()
      .template Ret<F32Buffer>();
}

template <typename Binding>
auto BindRowsBwd(Binding b) {  // g1 g2 g3 d_rows unique_ids group_offsets counts -> dg1 dg2 dg3
  return std::move(b)
      .template Arg<F32Buffer>().template Arg<F32Buffer>().template Arg<F32Buffer>()
      .template Arg<F32Buffer>()
      .template Arg<S32Buffer>().template Arg<S32Buffer>().template Arg<S32Buffer>()
      .RemainingArgs()
      .template Ret<F32Buffer>().template Ret<F32Buffer>().template Ret<F32Buffer>();
}

template <typename Binding>
auto BindPoolFwd(Binding b) {  // rows inverse weights offsets -> out
  return std::move(b)
      .template Arg<F32Buffer>().template Arg<S32Buffer>().template Arg<F32Buffer>()
      .template Arg<S32Buffer>()
      .RemainingArgs()
      .template Ret<F32Buffer>();
}

template <typename Binding>
auto BindPoolBwd(Binding b) {
  // dout rows weights inverse bag_ids perm run_offsets counts -> d_rows d_weights
  return std::move(b)
      .template Arg<F32Buffer>().template Arg<F32Buffer>().template Arg<F32Buffer>()
      .template Arg<S32Buffer>().template Arg<S32Buffer>().template Arg<S32Buffer>()
      .template Arg<S32Buffer>().template Arg<S32Buffer>()
      .RemainingArgs()
      .template Ret<F32Buffer>().template Ret<F32Buffer>();
}

template <typename Binding>
auto BindBagFwd(Binding b) {
  // g1 g2 g3 unique_ids group_offsets counts inverse weights offsets -> out; attr chunk_rows
  return std::move(b)
      .template Arg<F32Buffer>().template Arg<F32Buffer>().template Arg<F32Buffer>()
      .template Arg<S32Buffer>().template Arg<S32Buffer>().template Arg<S32Buffer>()
      .template Arg<S32Buffer>().template Arg<F32Buffer>().template Arg<S32Buffer>()
      .RemainingArgs()
      .template Ret<F32Buffer>()
      .template Attr<int64_t>("chunk_rows");
}

using S32Out = ffi::ResultBuffer<ffi::S32>;

template <typename Binding>
auto BindPlan(Binding b) {
  // ids -> perm inverse unique_ids run_offsets group_offsets counts; attrs last_extent, num_rows
  return std::move(b)
      .template Arg<S32Buffer>()
      .RemainingArgs()
      .template Ret<S32Buffer>().template Ret<S32Buffer>().template Ret<S32Buffer>()
      .template Ret<S32Buffer>().template Ret<S32Buffer>().template Ret<S32Buffer>()
      .template Attr<int64_t>("last_extent")
      .template Attr<int64_t>("num_rows");
}

}  // namespace flowtt
