// flowtt_tb_plan on the CPU (docs/batched_contract.md, "The plan op"), no XLA types: the
// handler in ffi/cpu/tb_handlers.cc checks shapes and attributes, then calls MakeTbPlan.
#pragma once

#include <cstdint>

#include "contract/tb_plan_meta.h"

namespace flowtt::cpu {

// ids [n] of tables [n] in key form `form`: the plan of
// flowtt_jax.batched_plan.make_group_plan bit for bit (for in-range operands), from the
// keys form.key(table, id, num_keys - 1).
void MakeTbPlan(const int32_t* ids, const int32_t* tables, int64_t n, const tb::TbKeyForm& form,
                int64_t num_keys, const tb::TbPlanOut& out);

}  // namespace flowtt::cpu
