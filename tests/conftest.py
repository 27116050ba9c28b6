"""Shared test helpers: id distributions, fresh random cores, error measures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flowtt_jax as ftt

# The references compare at float32 accuracy: keep XLA's GPU matmuls out of TF32.
jax.config.update("jax_default_matmul_precision", "highest")

ID_KINDS = ("uniform", "zipf1.05", "zipf1.2", "all_equal", "last_row")


def make_ids(kind: str, n: int, num_embeddings: int, seed: int) -> np.ndarray:
    """int32 ids [n] drawn from a named distribution; hot ids scattered over the table."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        ids = rng.integers(0, num_embeddings, n)
    elif kind.startswith("zipf"):
        ranks = rng.zipf(float(kind[4:]), n) - 1
        ids = (ranks * 2654435761) % num_embeddings
    elif kind == "all_equal":
        ids = np.full(n, rng.integers(0, num_embeddings))
    elif kind == "last_row":
        ids = np.where(rng.random(n) < 0.5, num_embeddings - 1, rng.integers(0, num_embeddings, n))
    else:
        raise ValueError(kind)
    return ids.astype(np.int32)


def random_offsets(num_bags: int, n: int, seed: int, empty_fraction: float = 0.2) -> np.ndarray:
    """CSR offsets [num_bags + 1] over n ids with some empty bags."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, n + 1, num_bags - 1))
    offsets = np.concatenate([[0], cuts, [n]]).astype(np.int32)
    # Force some empty bags by repeating offsets.
    k = int(empty_fraction * num_bags)
    if k:
        idx = rng.choice(np.arange(1, num_bags), size=min(k, num_bags - 1), replace=False)
        offsets[idx] = offsets[idx - 1]
        offsets = np.maximum.accumulate(offsets)
    return offsets


def make_cores(spec: ftt.TTSpec, seed: int, dtype=jnp.float32):
    return ftt.init_cores(jax.random.key(seed), spec, std=1.0, dtype=dtype)


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite values"
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def custom_call_targets(compiled_text: str) -> set[str]:
    """Custom-call targets named in compiled HLO text (host callbacks show up here)."""
    import re

    return set(re.findall(r'custom_call_target="([^"]+)"', compiled_text))


def assert_no_host_callback(compiled_text: str) -> None:
    targets = custom_call_targets(compiled_text)
    assert not any("callback" in t for t in targets), targets


def poisoned_call(target: str, out_shapes, *args, **attrs):
    """``jax.ffi.ffi_call`` under jit with each output aliased to a poisoned buffer
    appended after ``args`` (NaN for floats, -7 for ints), so an unwritten element shows."""
    poison = [jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else -7, s.dtype)
              for s in out_shapes]
    aliases = {len(args) + k: k for k in range(len(out_shapes))}
    call = jax.ffi.ffi_call(target, tuple(out_shapes), input_output_aliases=aliases)
    return jax.jit(lambda *xs: call(*xs, **attrs))(*args, *poison)
