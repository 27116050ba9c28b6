"""Data parallelism over 4 virtual CPU devices, and across 2 processes through
``jax.distributed`` on localhost (each in subprocesses: the device count is fixed when
jax starts). The subprocesses run on the CPU platform whatever the machine has
(``JAX_PLATFORMS=cpu``), so a GPU machine gives them the same virtual devices."""

import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

# Importing this module must not start jax's backends: the workers import it first.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flowtt_jax._flowtt_cpu") is None, reason="compiled extension not built"
)


def _check_data_parallel() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flowtt_jax as ftt
    from flowtt_jax.sharding import data_parallel
    from tests.helpers import assert_no_host_callback, custom_call_targets, make_cores, make_ids, rel_err

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
    # each program compiled once: its values and its HLO text below
    sharded = jax.jit(data_parallel(bag, mesh)).lower(*args).compile()
    out = sharded(*args)
    assert out.sharding.spec[0] == "data"
    loss = lambda c, i, w, m: jnp.sum(jnp.sin(data_parallel(bag, mesh)(c, i, w, m)))
    grad = jax.jit(jax.grad(loss, argnums=(0, 2))).lower(*args).compile()
    g_cores, g_w = grad(*args)
    with jax.enable_x64(True):  # the float64 reference and its gradients: one program, not op by op

        def bag64(c, w):
            return ftt.tt_embedding_bag(c, ids, weights=w, mask=mask, mode="mean", impl="reference")

        @jax.jit
        def reference(c, w):
            return bag64(c, w), jax.grad(lambda c, w: jnp.sum(jnp.sin(bag64(c, w))), argnums=(0, 1))(c, w)

        c64, w64 = [np.asarray(c, np.float64) for c in cores], weights.astype(np.float64)
        ref, (r_cores, r_w) = reference(c64, w64)
    assert rel_err(out, ref) < 1e-5
    for a, b in zip(g_cores, r_cores):
        assert a.sharding.is_fully_replicated and rel_err(a, b) < 1e-5
    assert rel_err(g_w, r_w) < 1e-5

    text = grad.as_text()
    assert "all-reduce" in text  # core gradients summed over devices
    assert "flowtt_tt_rows_bwd" in custom_call_targets(text)
    assert_no_host_callback(text)
    # Each device pools only its own 16 bags.
    hlo = sharded.as_text()
    pool_calls = [line for line in hlo.splitlines() if 'custom_call_target="flowtt_bag_fwd"' in line]
    assert pool_calls and all(line.split("=")[1].strip().startswith("f32[16,32]") for line in pool_calls), (
        pool_calls
    )
    print("data parallel OK")


def _check_users_shard_map() -> None:
    """The ops inside a user's own ``jax.shard_map`` with jax's default ``check_vma=True``:
    cores replicated, the batch split over 4 devices. Gradients equal one device's (the
    replicated cores' summed over devices): before ``ffi.to_varying`` the kernels' core
    gradients came back typed device-invariant and were not summed (relative error ~3);
    replicated weights' gradient must come back typed as they are."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flowtt_jax as ftt
    from flowtt_jax import tt_embedding_bag_group
    from flowtt_jax.kernels.group_plan import GroupLayout
    from tests.helpers import make_cores, make_ids, rel_err

    mesh = jax.make_mesh((4,), ("data",))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    specs = (ftt.TTSpec.create(5000, 16, 8), ftt.TTSpec.create(3001, 16, 8))
    layout = GroupLayout(specs)
    cores = make_cores(specs[0], seed=1)
    packed = layout.pack([cores, make_cores(specs[1], seed=2)])
    rng = np.random.default_rng(3)
    ids = np.stack([make_ids("zipf1.05", 64 * 5, s.num_embeddings, seed=4 + t) for t, s in enumerate(specs)])
    ids = ids.reshape(2, 64, 5).transpose(1, 0, 2)  # [B, F, L]: split over the batch
    weights = rng.standard_normal(ids.shape).astype(np.float32)

    def bag(c, i, w, impl):  # feature 0 of ids
        return ftt.tt_embedding_bag(c, i[:, 0], weights=w[:, 0], mode="mean", impl=impl)

    def lookup(c, i, w, impl):
        return ftt.tt_lookup(c, i[:, 0], impl=impl) * w[:, 0, :, None]

    def group(c, i, w, impl):  # both features, feature-major
        b, f, length = i.shape
        flat = lambda x: jnp.transpose(x, (1, 0, 2)).reshape(-1)
        offsets = jnp.arange(f * b + 1, dtype=jnp.int32) * length
        return tt_embedding_bag_group(c, layout, flat(i), offsets, (0, 1), weights=flat(w), impl=impl)

    def shared_weights(c, i, w, impl):  # replicated weights (one per slot), clipped ids
        per_slot = jnp.broadcast_to(w[0, 0], i[:, 0].shape)
        return ftt.tt_embedding_bag(c, i[:, 0], weights=per_slot, oob="clip", impl=impl)

    cases = (
        ("bag", bag, cores, P("data")),
        ("lookup", lookup, cores, P("data")),
        ("group", group, packed, P("data")),
        ("replicated weights", shared_weights, cores, P()),
    )
    for name, fn, params, w_spec in cases:

        def loss(c, i, w, fn=fn):
            return jax.lax.psum(jnp.sum(jnp.sin(fn(c, i, w, "ffi"))), "data")

        mapped = jax.shard_map(loss, mesh=mesh, in_specs=(P(), P("data"), w_spec), out_specs=P())
        args = (put(params, P()), put(ids, P("data")), put(weights, w_spec))
        g_params, g_w = jax.jit(jax.grad(mapped, argnums=(0, 2)))(*args)
        with jax.enable_x64(True):
            p64 = [jnp.asarray(c, jnp.float64) for c in params]
            ref = lambda c, w, fn=fn: jnp.sum(jnp.sin(fn(c, ids, w, "reference")))
            r_params, r_w = jax.grad(ref, argnums=(0, 1))(p64, jnp.asarray(weights, jnp.float64))
        for a, b in zip(g_params, r_params):
            assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))
        assert rel_err(g_w, r_w) < 1e-5, (name, rel_err(g_w, r_w))
    print("user shard_map OK")


def _start_distributed(process_id: int, num_processes: int, port: int) -> None:
    """Joins this worker to ``jax.distributed`` as process ``process_id`` of ``num_processes``
    (2 CPU devices each, gloo collectives), the coordinator on loopback ``port``."""
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=120,
    )


def _multiprocess_worker(process_id: int, port: int) -> None:
    """One of 2 processes x 2 CPU devices: a global batch split over 4 devices."""
    _start_distributed(process_id, 2, port)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flowtt_jax as ftt
    from flowtt_jax.sharding import data_parallel
    from tests.helpers import make_cores, make_ids, rel_err

    assert jax.process_count() == 2 and jax.device_count() == 4
    mesh = jax.make_mesh((4,), ("data",))
    spec = ftt.TTSpec.create(5000, 32, 16)
    cores = make_cores(spec, seed=1)
    ids = make_ids("zipf1.2", 64 * 9, spec.num_embeddings, seed=2).reshape(64, 9)
    local = ids[process_id * 32 : (process_id + 1) * 32]  # this process's half of the batch
    g_ids = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local, ids.shape)
    g_cores = jax.device_put(cores, NamedSharding(mesh, P()))
    bag = data_parallel(lambda c, i: ftt.tt_embedding_bag(c, i, mode="mean"), mesh)
    grads = jax.jit(jax.grad(lambda c, i: jnp.sum(jnp.sin(bag(c, i)))))(g_cores, g_ids)
    with jax.enable_x64(True):
        c64 = [jnp.asarray(c, jnp.float64) for c in cores]
        ref = jax.grad(
            lambda c: jnp.sum(jnp.sin(ftt.tt_embedding_bag(c, ids, mode="mean", impl="reference")))
        )(c64)
    for g, r in zip(grads, ref):
        assert rel_err(np.asarray(g.addressable_data(0)), r) < 1e-5
    jax.distributed.shutdown()
    print(f"process {process_id} OK")


REPO = Path(__file__).resolve().parents[1]


def _cpu_env(cpu_devices: int | None = None) -> dict:
    """Environment of a worker: the CPU platform only, ``tests`` importable from the
    repository root, and ``cpu_devices`` virtual CPU devices when given."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    if cpu_devices is not None:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={cpu_devices}"
    return env


def _free_port() -> int:
    """A free loopback port (for the ``jax.distributed`` coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(workers: Sequence[tuple[str, dict]], timeout: float) -> list[tuple[int, str]]:
    """Runs ``python -c code`` with environment ``env`` for every ``(code, env)`` at once,
    from the repository root; each one's exit code and output (stdout and stderr)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for code, env in workers
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outputs)]


def test_data_parallel_over_four_devices():
    code = "from tests import test_sharding; test_sharding._check_data_parallel()"
    [(returncode, out)] = _run_workers([(code, _cpu_env(cpu_devices=4))], timeout=300)
    assert returncode == 0 and "data parallel OK" in out, out


def test_ops_inside_a_users_shard_map_with_check_vma():
    code = "from tests import test_sharding; test_sharding._check_users_shard_map()"
    [(returncode, out)] = _run_workers([(code, _cpu_env(cpu_devices=4))], timeout=300)
    assert returncode == 0 and "user shard_map OK" in out, out[-3000:]


@pytest.mark.slow
def test_data_parallel_across_two_processes():
    port = _free_port()
    code = "from tests import test_sharding; test_sharding._multiprocess_worker({}, {})"
    results = _run_workers([(code.format(i, port), _cpu_env()) for i in range(2)], timeout=300)
    for i, (returncode, out) in enumerate(results):
        assert returncode == 0 and f"process {i} OK" in out, out[-3000:]


def test_place_state_takes_a_multi_transform_optimizer():
    """A per-table optimizer (``optax.multi_transform`` by ``param_labels``) holds leafless
    ``MaskedNode``s in its state: ``place_state`` leaves them and places every array."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    from flowtt_jax import sharding as sh
    from flowtt_jax.collection import TableConfig
    from flowtt_jax.nnx import TTEmbeddingCollection

    tables = [TableConfig("a", 1000, 8, rank=4, optimizer="tt"), TableConfig("b", 50, 8, kind="dense")]
    coll = TTEmbeddingCollection(tables, rngs=nnx.Rngs(0))
    tx = optax.multi_transform({"tt": optax.adam(1e-2), "default": optax.sgd(1e-2)}, coll.param_labels())
    opt = nnx.Optimizer(coll, tx, wrt=nnx.Param)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    state = nnx.state((coll, opt))
    placed = sh.place_state(state, mesh)
    assert jax.tree.structure(placed) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(state), strict=True):
        assert a.sharding.mesh == mesh
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
