// XLA FFI operand/result lists of the table-batched rows ops (docs/batched_contract.md),
// shared by the CPU (ffi/cpu/tb_handlers.cc) and CUDA (ffi/cuda/tb_handlers.cc) handlers; the
// checks themselves are plain C++ (cuda/contract/tb_contract.h).
// Trailing operands past the contract's are accepted and ignored (RemainingArgs): tests
// alias each output to one of them, filled with NaN, to prove every element is written.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "binding/ffi_binding.h"
#include "contract/tb_bags.h"
#include "contract/tb_contract.h"
#include "contract/tb_plan_meta.h"
#include "contract/tb_window.h"
#include "xla/ffi/api/ffi.h"

namespace flowtt::tb {

namespace ffi = xla::ffi;

using TbF32 = ffi::Buffer<ffi::F32>;
using TbS32 = ffi::Buffer<ffi::S32>;
using TbF32Out = ffi::ResultBuffer<ffi::F32>;
using TbS32Out = ffi::ResultBuffer<ffi::S32>;

inline ffi::Error TbError(const std::string& message) {
  return message.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(message);
}

// What a handler's shape checks give: the packed cores' shapes and the plan length n.
struct TbChecked {
  TbShape s;
  int64_t n;
};

// `c` when `message` (a check's result) is empty, else the InvalidArgument error.
inline ffi::ErrorOr<TbChecked> TbCheckedOr(const std::string& message, const TbChecked& c) {
  if (!message.empty()) return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(message));
  return c;
}

// TbCheckFwd on a handler's buffers.
inline ffi::ErrorOr<TbChecked> TbCheckFwdBuffers(const TbF32& g1, const TbF32& g2, const TbF32& g3,
                                                 const TbS32& u_i3, const TbS32& g_i1,
                                                 const TbS32& g_i2, const TbS32& group_offsets,
                                                 const TbS32& counts, const TbF32& rows) {
  TbChecked c{};
  const std::string e =
      TbCheckFwd(g1.dimensions(), g2.dimensions(), g3.dimensions(), u_i3.dimensions(),
                 g_i1.dimensions(), g_i2.dimensions(), group_offsets.dimensions(),
                 counts.dimensions(), rows.dimensions(), &c.s, &c.n);
  return TbCheckedOr(e, c);
}

// TbCheckBwd on a handler's buffers.
inline ffi::ErrorOr<TbChecked> TbCheckBwdBuffers(const TbF32& g1, const TbF32& g2, const TbF32& g3,
                                                 const TbF32& d_rows, const TbS32& u_i3,
                                                 const TbS32& g_i1, const TbS32& g_i2,
                                                 const TbS32& group_offsets, const TbS32& counts,
                                                 const TbF32& dg1, const TbF32& dg2,
                                                 const TbF32& dg3) {
  TbChecked c{};
  const std::string e = TbCheckBwd(
      g1.dimensions(), g2.dimensions(), g3.dimensions(), d_rows.dimensions(), u_i3.dimensions(),
      g_i1.dimensions(), g_i2.dimensions(), group_offsets.dimensions(), counts.dimensions(),
      dg1.dimensions(), dg2.dimensions(), dg3.dimensions(), &c.s, &c.n);
  return TbCheckedOr(e, c);
}

template <typename Binding>
auto TbBindRowsFwd(Binding b) {  // g1 g2 g3 u_i3 g_i1 g_i2 group_offsets counts -> rows
  return BindBuffers(std::move(b),
                     Buffers<TbF32, TbF32, TbF32, TbS32, TbS32, TbS32, TbS32, TbS32>{},
                     Buffers<TbF32>{});
}

template <typename Binding>
auto TbBindRowsBwd(Binding b) {
  // g1 g2 g3 d_rows u_i3 g_i1 g_i2 group_offsets counts -> dg1 dg2 dg3
  return BindBuffers(std::move(b),
                     Buffers<TbF32, TbF32, TbF32, TbF32, TbS32, TbS32, TbS32, TbS32, TbS32>{},
                     Buffers<TbF32, TbF32, TbF32>{});
}

// TbCheckPlanOp on a handler's buffers: n, the key form and the output pointers.
struct TbPlanChecked {
  int64_t n;
  TbKeyForm form;
  TbPlanOut out;
};
inline ffi::ErrorOr<TbPlanChecked> TbCheckPlanOpBuffers(
    const TbS32& ids, const TbS32& tables, const TbS32& meta, const TbS32& perm,
    const TbS32& inverse, const TbS32& run_offsets, const TbS32& group_offsets, const TbS32& u_i3,
    const TbS32& g_i1, const TbS32& g_i2, const TbS32& counts, int64_t extent, bool row_keys,
    int64_t num_keys) {
  int64_t n = 0, T = 0;
  const std::string e =
      TbCheckPlanOp(ids.dimensions(), tables.dimensions(), meta.dimensions(), perm.dimensions(),
                    inverse.dimensions(), run_offsets.dimensions(), group_offsets.dimensions(),
                    u_i3.dimensions(), g_i1.dimensions(), g_i2.dimensions(), counts.dimensions(),
                    extent, row_keys, num_keys, &n, &T);
  if (!e.empty()) return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(e));
  return TbPlanChecked{n,
                       TbKeyForm{{meta.typed_data(), static_cast<int>(T)}, extent, row_keys},
                       {perm.typed_data(), inverse.typed_data(), run_offsets.typed_data(),
                        group_offsets.typed_data(), u_i3.typed_data(), g_i1.typed_data(),
                        g_i2.typed_data(), counts.typed_data()}};
}

template <typename Binding>
auto TbBindPlan(Binding b) {
  // ids tables meta -> perm inverse run_offsets group_offsets u_i3 g_i1 g_i2 counts;
  // attrs extent, row_keys, num_keys
  return BindBuffers(std::move(b), Buffers<TbS32, TbS32, TbS32>{},
                     Buffers<TbS32, TbS32, TbS32, TbS32, TbS32, TbS32, TbS32, TbS32>{})
      .template Attr<int64_t>("extent")
      .template Attr<bool>("row_keys")
      .template Attr<int64_t>("num_keys");
}

// TbCheckBags on a handler's buffers: the op's inputs and outputs.
struct TbBagsChecked {
  TbBagsIn in;
  TbBagsOut out;
};
inline ffi::ErrorOr<TbBagsChecked> TbCheckBagsBuffers(
    const TbS32& ids, const TbS32& offsets, const TbS32& feature_tables, const TbS32& num_rows,
    const TbS32& ends, TbS32Out& ids_out, TbS32Out& tables_out, TbF32Out& live, TbS32Out& bag_ids,
    TbS32Out& offsets_out, int64_t batch, bool clip) {
  const std::string e = TbCheckBags(
      ids.dimensions(), offsets.dimensions(), feature_tables.dimensions(), num_rows.dimensions(),
      ends.dimensions(), ids_out->dimensions(), tables_out->dimensions(), live->dimensions(),
      bag_ids->dimensions(), offsets_out->dimensions(), batch);
  if (!e.empty()) return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(e));
  const int64_t F = feature_tables.dimensions()[0];
  return TbBagsChecked{
      {ids.typed_data(), offsets.typed_data(), feature_tables.typed_data(), num_rows.typed_data(),
       ends.typed_data(), ids.dimensions()[0], F * batch, batch, F, num_rows.dimensions()[0], clip},
      {ids_out->typed_data(), tables_out->typed_data(), live->typed_data(), bag_ids->typed_data(),
       offsets_out->typed_data()}};
}

template <typename Binding>
auto TbBindBags(Binding b) {
  // ids offsets feature_tables num_rows ends -> ids tables live bag_ids offsets; attrs batch, clip
  return BindBuffers(std::move(b), Buffers<TbS32, TbS32, TbS32, TbS32, TbS32>{},
                     Buffers<TbS32, TbS32, TbF32, TbS32, TbS32>{})
      .template Attr<int64_t>("batch")
      .template Attr<bool>("clip");
}

// TbCheckWindow on a handler's buffers: the window's input and output pointers.
struct TbWindowChecked {
  TbWindowIn in;
  TbWindowOut out;
};
inline ffi::ErrorOr<TbWindowChecked> TbCheckWindowBuffers(
    const TbS32& group_offsets, const TbS32& u_i3, const TbS32& g_i1, const TbS32& g_i2,
    const TbS32& counts, TbS32Out& w_group_offsets, TbS32Out& w_u_i3, TbS32Out& w_g_i1,
    TbS32Out& w_g_i2, TbS32Out& w_counts, int64_t lo) {
  int64_t n = 0, size = 0;
  const std::string e = TbCheckWindow(
      u_i3.dimensions(), g_i1.dimensions(), g_i2.dimensions(), group_offsets.dimensions(),
      counts.dimensions(), w_u_i3->dimensions(), w_g_i1->dimensions(), w_g_i2->dimensions(),
      w_group_offsets->dimensions(), w_counts->dimensions(), lo, &n, &size);
  if (!e.empty()) return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(e));
  return TbWindowChecked{
      {group_offsets.typed_data(), u_i3.typed_data(), g_i1.typed_data(), g_i2.typed_data(),
       counts.typed_data(), n, lo, size},
      {w_group_offsets->typed_data(), w_u_i3->typed_data(), w_g_i1->typed_data(),
       w_g_i2->typed_data(), w_counts->typed_data()}};
}

template <typename Binding>
auto TbBindWindow(Binding b) {
  // group_offsets u_i3 g_i1 g_i2 counts -> group_offsets u_i3 g_i1 g_i2 counts; attr lo
  return BindBuffers(std::move(b), Buffers<TbS32, TbS32, TbS32, TbS32, TbS32>{},
                     Buffers<TbS32, TbS32, TbS32, TbS32, TbS32>{})
      .template Attr<int64_t>("lo");
}

}  // namespace flowtt::tb
