"""Data parallelism over 4 virtual CPU devices (run in a subprocess: the device count
is fixed when jax starts)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowtt_jax import ffi

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled extension not built")


def _check_data_parallel() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flowtt_jax as ftt
    from conftest import assert_no_host_callback, custom_call_targets, make_cores, make_ids, rel_err
    from flowtt_jax.sharding import data_parallel

    assert len(jax.devices()) == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("data",))
    spec = ftt.TTSpec.create(5000, 32, 16)
    cores = make_cores(spec, seed=1)
    ids = make_ids("zipf1.05", 64 * 9, spec.num_embeddings, seed=2).reshape(64, 9)
    rng = np.random.default_rng(3)
    weights = rng.standard_normal((64, 9)).astype(np.float32)
    mask = rng.random((64, 9)) < 0.8

    def bag(c, i, w, m):
        return ftt.tt_embedding_bag(c, i, weights=w, mask=m, mode="mean")

    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    args = (put(cores, P()), put(ids, P("data")), put(weights, P("data")), put(mask, P("data")))
    sharded = jax.jit(data_parallel(bag, mesh))
    out = sharded(*args)
    assert out.sharding.spec[0] == "data"
    with jax.enable_x64(True):
        c64 = [jnp.asarray(c, jnp.float64) for c in cores]
        ref = ftt.tt_embedding_bag(c64, ids, weights=weights.astype(np.float64), mask=mask,
                                   mode="mean", impl="reference")
    assert rel_err(out, ref) < 1e-5

    loss = lambda c, i, w, m: jnp.sum(jnp.sin(data_parallel(bag, mesh)(c, i, w, m)))
    grad = jax.jit(jax.grad(loss, argnums=(0, 2)))
    g_cores, g_w = grad(*args)
    with jax.enable_x64(True):
        ref_loss = lambda c, w: jnp.sum(jnp.sin(ftt.tt_embedding_bag(c, ids, weights=w, mask=mask,
                                                                     mode="mean", impl="reference")))
        r_cores, r_w = jax.grad(ref_loss, argnums=(0, 1))(c64, jnp.asarray(weights, jnp.float64))
    for a, b in zip(g_cores, r_cores):
        assert a.sharding.is_fully_replicated and rel_err(a, b) < 1e-5
    assert rel_err(g_w, r_w) < 1e-5

    text = grad.lower(*args).compile().as_text()
    assert "all-reduce" in text  # core gradients summed over devices
    assert "flowtt_tt_rows_bwd" in custom_call_targets(text)
    assert_no_host_callback(text)
    # Each device pools only its own 16 bags.
    hlo = sharded.lower(*args).compile().as_text()
    pool_calls = [line for line in hlo.splitlines() if 'custom_call_target="flowtt_bag_pool_fwd"' in line]
    assert pool_calls and all(line.split("=")[1].strip().startswith("f32[16,32]") for line in pool_calls), pool_calls
    print("data parallel OK")


def test_data_parallel_over_four_devices():
    tests_dir = Path(__file__).resolve().parent
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", "import test_sharding; test_sharding._check_data_parallel()"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data parallel OK" in proc.stdout
