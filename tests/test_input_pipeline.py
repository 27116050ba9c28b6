"""Every input form through the one input pipeline (``flowtt_jax.inputs.batch``), pinned
bit for bit on CPU to the values the collection gave before the pipeline was one
(recorded at cd05814): outputs and gradients (parameters and per-id weights) of each form
(feature dict of CSR / padded / one-id / masked / segment-id features, mixed batch sizes,
traced offsets, ``KeyedJagged`` by lengths or offsets, stacked ids, unpooled lookups,
every ``oob`` policy), on a collection of a TT shape group, two dense tables, a 2-core
table and a table shared by two features, packs in another order than the features.

Recording: ``FLOWTT_GOLDEN_RECORD=DIR python -m pytest -n 0 --slow tests/test_input_pipeline.py``
writes ``DIR/pipeline_cpu_<machine>.json`` (SHA-256 of each array's bytes, with its shape
and dtype); a machine without a checked-in file skips."""

from __future__ import annotations

import hashlib
import json
import os
import platform as host_platform
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from flowtt_jax import KeyedJagged
from flowtt_jax.collection import TableConfig
from flowtt_jax.collection.layout import CollectionLayout

GOLDEN = Path(__file__).resolve().parent / "golden" / f"pipeline_cpu_{host_platform.machine()}.json"
B = 5
DIM = 8


def tables() -> list[TableConfig]:
    """Packs in another order than the features (a TT group, a dense pack, a 2-core table),
    a table shared by two features, every mode: the pinned values' tables (also
    ``test_collection_stacked``'s and ``test_collection_jagged``'s; another size changes the
    pins)."""
    return [
        TableConfig("a", 1000, DIM, rank=4, mode="mean"),
        TableConfig("d", 50, DIM, kind="dense"),
        TableConfig("b", 3000, DIM, rank=4, mode="sqrtn", feature_names=("b1", "b2")),
        TableConfig("two", 300, DIM, rank=4, num_cores=2),
        TableConfig("d2", 40, DIM, kind="dense", mode="mean"),
        TableConfig("c", 77, DIM, rank=4),
    ]


def _layout() -> CollectionLayout:
    return CollectionLayout(tuple(tables()))


def _rows(layout) -> dict[str, int]:
    return {f: t.num_embeddings for t in layout.tables for f in t.feature_keys}


def _dev(x, dtype) -> jax.Array:
    """``x`` as a device array of ``dtype``, converted on the host: ``jnp.asarray`` compiles
    a copy program for each new shape."""
    return jax.device_put(np.asarray(x, dtype))


def _csr(rng, rows: int, batch: int, weighted: bool) -> dict:
    lengths = rng.integers(0, 5, batch)
    lengths[rng.random(batch) < 0.25] = 0
    ids = rng.integers(0, rows, int(lengths.sum()))
    if ids.size > 1:
        ids[0], ids[-1] = rows - 1, rows + 2  # the last row; out of range
    out = {"ids": _dev(ids, np.int32), "offsets": _dev(np.r_[0, np.cumsum(lengths)], np.int32)}
    if weighted:
        out["weights"] = _dev(rng.uniform(0.5, 1.5, ids.size), np.float32)
    return out


def _padded(rng, rows: int, batch: int, length: int, weighted: bool) -> dict:
    ids = rng.integers(-1, rows + 1, (batch, length))
    out = {"ids": _dev(ids, np.int32)}
    if weighted:
        out["weights"] = _dev(rng.uniform(0.5, 1.5, ids.shape), np.float32)
    return out


def _forms(layout, seed: int) -> dict[str, tuple]:
    """``{case: (kind, inputs, call kwargs)}``; kind: "dict", "kjt", "stacked", "lookup"."""
    rng = np.random.default_rng(seed)
    rows = _rows(layout)
    names = layout.feature_names
    cases: dict[str, tuple] = {}
    cases["dict_csr"] = ("dict", {f: _csr(rng, rows[f], B, False) for f in names}, {})
    cases["dict_csr_weighted"] = ("dict", {f: _csr(rng, rows[f], B, True) for f in names}, {})
    cases["dict_padded_weighted"] = ("dict", {f: _padded(rng, rows[f], B, 3, True) for f in names}, {})
    one = {f: _dev(rng.integers(0, rows[f], B), np.int32) for f in names}
    cases["dict_one_id"] = ("dict", one, {})
    mixed = {}
    for i, f in enumerate(names):
        if i % 3 == 0:
            p = _padded(rng, rows[f], B, 4, i % 2 == 0)
            p["mask"] = _dev(rng.random((B, 4)) < 0.6, bool)
            mixed[f] = p
        elif i % 3 == 1:
            n = 9
            seg = {"ids": _dev(rng.integers(0, rows[f], n), np.int32)}
            seg["segment_ids"] = _dev(rng.integers(-1, B + 1, n), np.int32)
            seg["num_bags"] = B
            mixed[f] = seg
        else:
            mixed[f] = _csr(rng, rows[f], B, True)
    cases["dict_masked_segment_csr"] = ("dict", mixed, {})
    sizes = dict(cases["dict_csr"][1])
    sizes["c"] = _csr(rng, rows["c"], B + 2, False)  # another batch size
    sizes["two"] = _padded(rng, rows["two"], B + 2, 2, False)
    cases["dict_mixed_batch"] = ("dict", sizes, {})
    cases["dict_clip"] = ("dict", cases["dict_csr_weighted"][1], {"oob": "clip"})
    valid = {f: _csr(rng, rows[f], B, True) for f in names}
    for v in valid.values():
        v["ids"] = _dev(np.clip(np.asarray(v["ids"]), 0, None) % 40, np.int32)
    cases["dict_error_valid"] = ("dict", valid, {"oob": "error"})
    cases["dict_traced_offsets"] = ("jit_dict", cases["dict_csr_weighted"][1], {})
    feats = {f: {k: np.asarray(v) for k, v in cases["dict_csr_weighted"][1][f].items()} for f in names}
    ids = np.concatenate([feats[f]["ids"] for f in names])
    lengths = np.stack([np.diff(feats[f]["offsets"]) for f in names])
    kjt_ids, kjt_lengths = _dev(ids, np.int32), _dev(lengths, np.int32)
    cases["kjt_lengths"] = ("kjt", KeyedJagged(kjt_ids, lengths=kjt_lengths, keys=names), {})
    cases["kjt_offsets_weighted"] = (
        "kjt",
        KeyedJagged(
            kjt_ids,
            offsets=_dev(np.r_[0, np.cumsum(lengths.reshape(-1))], np.int32),
            weights=_dev(np.concatenate([feats[f]["weights"] for f in names]), np.float32),
        ),
        {},
    )
    tail = KeyedJagged(_dev(np.r_[ids, 7, 999], np.int32), lengths=kjt_lengths)
    cases["kjt_tail_clip"] = ("kjt", tail, {"oob": "clip"})
    stacked = rng.integers(-1, 45, (B, len(names), 3))
    cases["stacked_bfl_weighted"] = (
        "stacked",
        (_dev(stacked, np.int32), _dev(rng.uniform(0.5, 1.5, stacked.shape), np.float32)),
        {},
    )
    cases["stacked_bf"] = ("stacked", (_dev(stacked[:, :, 0], np.int32), None), {})
    look = {f: _dev(rng.integers(-1, rows[f] + 1, (B, 3)), np.int32) for f in names[:4]}
    look["c"] = {
        "ids": _dev(rng.integers(0, rows["c"], (4,)), np.int32),
        "weights": _dev(rng.uniform(0.5, 1.5, 4), np.float32),
    }
    cases["lookup_dict"] = ("lookup", look, {})
    cases["lookup_kjt_weighted"] = ("lookup", cases["kjt_offsets_weighted"][1], {})
    return cases


def _run(layout, params, kind: str, inputs, kw: dict, impl: str) -> dict[str, np.ndarray]:
    """The call's outputs and the gradients of a fixed random projection of them, under one
    ``jit`` whose integer inputs are closed over (concrete, as in an eager call) but for
    ``jit_dict`` (traced offsets)."""
    kw = {**kw, "impl": impl}
    leaves, tree = jax.tree.flatten(inputs)
    traced = [
        isinstance(x, jax.Array) and (kind == "jit_dict" or jnp.issubdtype(x.dtype, jnp.floating))
        for x in leaves
    ]

    def call(p, args):
        it = iter(args)
        inp = jax.tree.unflatten(tree, [next(it) if t else x for x, t in zip(leaves, traced)])
        if kind == "stacked":
            return layout.call(p, inp[0], inp[1], **kw)
        return layout.call(p, inp, pooled=kind != "lookup", **kw)

    def jitted(f):  # oob="error" checks on the device: checkify raises them
        if kw.get("oob") != "error":
            return jax.jit(f)
        checked = jax.jit(checkify.checkify(f))
        return lambda *a: (lambda err, out: (err.throw(), out)[1])(*checked(*a))

    args = [x for x, t in zip(leaves, traced) if t]
    out = jitted(call)(params, args)
    outs = jax.tree.leaves(out)
    rng = np.random.default_rng(1)
    cots = [_dev(rng.standard_normal(x.shape), x.dtype) for x in outs]

    def loss(p, a):
        return sum(jnp.vdot(c, x) for c, x in zip(cots, jax.tree.leaves(call(p, a))))

    grads, arg_grads = jitted(jax.grad(loss, argnums=(0, 1), allow_int=True))(params, args)
    res = {f"out{i}": np.asarray(x) for i, x in enumerate(outs)}
    # by parameter name less its digest (the layout's, pinned elsewhere: tests/test_nnx.py)
    res.update(
        {f"grad_{re.sub(r'_[0-9a-f]{8}(?=_|$)', '', k)}": np.asarray(v) for k, v in sorted(grads.items())}
    )
    res.update({f"arg_grad{i}": np.asarray(g) for i, g in enumerate(arg_grads) if g.dtype == jnp.float32})
    return res


def _digest(x: np.ndarray) -> str:
    return f"{x.dtype}{list(x.shape)}:" + hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:24]


CASES = tuple(_forms(_layout(), 0))
_PARAMS: dict = {}


def _params(layout):
    if "p" not in _PARAMS:
        _PARAMS["p"] = layout.init(jax.random.key(0))
    return _PARAMS["p"]


def _case_hashes(impl: str, case: str) -> dict[str, str]:
    layout = _layout()
    kind, inputs, kw = _forms(layout, 0)[case]
    return {k: _digest(v) for k, v in _run(layout, _params(layout), kind, inputs, kw, impl).items()}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", ["auto", pytest.param("reference", marks=pytest.mark.slow)])
def test_every_form_as_before_bitwise(impl, case):
    if jax.default_backend() != "cpu":
        pytest.skip("pinned on CPU")
    got = _case_hashes(impl, case)
    key = f"{impl}/{case}"
    record = os.environ.get("FLOWTT_GOLDEN_RECORD")
    if record:  # merged into what is there (xdist workers each write their cases)
        path = Path(record) / GOLDEN.name
        Path(record).mkdir(parents=True, exist_ok=True)
        have = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**have, key: got}, indent=1, sort_keys=True) + "\n")
    if not GOLDEN.exists():
        pytest.skip(f"no pinned values for this machine ({GOLDEN.name})")
    want = json.loads(GOLDEN.read_text())[key]
    assert sorted(got) == sorted(want)
    wrong = [k for k in want if got[k] != want[k]]
    assert not wrong, f"{key}: changed bits in {wrong}"


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_traced_offsets_leave_positions_in_no_bag(impl, seeds):
    """A dict call's traced offsets that leave a feature's positions outside its bags (first
    offset > 0, last < n, a decrease): clamped into the feature's ids, those positions in no
    bag: outputs, weight gradients (0 there) and out-of-range counts (ids there not counted)
    of the dict call given each feature's clamped slice, every pooling mode."""
    layout = _layout()
    params = _params(layout)
    rng = np.random.default_rng(next(seeds))
    rows = _rows(layout)
    feats, bad, want_feats, kept = {}, {}, {}, {}
    for f in layout.feature_names:
        v = _csr(rng, rows[f], B + 1, True)
        while np.asarray(v["offsets"])[-1] < 8:
            v = _csr(rng, rows[f], B + 1, True)
        v = {k: np.array(x) for k, x in v.items()}  # host copies: set-up, not op by op
        n = int(v["offsets"][-1])
        o, ids = v["offsets"], v["ids"]
        ids[0], ids[-1] = -5, rows[f] + 7  # out of range, in no bag: not counted
        ids[1], ids[-2] = 0, rows[f] - 1  # in range, in no bag: no row
        o[0], o[-1] = 2, n - 2
        o[3] = o[2] - 1  # a decrease: the running maximum
        fixed = np.maximum.accumulate(np.clip(o, 0, n))
        feats[f] = {"ids": _dev(ids, np.int32), "weights": _dev(v["weights"], np.float32)}
        bad[f] = _dev(o, np.int32)
        lo, hi = fixed[0], fixed[-1]
        want_feats[f] = {
            "ids": _dev(ids[lo:hi], np.int32),
            "offsets": _dev(fixed - lo, np.int32),
            "weights": _dev(v["weights"][lo:hi], np.float32),
        }
        kept[f] = (lo, hi)
    cot = {f: _dev(rng.standard_normal((B + 1, DIM)), np.float32) for f in feats}

    def loss(w, offsets, inputs):
        given = {
            f: {**inputs[f], "weights": w[f], **({} if offsets is None else {"offsets": offsets[f]})}
            for f in inputs
        }
        out, counts = layout.call(params, given, with_counts=True, impl=impl)
        return sum(jnp.vdot(cot[f], out[f]) for f in out), (out, counts.out_of_range)

    step = jax.jit(jax.grad(loss, has_aux=True))
    w_got = {f: feats[f]["weights"] for f in feats}
    g_got, (got, counts_got) = step(w_got, bad, feats)
    w_want = {f: want_feats[f]["weights"] for f in feats}
    g_want, (want, counts_want) = step(w_want, None, want_feats)
    for f in feats:
        np.testing.assert_allclose(np.asarray(got[f]), np.asarray(want[f]), rtol=1e-6, atol=1e-6, err_msg=f)
        lo, hi = kept[f]
        g = np.asarray(g_got[f])
        np.testing.assert_allclose(g[lo:hi], np.asarray(g_want[f]), rtol=1e-6, atol=1e-6, err_msg=f)
        assert not np.any(g[:lo]) and not np.any(g[hi:]), f
    np.testing.assert_array_equal(np.asarray(counts_got), np.asarray(counts_want))
