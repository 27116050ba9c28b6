// Binding a target's operand and result buffer lists in one call (the XLA FFI binding
// builder, one .Arg/.Ret per buffer): used by the single-table contract (op_ffi.h)
// and the table-batched one (tb_ffi.h).
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace flowtt {

// b.Arg<T>().Arg<Rest>()... (kRet false) or b.Ret<T>().Ret<Rest>()... (kRet true). A
// Binding is never copied: each step moves it into the next.
template <bool kRet, typename T, typename... Rest, typename Binding>
auto BindEach(Binding&& b) {
  if constexpr (sizeof...(Rest) > 0) {
    return BindEach<kRet, Rest...>(BindEach<kRet, T>(std::move(b)));
  } else if constexpr (kRet) {
    return std::move(b).template Ret<T>();
  } else {
    return std::move(b).template Arg<T>();
  }
}

// A list of buffer types, for BindBuffers.
template <typename... T>
struct Buffers {};

// b.Arg<A>()... .RemainingArgs() .Ret<R>()...
template <typename Binding, typename... A, typename... R>
auto BindBuffers(Binding&& b, Buffers<A...>, Buffers<R...>) {
  return BindEach<true, R...>(BindEach<false, A...>(std::move(b)).RemainingArgs());
}

}  // namespace flowtt
