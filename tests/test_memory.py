"""``estimate_memory`` against XLA's memory analysis of the collection's compiled step on
CPU (within 15 %), with and without unique-row capacities, with a dense table; its
parameters and optimizer state; ``BatchStats.measure``."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from flowtt_jax.capacity import measure_unique_ids
from flowtt_jax.collection import TableConfig
from flowtt_jax.memory import BatchStats, estimate_memory
from flowtt_jax.nnx import TTEmbeddingCollection


def _case(seed: int, capacities: bool, dense: bool):
    rng = np.random.default_rng(seed)
    cfgs = [TableConfig(f"t{i}", int(n), 16, rank=8) for i, n in enumerate(rng.integers(10**4, 10**6, 4))]
    if dense:
        cfgs.append(TableConfig("d", 3000, 16, kind="dense"))
    feats = {c.name: rng.zipf(1.3, (1024, int(rng.integers(3, 20)))) % c.num_embeddings for c in cfgs}
    if capacities:
        caps = measure_unique_ids([feats], {c.name: c.name for c in cfgs}, margin=1.1)
        cfgs = [
            TableConfig(c.name, c.num_embeddings, 16, kind=c.kind, rank=8, max_unique_ids=caps[c.name])
            for c in cfgs
        ]
    return cfgs, feats


@pytest.mark.parametrize("per_pass", [None, 4000], ids=["one-pass", "passes"])
@pytest.mark.parametrize("capacities", [False, True], ids=["per-id", "capacity"])
def test_activations_within_15_percent_of_xla(capacities, per_pass):
    """XLA's temporaries and outputs of a TT collection's step: inference (the bags) and
    training (the gradient of a loss of the bags), in one pass and in passes, with and
    without capacities."""
    cfgs, feats = _case(1, capacities, False)
    coll = TTEmbeddingCollection(cfgs, rngs=nnx.Rngs(0), ids_per_pass=per_pass)
    stats = BatchStats.measure([feats], cfgs)
    graphdef, state = nnx.split(coll)

    def bags(state, x):
        return nnx.merge(graphdef, state)(x)

    def loss(state, x):
        return sum(jnp.sum(v**2) for v in bags(state, x).values())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for training in (False, True):  # outputs: the bags, or the parameters' gradients
            step = jax.jit(jax.grad(loss) if training else bags)
            m = step.lower(state, feats).compile().memory_analysis()
            xla = m.temp_size_in_bytes + m.output_size_in_bytes
            est = estimate_memory(cfgs, stats, training=training, ids_per_pass=per_pass).activation_bytes
            assert abs(est / xla - 1) <= 0.15, (training, est, xla)


def test_parameters_and_optimizer_state():
    cfgs, feats = _case(2, False, True)
    coll = TTEmbeddingCollection(cfgs, rngs=nnx.Rngs(0))
    params = nnx.state(coll, nnx.Param)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    stats = BatchStats.measure([feats], cfgs)
    est = estimate_memory(cfgs, stats, optimizer=optax.adam(1e-3))
    assert est.parameters == param_bytes
    adam = optax.adam(1e-3).init(jax.tree.map(jnp.asarray, params))
    assert est.optimizer_state == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adam))
    assert estimate_memory(cfgs, stats).optimizer_state == 0
    assert coll.estimate_memory(stats, optimizer=optax.adam(1e-3)) == est  # the layer's
    assert est.total == est.parameters + est.optimizer_state + est.activation_bytes + est.scratch
    assert "total" in str(est) and "parameters" in str(est)
    # capacities shrink the row buffers, nothing else
    capped, _ = _case(2, True, True)
    assert estimate_memory(capped, stats).activation_bytes < estimate_memory(cfgs, stats).activation_bytes


def test_batch_stats_measure_and_unknown_features():
    cfgs = [TableConfig("a", 100, 8, feature_names=("x", "y")), TableConfig("b", 50, 8)]
    batches = [
        {
            "x": np.array([[1, 2], [2, 3]]),
            "y": (np.array([3, 9, 9]), np.array([0, 1, 3])),
            "b": np.array([[4]]),
        },
        {"x": np.array([[5, 5, 5], [5, 5, 6]]), "b": np.zeros((2, 2), int)},
    ]
    stats = BatchStats.measure(batches, cfgs)
    assert stats.batch_size == 2
    assert dict(stats.ids) == {"x": 6, "y": 3, "b": 4}
    assert dict(stats.unique) == {"a": 4, "b": 1}  # a: {1, 2, 3, 9}; then {5, 6}
    with pytest.raises(KeyError, match=r"\['z'\]"):
        BatchStats.measure([{"z": np.zeros((2, 1), int)}], cfgs)
    with pytest.raises(KeyError, match=r"\['z'\]"):
        estimate_memory(cfgs, BatchStats(2, {"z": 4}))
