"""Small forward+backward through the CUDA FFI path (for compute-sanitizer), the
no-gradient fused forward (flowtt_bag_fwd) with one chunk and with several (its plan the
forward-only one, by the table's bitmap), a single id (a one-item plan: initcheck
flagged two of its reads once; its no-gradient lookup takes the forward-only plan's sort),
and the table-batched op in capacity passes (windows of uniques; one past the uniques)."""

import jax
import jax.numpy as jnp
import numpy as np

import flowtt_jax as ftt
from flowtt_jax.kernels import ffi

# (40, 4, 10): 32 groups a backward tile at D128 r64, so its batches of 16 deal the dP items
# in snake order (snake_slots)
for dim, rank, rows in ((32, 32, (10, 10, 200)), (128, 64, (10, 10, 100)), (128, 64, (40, 4, 10))):
    spec = ftt.TTSpec.create(rows[0] * rows[1] * rows[2] - 7, dim, rank, row_shape=rows)
    cores = tuple(ftt.init_cores(jax.random.key(0), spec))
    rng = np.random.default_rng(0)
    n, bags = 700, 60
    ids = jnp.asarray(
        np.concatenate(
            [
                rng.integers(0, 1500, n - 100),  # hot prefix groups
                np.full(100, spec.num_embeddings - 1),
            ]
        ).astype(np.int32)
    )
    offsets = jnp.asarray(np.sort(np.concatenate([[0, n], rng.integers(0, n, bags - 1)])).astype(np.int32))
    w = jnp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))

    def loss(c, ww, ids=ids, offsets=offsets):
        return jnp.sum(ftt.tt_embedding_bag(c, ids, offsets=offsets, weights=ww, impl="ffi") ** 2)

    val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(cores, w)
    jax.block_until_ready(grads)
    # unweighted bags: the pooling backward skips the weight gradient
    unweighted = jax.grad(
        lambda c, ids=ids, offsets=offsets: jnp.sum(
            ftt.tt_embedding_bag(c, ids, offsets=offsets, impl="ffi") ** 2
        )
    )
    jax.block_until_ready(jax.jit(unweighted)(cores))

    plan = ffi.plan(ids, rows[2], rows[0] * rows[1] * rows[2])
    for chunk in (64, 100, 1 << 20):  # several chunks (groups split across them) and one
        jax.block_until_ready(jax.jit(ffi.bag_fwd, static_argnums=4)(cores, plan, w, offsets, chunk))
    no_grad = lambda c, ids=ids, offsets=offsets: ftt.tt_embedding_bag(c, ids, offsets=offsets, impl="ffi")
    jax.block_until_ready(jax.jit(no_grad)(cores))
    print("dim", dim, "loss", float(val), "grad norms", [float(jnp.linalg.norm(g)) for g in grads[0]])
one = jnp.array([spec.num_embeddings - 1], jnp.int32)
single = jax.value_and_grad(
    lambda c: jnp.sum(ftt.tt_embedding_bag(c, one, offsets=jnp.array([0, 1], jnp.int32), impl="ffi") ** 2)
)
jax.block_until_ready(jax.jit(single)(cores))
print("one id: row", np.asarray(ftt.tt_lookup(cores, one, impl="ffi"))[0, :3])

# the table-batched op in capacity passes: weighted and not, a capacity below the uniques
specs = tuple(
    ftt.TTSpec.create(m, 32, 8, row_shape=r) for m, r in ((2000, (10, 10, 20)), (3000, (10, 15, 20)))
)
layout = ftt.GroupLayout(specs)
packed = layout.pack([ftt.init_cores(jax.random.key(t), s) for t, s in enumerate(specs)])
rng = np.random.default_rng(1)
lens = rng.integers(0, 9, 2 * 40)
offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
n = int(offsets[-1])
ids = jnp.asarray(
    np.concatenate([rng.integers(0, 300, lens[:40].sum()), rng.integers(0, 300, lens[40:].sum())]).astype(
        np.int32
    )
)
w = jnp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32))
for weights in (w, None):
    for cap in (n // 3 + 1, n // 9 + 1):
        group = jax.value_and_grad(
            lambda p, cap=cap, weights=weights: jnp.sum(
                ftt.tt_embedding_bag_group(
                    p, layout, ids, offsets, (0, 1), weights=weights, impl="ffi", unique_capacity=cap
                )
                ** 2
            )
        )
        val, g = jax.jit(group)(packed)
        jax.block_until_ready(g)
print("capacity passes: loss", float(val))
print("sanitize_small done")
