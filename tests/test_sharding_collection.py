"""A collection over a mesh: data parallel and table-wise on 8 virtual CPU devices, a
training step across 2 processes (``jax.distributed`` on localhost), and the host-side
pieces (per-shard bags, cost model, placement) in this process.

Subprocesses as in ``test_sharding``: the device count is fixed when jax starts."""

import importlib.util
import json
import math
import re

import jax
import numpy as np
import pytest

from tests.test_sharding import _cpu_env, _free_port, _run_workers, _start_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flowtt_jax._flowtt_cpu") is None, reason="compiled extension not built"
)

B = 16  # global bags per feature: 2 per device on 8 devices, 4 per device on 4
STEPS = 4


def _tables():
    from flowtt_jax.collection import TableConfig

    return [
        TableConfig("a", 500, 16, rank=4),
        TableConfig("b", 3000, 16, rank=4, mode="mean"),
        TableConfig("c", 700, 16, rank=4, mode="sqrtn", feature_names=("c1", "c2")),
        TableConfig("d", 900, 8, rank=6),
        TableConfig("e", 11, 16, kind="dense", mode="mean"),
    ]


def _segments_per_shard(ids, seg, num_shards: int) -> dict:
    """Global segment-form bags -> per-shard ids / local segment ids ``[S, C]`` (-1: padding)."""
    per, cap = B // num_shards, ids.size  # a fixed capacity: the same shapes every batch
    shard = np.where((seg >= 0) & (seg < B), seg // per, -1)
    out_ids = np.zeros((num_shards, cap), np.int32)
    out_seg = np.full((num_shards, cap), -1, np.int32)
    for s in range(num_shards):
        mine = np.flatnonzero(shard == s)
        out_ids[s, : mine.size], out_seg[s, : mine.size] = ids[mine], seg[mine] - s * per
    return {"ids": out_ids, "segment_ids": out_seg}


def _batch(seed: int, num_shards: int, csr_only: bool = False) -> tuple[dict, dict]:
    """(global features, the same split for ``num_shards`` devices): every input form.
    Feature "d" comes as segment ids (its static ``num_bags`` added by ``_with_num_bags``),
    or with ``csr_only`` as CSR (per shard: ``shard_bags``)."""
    from flowtt_jax.sharding import shard_bags
    from tests.helpers import random_offsets

    rng = np.random.default_rng(seed)
    offs = random_offsets(B, 70, seed=seed)
    ids_c1 = rng.integers(0, 700, 70).astype(np.int32)
    w_c1 = rng.standard_normal(70).astype(np.float32)
    ids_d = rng.integers(0, 900, 60).astype(np.int32)
    seg_d = rng.integers(-1, B + 1, 60).astype(np.int32)  # -1 and B: dropped
    glob = {
        "a": rng.integers(0, 500, B).astype(np.int32),
        "b": rng.integers(-3, 3003, (B, 5)).astype(np.int32),  # some out of range
        "c1": {"ids": ids_c1, "offsets": offs, "weights": w_c1},
        "c2": {"ids": rng.integers(0, 700, (B, 3)).astype(np.int32), "mask": rng.random((B, 3)) < 0.7},
        "d": {"ids": ids_d, "segment_ids": seg_d},
        "e": rng.integers(0, 11, (B, 2)).astype(np.int32),
    }
    split = dict(glob)
    split["c1"] = shard_bags(ids_c1, offsets=offs, weights=w_c1, num_shards=num_shards, capacity=70)
    split["d"] = _segments_per_shard(ids_d, seg_d, num_shards)
    if csr_only:  # ids past offsets[-1]: padding (fixed shapes)
        whole = shard_bags(ids_d, segment_ids=seg_d, num_bags=B, num_shards=1, capacity=60)
        glob["d"] = {"ids": whole["ids"][0], "offsets": whole["offsets"][0]}
        split["d"] = shard_bags(
            glob["d"]["ids"], offsets=glob["d"]["offsets"], num_shards=num_shards, capacity=60
        )
    return glob, split


def _with_num_bags(feats: dict) -> dict:
    """Segment-form "d" with its static bag count (global B; a sharded collection divides it)."""
    if "segment_ids" not in feats["d"]:
        return feats
    return {**feats, "d": {**feats["d"], "num_bags": B}}


def _model(rngs):
    """A small DLRM-like model: the collection, a dense input, a linear head."""
    import jax.numpy as jnp
    from flax import nnx

    from flowtt_jax.nnx import TTEmbeddingCollection

    class Model(nnx.Module):
        def __init__(self):
            self.emb = TTEmbeddingCollection(_tables(), rngs=rngs)
            self.bottom = nnx.Linear(4, 8, rngs=rngs)
            self.head = nnx.Linear(8 + 4 * 16 + 8 + 16, 1, rngs=rngs)

        def __call__(self, dense, feats):
            e = self.emb(feats)
            x = [jnp.tanh(self.bottom(dense))] + [e[n] for n in ("a", "b", "c1", "c2", "d", "e")]
            return self.head(jnp.concatenate(x, axis=1))[:, 0]

    return Model()


def _loss(model, dense, feats, labels):
    import optax

    return optax.sigmoid_binary_cross_entropy(model(dense, feats), labels).mean()


def _train_batch(step: int, num_shards: int) -> tuple:
    glob, split = _batch(100 + step, num_shards, csr_only=True)
    rng = np.random.default_rng(step)
    dense = rng.standard_normal((B, 4)).astype(np.float32)
    labels = (rng.random(B) < 0.4).astype(np.float32)
    return (dense, glob, labels), (dense, split, labels)


def _train(template, strategy: str | None, mesh, process_slice=lambda x: x) -> tuple[list[float], str]:
    """(loss per step, compiled step HLO) of ``STEPS`` Adam steps from the model in
    ``template = nnx.split(model)``: unsharded (``strategy=None``, the global batch on one
    device) or through ``make_train_step`` with ``strategy`` "data" | "table"."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from flowtt_jax import sharding as sh

    graphdef, state = template
    model = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))  # the step donates its state
    shards = mesh.shape["data"] if mesh is not None else 1
    if strategy == "table":
        sample = _train_batch(0, shards)[0][1]
        sh.shard_collection(
            model.emb, mesh, placement=sh.place_tables(sh.table_costs(model.emb.layout, sample), shards)
        )
    elif strategy == "data":
        sh.shard_collection(model.emb, mesh)
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    if strategy is None:

        @jax.jit
        def step(state, *batch):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(_loss)(model, *batch)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss

    else:
        state = sh.place_state(state, mesh)
        step = sh.make_train_step(graphdef, _loss, mesh)
    batches = []
    for i in range(STEPS):
        glob, split = _train_batch(i, shards)
        batches.append(glob if strategy is None else sh.shard_batch(jax.tree.map(process_slice, split), mesh))
    if strategy is not None:
        _assert_no_empty_shard_map_values(step.trace(state, *batches[0]).jaxpr)
    compiled = step.lower(state, *batches[0]).compile()
    losses = []
    for batch in batches:
        state, loss = compiled(state, *batch)
        losses.append(float(loss))
    return losses, compiled.as_text()


def _assert_no_empty_shard_map_values(closed_jaxpr) -> None:
    """No zero-size value enters or leaves a ``shard_map`` of the step (jaxprs walked
    recursively): one between the forward's and the backward's bodies (an empty residual)
    crashed XLA's GPU SPMD partitioner at compile time (jax 0.11.2, 2 H200s)."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "shard_map":
                for v in [*eqn.invars, *eqn.outvars]:
                    shape = getattr(v.aval, "shape", ())
                    assert math.prod(shape) > 0, (eqn.primitive.name, shape, str(eqn)[:300])
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(closed_jaxpr.jaxpr)


def _collectives(text: str) -> dict[str, int]:
    return {
        c: len(re.findall(rf"\b{c}(-start)?\(", text)) for c in ("all-gather", "all-reduce", "all-to-all")
    }


def _check_collection() -> None:
    """8 devices: both strategies' forward and gradients equal one device's, their HLO,
    table-wise storage, training steps and predictions."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from flowtt_jax import sharding as sh
    from flowtt_jax.ops.pooled import kernels_unsupported_reason
    from tests.helpers import assert_no_host_callback, rel_err

    assert len(jax.devices()) == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("data",))
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    template = nnx.split(_model(nnx.Rngs(0)))
    emb = nnx.merge(*template).emb
    layout, params = emb.layout, {k: v[...] for k, v in emb.params.items()}
    glob, split = _batch(0, 8)
    batch = jax.tree.map(lambda x: put(x, P("data")), split)
    names = sorted(glob)

    def loss_of(apply, p, batch, w):
        out = apply(p, _with_num_bags({**batch, "c1": {**batch["c1"], "weights": w}}))
        return sum(jnp.sum(jnp.sin(out[k]) * (i + 1)) for i, k in enumerate(names))

    ref_w = jnp.asarray(glob["c1"]["weights"])
    ref = jax.jit(lambda p: layout.apply(p, _with_num_bags(glob)))(params)
    ref_g, ref_gw = jax.jit(jax.grad(lambda p, w: loss_of(layout.apply, p, glob, w), argnums=(0, 1)))(
        params, ref_w
    )

    def weights_grad(gw):  # per-shard [8, C] -> the global ids' order
        gw, offs, out = np.asarray(gw), glob["c1"]["offsets"], np.zeros(70, np.float32)
        for s in range(8):
            lo, hi = offs[s * B // 8], offs[(s + 1) * B // 8]
            out[lo:hi] = gw[s, : hi - lo]
        return out

    placement = sh.place_tables(sh.table_costs(layout, _with_num_bags(glob)), 8)
    dp = sh.collection_data_parallel(layout, mesh)
    tw = sh.collection_table_wise(layout, mesh, placement)
    w = batch["c1"]["weights"]
    kernels = kernels_unsupported_reason(layout=layout.packs[0].layout) is None
    for name, lay, p in (
        ("data", dp, put(params, P())),
        ("table", tw, {k: put(v, tw.param_specs()[k]) for k, v in tw.shard_params(params).items()}),
    ):
        fwd = jax.jit(lambda p, b, a=lay.apply: a(p, _with_num_bags(b))).lower(p, batch).compile()
        grad = jax.jit(jax.grad(lambda p, w, a=lay.apply: loss_of(a, p, batch, w), argnums=(0, 1)))
        grad = grad.lower(p, w).compile()
        out = fwd(p, batch)
        for k in names:
            assert out[k].shape == ref[k].shape and out[k].sharding.spec[0] == "data", (name, k)
            assert rel_err(out[k], ref[k]) < 1e-6, (name, k, rel_err(out[k], ref[k]))
        g, gw = grad(p, w)
        if name == "table":
            assert all(g[k].sharding.spec[0] == "data" for k in g if k.startswith("tt")), name
            g = tw.gather_params(g)
        for k in ref_g:
            assert rel_err(g[k], ref_g[k]) < 1e-5, (name, k, rel_err(g[k], ref_g[k]))
        assert rel_err(weights_grad(gw), ref_gw) < 1e-5, name

        fwd_text, grad_text = fwd.as_text(), grad.as_text()
        fwd_coll, grad_coll = _collectives(fwd_text), _collectives(grad_text)
        print(name, "forward", fwd_coll, "gradient", grad_coll)
        assert fwd_coll["all-gather"] == grad_coll["all-gather"] == 0, (name, fwd_coll, grad_coll)
        assert_no_host_callback(grad_text)
        # the kernels when this build has them (else the shape groups run the reference):
        # one pooling call per shape group (the table-batched pooling, or the fused
        # single-table forward of a one-table group; a table-wise device slot is padded,
        # so always table-batched)
        pools = re.findall(r"= f32\[(\d+),\d+\]\S* custom-call\([^\n]*\"flowtt_bag_(?:pool_)?fwd\"", fwd_text)
        single = re.findall(r"custom-call\([^\n]*\"flowtt_bag_fwd\"", fwd_text)
        assert len(single) == (1 if kernels and name == "data" else 0), (name, single)
        assert len(pools) == (2 if kernels else 0), pools
        if name == "data":
            # no collective in the forward: each device pools its own bags (2 per feature)
            assert fwd_coll == {"all-gather": 0, "all-reduce": 0, "all-to-all": 0}
            assert grad_coll["all-reduce"] >= 1 and grad_coll["all-to-all"] == 0
            assert {int(x) for x in pools} <= {2 * 4, 2 * 1}, pools
        else:
            # 4 all_to_all per shape group forward (ids, weights, counts, pooled); the
            # replicated dense table's gradient is the only all-reduce
            assert fwd_coll == {"all-gather": 0, "all-reduce": 0, "all-to-all": 8}, fwd_coll
            assert grad_coll["all-to-all"] > 8 and grad_coll["all-reduce"] == 1, grad_coll
    # table-wise storage: a table's cores are where the placement says, nowhere else
    tp = jax.jit(tw.shard_params)(params)
    assert tp[layout.param_names(0)[0]].shape[0] == 8
    for t in ("a", "b", "c", "d"):
        for x, y in zip(tw.table_params(tp, t), layout.table_params(params, t)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # whole-model steps: the loss trajectory of one device, no all-gather
    ref_losses, _ = _train(template, None, None)
    for strategy in ("data", "table"):
        losses, text = _train(template, strategy, mesh)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
        coll = _collectives(text)
        print(strategy, "step", coll)
        assert coll["all-gather"] == 0 and coll["all-reduce"] >= 1, coll
        assert (coll["all-to-all"] > 0) == (strategy == "table"), coll

    # predictions through sharded_call, then unshard_collection: the plain model's
    model = nnx.merge(*template)
    sh.shard_collection(model.emb, mesh, placement=placement)
    dense, feats, _ = _train_batch(0, 8)[0]
    sharded = _train_batch(0, 8)[1]
    pred = jax.jit(sh.sharded_call(lambda m, d, f: m(d, f), mesh))(model, *sh.shard_batch(sharded[:2], mesh))
    sh.unshard_collection(model.emb)
    want = nnx.jit(lambda m, d, f: m(d, f))(model, dense, feats)
    np.testing.assert_allclose(np.asarray(pred), np.asarray(want), rtol=1e-5, atol=1e-6)
    _check_packed_group(mesh)
    print("collection sharding OK")


def _check_packed_group(mesh) -> None:
    """One shape group's packed batch (20 tables, modes, weights, out-of-range ids): both
    strategies' outputs and gradients equal ``tt_embedding_bag_group`` on one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.workloads import MetaLikeCollection
    from flowtt_jax import sharding as sh
    from flowtt_jax import tt_embedding_bag_group
    from flowtt_jax.kernels.group_plan import GroupLayout
    from tests.helpers import rel_err

    w = MetaLikeCollection.create(20, rows_range=(1e3, 1e5), dim=16, rank=8).draw(B)
    layout, nf, tables = GroupLayout(w.specs), w.num_features, w.feature_table
    packed = tuple(
        0.3 * jax.random.normal(jax.random.key(k), s) for k, s in enumerate(layout.packed_shapes())
    )
    weights = np.random.default_rng(0).standard_normal(w.nnz).astype(np.float32)
    ids = w.ids.copy()
    ids[::97] = -5
    modes = tuple(("sum", "mean", "sqrtn")[f % 3] for f in range(nf))

    def loss(apply, p, *batch, weights):
        out = apply(p, *batch, weights=weights, mode=modes)
        return jnp.sum(jnp.sin(out) * jnp.linspace(0.0, 1.0, out.size).reshape(out.shape))

    def one(p, ids, offsets, weights, mode):
        return tt_embedding_bag_group(p, layout, ids, offsets, tables, weights=weights, mode=mode)

    ref = one(packed, ids, w.offsets, weights, modes)
    ref_g, ref_gw = jax.grad(lambda p, wt: loss(one, p, ids, w.offsets, weights=wt), argnums=(0, 1))(
        packed, weights
    )
    split = sh.shard_packed(ids, w.offsets, nf, 8, weights=weights)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    batch = {k: put(v, P("data")) for k, v in split.items()}
    positions = np.zeros(split["ids"].shape, np.int64)  # each per-shard slot's global position
    per, o = B // 8, w.offsets
    for s in range(8):
        index = np.concatenate([np.arange(o[f * B + s * per], o[f * B + (s + 1) * per]) for f in range(nf)])
        positions[s, : index.size] = index
        assert index.size == split["offsets"][s, -1]
    placement = sh.place_tables(sh.group_costs(layout, ids, w.offsets, tables), 8)
    dp = sh.GroupDataParallel(layout, tables, mesh)
    tw = sh.GroupTableWise(layout, tables, placement, mesh)
    for name, obj, p in (
        ("data", dp, put(packed, P())),
        ("table", tw, put(tw.shard_params(packed), P("data"))),
    ):
        out = jax.jit(
            lambda p, b, a=obj.apply: a(p, b["ids"], b["offsets"], weights=b["weights"], mode=modes)
        )(p, batch)
        assert out.shape == ref.shape and out.sharding.spec[1] == "data" and rel_err(out, ref) < 1e-6, name
        grad = jax.jit(
            jax.grad(
                lambda p, wt, a=obj.apply: loss(a, p, batch["ids"], batch["offsets"], weights=wt), (0, 1)
            )
        )
        grad = grad.lower(p, batch["weights"]).compile()
        g, gw = grad(p, batch["weights"])
        g = tw.gather_params(g) if name == "table" else g
        assert all(rel_err(a, b) < 1e-5 for a, b in zip(g, ref_g)), name
        gw = np.asarray(gw)
        for s in range(8):
            n = split["offsets"][s, -1]
            np.testing.assert_allclose(gw[s, :n], np.asarray(ref_gw)[positions[s, :n]], rtol=1e-4, atol=1e-6)
        coll = _collectives(grad.as_text())
        print("packed group", name, coll)
        assert coll["all-gather"] == 0 and (coll["all-to-all"] > 0) == (name == "table"), coll
        assert (coll["all-reduce"] > 0) == (name == "data"), coll
    # table-wise buffers sized to the batch: the same numbers; one position short: NaN, not wrong
    need = tw.needed_capacity(split["offsets"])
    fwd = jax.jit(
        lambda p, b, capacity: tw.apply(
            p, b["ids"], b["offsets"], weights=b["weights"], mode=modes, capacity=capacity
        ),
        static_argnums=2,
    )
    assert need < split["ids"].shape[1] and rel_err(fwd(p, batch, need), ref) < 1e-6
    short = np.asarray(fwd(p, batch, need - 1))
    assert np.isnan(short).any() and np.isfinite(short).any()
    # every id dtype: uint32 ids past 2^31 and host int64 ids past int32 are out of range in
    # both strategies, as in the single-device op (table-wise compared them in their dtype)
    for dtype, far in (("uint32", 3_000_000_000), ("int64", 2**40 + 5)):
        odd = ids.astype(dtype)
        odd[::5] = far
        for oob in ("clip", "zero"):
            want = tt_embedding_bag_group(packed, layout, odd, w.offsets, tables, oob=oob)
            part = sh.shard_packed(odd, w.offsets, nf, 8)
            for name, obj, p in (
                ("data", dp, put(packed, P())),
                ("table", tw, put(tw.shard_params(packed), P("data"))),
            ):
                got = obj.apply(p, put(part["ids"], P("data")), put(part["offsets"], P("data")), oob=oob)
                assert rel_err(got, want) < 1e-6, (dtype, oob, name)


@pytest.mark.slow
def test_collection_over_eight_devices():
    code = "from tests import test_sharding_collection as t; t._check_collection()"
    [(returncode, out)] = _run_workers([(code, _cpu_env(cpu_devices=8))], timeout=900)
    assert returncode == 0 and "collection sharding OK" in out, out[-10000:]


def _train_worker(process_id: int, num_processes: int, port: int) -> None:
    """Prints the loss trajectories of both strategies as JSON: 2 processes x 2 CPU
    devices (each process feeds its half of every batch), or one unsharded process."""
    import jax
    from flax import nnx

    if num_processes == 1:
        print("LOSSES " + json.dumps({"single": _train(nnx.split(_model(nnx.Rngs(0))), None, None)[0]}))
        return
    _start_distributed(process_id, num_processes, port)
    assert jax.process_count() == 2 and jax.device_count() == 4
    mesh = jax.make_mesh((4,), ("data",))
    half = lambda x: np.split(x, 2)[process_id]  # this process's dim-0 half of every leaf
    template = nnx.split(_model(nnx.Rngs(0)))
    out = {s: _train(template, s, mesh, half)[0] for s in ("data", "table")}
    jax.distributed.shutdown()
    print("LOSSES " + json.dumps(out))


@pytest.mark.slow
def test_train_step_across_two_processes():
    port = _free_port()
    code = "from tests import test_sharding_collection as t; t._train_worker({}, {}, {})"
    runs = [(i, 2) for i in range(2)] + [(0, 1)]
    workers = [(code.format(i, n, port), _cpu_env(cpu_devices=1 if n == 1 else None)) for i, n in runs]
    losses = []
    for returncode, out in _run_workers(workers, timeout=600):
        lines = [line for line in out.splitlines() if line.startswith("LOSSES ")]
        assert returncode == 0 and lines, out[-3000:]
        losses.append(json.loads(lines[-1][7:]))
    single = losses[2]["single"]
    assert len(single) == STEPS
    for run in losses[:2]:
        for strategy in ("data", "table"):
            np.testing.assert_allclose(run[strategy], single, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- host side
def test_shard_bags_and_shard_packed_split_bags_per_shard():
    from flowtt_jax.sharding import shard_bags, shard_packed

    ids = np.arange(10, dtype=np.int32) + 100
    offsets = np.array([1, 3, 3, 6, 9])  # position 0 and 9 in no bag
    out = shard_bags(ids, offsets=offsets, weights=np.ones(10, np.float32), num_shards=2)
    np.testing.assert_array_equal(out["offsets"], [[0, 2, 2], [0, 3, 6]])
    np.testing.assert_array_equal(out["ids"], [[101, 102, 0, 0, 0, 0], [103, 104, 105, 106, 107, 108]])
    np.testing.assert_array_equal(out["weights"][0], [1, 1, 0, 0, 0, 0])
    seg = np.array([3, 0, 9, 2, 0, 1, 3, 3, -1, 2])  # 9 and -1: dropped
    by_seg = shard_bags(ids, segment_ids=seg, num_bags=4, num_shards=2, capacity=6)
    np.testing.assert_array_equal(by_seg["offsets"], [[0, 2, 3], [0, 2, 5]])
    np.testing.assert_array_equal(by_seg["ids"], [[101, 104, 105, 0, 0, 0], [103, 109, 100, 106, 107, 0]])
    with pytest.raises(ValueError, match="capacity"):
        shard_bags(ids, offsets=offsets, num_shards=2, capacity=2)
    # the packed form: F = 2 features x B = 4 bags, feature-major
    packed = shard_packed(ids, np.array([0, 1, 3, 3, 4, 6, 7, 9, 10]), num_features=2, num_shards=2)
    np.testing.assert_array_equal(packed["offsets"], [[0, 1, 3, 5, 6], [0, 0, 1, 3, 4]])
    np.testing.assert_array_equal(packed["ids"] - 100, [[0, 1, 2, 4, 5, 6], [3, 7, 8, 9, -100, -100]])
    with pytest.raises(ValueError, match="equal shards"):
        shard_bags(ids, offsets=offsets, num_shards=3)
    # host int64 ids past int32 (no x64): saturated, so out of range on the device, not
    # wrapped by device_put (2^40 + 5 would read row 5)
    wide = np.array([2**40 + 5, 7, -(2**40)], np.int64)
    for split in (
        shard_bags(wide, offsets=np.array([0, 1, 3]), num_shards=2)["ids"],
        shard_packed(wide, np.array([0, 1, 3]), num_features=1, num_shards=2)["ids"],
    ):
        assert split.dtype == np.int32
        assert sorted(split[split != 0].tolist()) == [-(2**31), 7, 2**31 - 1]
    for shard in (
        lambda: shard_bags(np.arange(4), num_shards=0, offsets=np.array([0, 2, 4])),
        lambda: shard_packed(np.arange(4), np.array([0, 2, 4]), 1, 0),
    ):
        with pytest.raises(ValueError, match="num_shards must be an int >= 1, got 0"):
            shard()


def test_costs_see_the_input_and_placement_balances_them():
    from flowtt_jax.collection import TableConfig
    from flowtt_jax.collection.layout import CollectionLayout
    from flowtt_jax.sharding import (
        TableCost,
        TableWisePlacement,
        collection_data_parallel,
        group_costs,
        place_tables,
        shard_packed,
        table_costs,
    )

    layout = CollectionLayout(tuple(TableConfig(f"t{i}", 10_000, 16, rank=8) for i in range(4)))
    rng = np.random.default_rng(0)
    sample = {
        "t0": np.full((256, 4), 7),  # one hot id
        "t1": rng.integers(0, 10_000, (256, 4)),  # uniform: ~1000 unique ids
        "t2": {"ids": rng.integers(0, 100, 50), "offsets": np.linspace(0, 50, 257).astype(int)},
        "t3": rng.integers(0, 10_000, (256, 1)),
    }
    costs = {c.name: c for c in table_costs(layout, sample)}
    assert (costs["t0"].nnz, costs["t0"].unique, costs["t0"].prefixes) == (1024, 1, 1)
    assert costs["t1"].unique == np.unique(sample["t1"]).size and costs["t1"].nnz == 1024
    assert costs["t2"].nnz == 50
    # same table sizes and id counts, different reuse: the uniform table costs more
    assert costs["t1"].cost > 2 * costs["t0"].cost
    placement = place_tables(costs.values(), 2)
    # t1 outweighs the other three together: alone on its device (by size: 2 and 2)
    assert placement.device("t1") not in {placement.device(t) for t in ("t0", "t2", "t3")}
    assert placement.imbalance < 1.5
    # LPT on given costs: 7 | 5 + 2 ... heaviest first, each to the least loaded device
    given = [TableCost(n, 0, 0, 0, c) for n, c in zip(("t0", "t1", "t2", "t3"), (5.0, 7.0, 2.0, 4.0))]
    lpt = place_tables(given, 2)
    assert lpt.devices == (1, 0, 0, 1) and lpt.loads == (9.0, 9.0) and lpt.imbalance == 1.0
    with pytest.raises(ValueError, match="table 't2' is placed on device 7: the axis has 4 devices"):
        TableWisePlacement(4, ("t0", "t2"), (0, 7))
    with pytest.raises(ValueError, match="num_devices must be an int >= 1, got 0"):
        place_tables(given, 0)
    mesh = jax.make_mesh((1,), ("model",))
    with pytest.raises(ValueError, match=r"mesh axis 'data' is not an axis of the mesh \('model',\)"):
        collection_data_parallel(layout, mesh)
    # a packed shape group: the same estimates from the global batch and from its shards
    group = layout.packs[0].layout
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 5, 3 * 8))])
    ids = rng.integers(-2, 10_002, offsets[-1])  # a few out of range: not counted
    whole = group_costs(group, ids, offsets, (2, 0, 2))
    split = shard_packed(ids, offsets, 3, 4)
    assert group_costs(group, split["ids"], split["offsets"], (2, 0, 2)) == whole
    inside = (ids >= 0) & (ids < 10_000)
    assert whole[2].nnz == inside[: offsets[8]].sum() + inside[offsets[16] :].sum() and whole[1].nnz == 0


def test_oob_error_on_a_sharded_collection_names_the_feature():
    """oob="error" on a sharded collection: valid ids pool as oob="zero" does, invalid ones
    raise naming the feature and table, eagerly and under jit through ftt.checked (a
    1-device mesh in this process: the check runs before the shard_map either way)."""
    from jax.experimental import checkify

    import flowtt_jax as ftt
    from flowtt_jax.collection import TableConfig
    from flowtt_jax.collection.layout import CollectionLayout
    from flowtt_jax.sharding import collection_data_parallel

    layout = CollectionLayout((TableConfig("a", 1000, 8, rank=4), TableConfig("b", 50, 8, kind="dense")))
    dp = collection_data_parallel(layout, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
    params = layout.init(jax.random.key(0))
    good = {"a": np.array([[1, 999], [5, 6]]), "b": np.array([3, 49])}
    stacked = np.array([[1, 3], [999, 49]])
    # the unsharded values: one program (op by op before), the ids closed over as in the eager calls
    want, want_stacked = jax.jit(lambda p: (layout.apply(p, good), layout.apply_stacked(p, stacked)))(params)
    for got in (
        dp.apply(params, good, oob="error"),
        ftt.checked(lambda p, f: dp.apply(p, f, oob="error"))(params, good),
    ):
        for name in good:
            np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(dp.apply_stacked(params, stacked, oob="error")), np.asarray(want_stacked), rtol=1e-6
    )
    bad = {**good, "b": np.array([3, 50])}
    with pytest.raises(
        ValueError, match=r"feature 'b' \(table 'b'\): ids out of range \[0, 50\), e.g. \[50\]"
    ):
        dp.apply(params, bad, oob="error")
    with pytest.raises(
        checkify.JaxRuntimeError, match=r"feature 'b' \(table 'b'\): ids out of range \[0, 50\): found 50"
    ):
        ftt.checked(lambda p, f: dp.apply(p, f, oob="error"))(params, bad)
    with pytest.raises(ValueError, match=r"feature 'a' \(table 'a'\)"):
        dp.apply_stacked(params, np.array([[1000, 3], [999, 49]]), oob="error")


def _check_oob_error_over_devices() -> None:
    """oob="error" over 4 devices (a worker): the sharded collection (feature dict and
    stacked ids) and GroupDataParallel, eagerly (ValueError) and under ftt.checked (the
    check after the shard_map: checkify cannot carry an error into one over 4 devices)."""
    from jax.experimental import checkify
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flowtt_jax as ftt
    from flowtt_jax import sharding as sh
    from flowtt_jax.collection import TableConfig
    from flowtt_jax.collection.layout import CollectionLayout

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    layout = CollectionLayout((TableConfig("a", 1000, 8, rank=4), TableConfig("b", 50, 8, kind="dense")))
    dp = sh.collection_data_parallel(layout, mesh)
    params = layout.init(jax.random.key(0))
    good = {"a": np.arange(8).reshape(4, 2) * 100, "b": np.array([3, 49, 1, 2])}
    want = layout.apply(params, good)
    got = ftt.checked(lambda p, f: dp.apply(p, f, oob="error"))(params, good)
    for name in good:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-6)
    bad = {**good, "b": np.array([3, 50, 1, 2])}
    with pytest.raises(checkify.JaxRuntimeError, match=r"feature 'b' \(table 'b'\): ids out of range"):
        ftt.checked(lambda p, f: dp.apply(p, f, oob="error"))(params, bad)
    with pytest.raises(checkify.JaxRuntimeError, match=r"feature 'a' \(table 'a'\)"):
        ftt.checked(lambda p, i: dp.apply_stacked(p, i, oob="error"))(params, np.array([[1000, 3]] * 4))

    # the nnx collection sharded over an explicit mesh, its batch split over it (ids typed
    # i32[8@data]: the check takes no dynamic slice of them)
    from flax import nnx

    from flowtt_jax.nnx import TTEmbeddingCollection

    explicit = jax.make_mesh((4,), ("data",))
    coll = TTEmbeddingCollection(layout.tables, oob="error", rngs=nnx.Rngs(0))
    coll.params.update({k: nnx.Param(v) for k, v in params.items()})
    sh.shard_collection(coll, explicit)
    flat = {"a": np.arange(8) * 100, "b": np.array([3, 49, 1, 2, 0, 7, 8, 9])}
    call = ftt.checked(lambda m, f: m(f))
    got = call(coll, sh.shard_batch(flat, explicit))
    want = layout.apply(params, flat)
    for name in flat:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-6)
    with pytest.raises(checkify.JaxRuntimeError, match=r"feature 'b' \(table 'b'\).*found 57"):
        call(coll, sh.shard_batch({**flat, "b": np.array([3, 49, 1, 57, 0, 7, 8, -2])}, explicit))

    specs = (ftt.TTSpec.create(100, 8, 4), ftt.TTSpec.create(300, 8, 4))
    group = ftt.GroupLayout(specs)
    packed = group.pack([ftt.init_cores(jax.random.key(t), s) for t, s in enumerate(specs)])
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 4, 2 * 8)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    ids = np.concatenate([rng.integers(0, 100, lens[:8].sum()), rng.integers(0, 300, lens[8:].sum())])
    split = sh.shard_packed(ids, offsets, 2, 4, capacity=int(lens.sum()))  # padded shards
    gdp = sh.GroupDataParallel(group, (0, 1), mesh)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    p, i, o = put(packed, P()), put(split["ids"], P("data")), put(split["offsets"], P("data"))
    ref = gdp.apply(p, i, o, oob="zero")
    np.testing.assert_allclose(np.asarray(gdp.apply(p, i, o, oob="error")), np.asarray(ref), rtol=1e-6)
    checked = ftt.checked(lambda p, i, o: gdp.apply(p, i, o, oob="error"))
    np.testing.assert_allclose(np.asarray(checked(p, i, o)), np.asarray(ref), rtol=1e-6)
    shard = next(s for s in range(4) if split["offsets"][s, 1] > 0)  # its first id: feature 0 (100 rows)
    wrong = split["ids"].copy()
    wrong[shard, 0] = 250
    with pytest.raises(ValueError, match=f"id 250 at shard {shard}, position 0 \\(100 rows\\)"):
        gdp.apply(p, put(wrong, P("data")), o, oob="error")
    with pytest.raises(checkify.JaxRuntimeError, match="found 250"):
        checked(p, put(wrong, P("data")), o)
    print("oob error over devices OK")


def test_oob_error_over_four_devices():
    code = "from tests import test_sharding_collection as t; t._check_oob_error_over_devices()"
    [(returncode, out)] = _run_workers([(code, _cpu_env(cpu_devices=4))], timeout=600)
    assert returncode == 0 and "oob error over devices OK" in out, out[-10000:]


def test_load_table_into_a_table_wise_collection_on_an_explicit_mesh():
    """load_table / from_dense on a table-wise collection over ``jax.make_mesh`` (explicit
    axes: the stacked cores' update says its sharding), 1 device in this process."""
    from flax import nnx

    from flowtt_jax import sharding as sh
    from flowtt_jax.collection import TableConfig
    from flowtt_jax.nnx import TTEmbeddingCollection

    shapes = dict(rank=4, row_shape=(10, 10, 10), col_shape=(2, 2, 2))
    coll = TTEmbeddingCollection(
        [TableConfig("a", 1000, 8, **shapes), TableConfig("b", 1000, 8, **shapes)], rngs=nnx.Rngs(0)
    )
    donor = TTEmbeddingCollection([TableConfig("a", 1000, 8, **shapes)], rngs=nnx.Rngs(7))
    feats = {"a": np.array([1, 2]), "b": np.array([3, 4])}
    placement = sh.place_tables(sh.table_costs(coll.layout, feats), 1)
    sh.shard_collection(coll, jax.make_mesh((1,), ("data",)), placement=placement)
    before_b = np.asarray(coll.to_dense("b"))
    coll.load_table("a", donor.cores("a"))
    np.testing.assert_array_equal(np.asarray(coll.to_dense("a")), np.asarray(donor.to_dense("a")))
    np.testing.assert_array_equal(np.asarray(coll.to_dense("b")), before_b)
    error = coll.from_dense("b", np.asarray(donor.to_dense("a")))
    assert error < 1e-4  # donor's table has TT rank 4: exact at rank 4, to float32 rounding
