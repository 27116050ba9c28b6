import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt
from tests.helpers import rel_err


def test_to_dense_matches_row_definition():
    spec = ftt.TTSpec.create(60, 12, rank=(3, 5), row_shape=(3, 4, 5), col_shape=(2, 3, 2))
    cores = [np.asarray(c) for c in ftt.init_cores(jax.random.key(1), spec)]
    dense = np.asarray(ftt.to_dense(cores, 60))
    for i in [0, 1, 17, 59]:
        i1, i2, i3 = i // 20, (i // 5) % 4, i % 5
        row = np.einsum("xa,ayb,bz->xyz", cores[0][i1, 0], cores[1][i2], cores[2][i3, :, :, 0])
        np.testing.assert_allclose(dense[i], row.reshape(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_cores", [2, 3, 4])
def test_from_dense_exact_at_full_rank(num_cores, x64):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((300, 16))
    spec = ftt.TTSpec.create(300, 16, rank=10**6, num_cores=num_cores)
    cores = ftt.from_dense(table, spec, dtype=jnp.float64)
    assert rel_err(ftt.to_dense(cores, 300), table) < 1e-12


def test_from_dense_error_decreases_with_rank(x64):
    rng = np.random.default_rng(1)
    # A table with decaying spectrum so truncation is meaningful.
    table = rng.standard_normal((1000, 16)) @ np.diag(0.7 ** np.arange(16))
    errors = []
    for rank in (1, 2, 4, 8, 16, 32, 64):
        spec = ftt.TTSpec.create(1000, 16, rank)
        errors.append(rel_err(ftt.to_dense(ftt.from_dense(table, spec, jnp.float64), 1000), table))
    assert all(b <= a + 1e-12 for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 0.3 and errors[-1] < 1e-10


def test_from_dense_rejects_wrong_shape():
    spec = ftt.TTSpec.create(100, 8, 4)
    with pytest.raises(ValueError, match="table shape"):
        ftt.from_dense(np.ones((99, 8)), spec)


def test_init_cores_sets_row_std():
    spec = ftt.TTSpec.create(200_000, 32, 16)
    init = jax.jit(ftt.init_cores, static_argnums=(1, 2, 3))  # one program each, not op by op
    lookup = jax.jit(lambda c: ftt.tt_lookup(c, jnp.arange(0, 200_000, 7), impl="reference"))
    cores = init(jax.random.key(3), spec)
    rows = lookup(cores)
    assert float(rows.std()) == pytest.approx(1 / np.sqrt(32), rel=0.1)
    cores = init(jax.random.key(3), spec, 0.5, jnp.bfloat16)
    assert all(c.dtype == jnp.bfloat16 for c in cores)
    rows = lookup(cores)
    assert float(rows.astype(jnp.float32).std()) == pytest.approx(0.5, rel=0.1)


def test_from_dense_reports_its_error(x64, caplog):
    """``return_error`` gives the truncation's relative error (the one ``to_dense`` shows),
    it is logged at INFO, and a collection's ``from_dense`` returns it: a random 1000x16
    table at rank 4 loses most of itself, and says so."""
    import logging

    rng = np.random.default_rng(2)
    table = rng.standard_normal((1000, 16))
    spec = ftt.TTSpec.create(1000, 16, 4)
    with caplog.at_level(logging.INFO, logger="flowtt_jax"):
        cores, error = ftt.from_dense(table, spec, jnp.float64, return_error=True)
    np.testing.assert_allclose(error, rel_err(ftt.to_dense(cores, 1000), table), rtol=1e-9)
    assert 0.3 < error < 1 and "relative error" in caplog.text
    full = ftt.TTSpec.create(1000, 16, 64)
    assert ftt.from_dense(table, full, jnp.float64, return_error=True)[1] < 1e-10

    from flax import nnx

    from flowtt_jax.collection import TableConfig
    from flowtt_jax.nnx import TTEmbeddingCollection

    col = TTEmbeddingCollection(
        [TableConfig("t", 1000, 16, rank=4), TableConfig("d", 50, 16, kind="dense")], rngs=nnx.Rngs(0)
    )
    got = col.from_dense("t", jnp.asarray(table, jnp.float32))
    np.testing.assert_allclose(got, error, rtol=1e-4)
    assert col.from_dense("d", jnp.ones((50, 16))) == 0.0


@pytest.mark.parametrize("rank", [4, 64])
def test_from_dense_on_device_matches_the_host(rank):
    """``on_device``: the TT-SVD by jnp.linalg.svd on jax's default device (float32) gives
    the host's float64 truncation within float32 rounding: the same table back, the same
    error reported (SVD signs may differ, so the tables are compared, not the cores)."""
    rng = np.random.default_rng(3)
    table = (rng.standard_normal((700, 16)) @ np.diag(0.8 ** np.arange(16))).astype(np.float32)
    spec = ftt.TTSpec.create(700, 16, rank)
    host, host_error = ftt.from_dense(table, spec, return_error=True)
    dev, dev_error = ftt.from_dense(jnp.asarray(table), spec, return_error=True, on_device=True)
    assert all(isinstance(c, jax.Array) and c.dtype == jnp.float32 for c in dev)
    assert rel_err(ftt.to_dense(dev, 700), ftt.to_dense(host, 700)) < 1e-4
    assert dev_error == pytest.approx(host_error, abs=1e-4)
    assert (host_error < 1e-5) == (rank == 64)

    from flax import nnx

    from flowtt_jax.collection import TableConfig
    from flowtt_jax.nnx import TTEmbed, TTEmbeddingCollection

    col = TTEmbeddingCollection([TableConfig("t", 700, 16, rank=rank)], rngs=nnx.Rngs(0))
    assert col.from_dense("t", jnp.asarray(table), on_device=True) == pytest.approx(host_error, abs=1e-4)
    layer = TTEmbed.from_dense(jnp.asarray(table), rank, on_device=True)
    assert rel_err(layer.to_dense(), ftt.to_dense(host, 700)) < 1e-4
