import math

import numpy as np
import pytest

import flowtt_jax as ftt
from flowtt_jax.tt.spec import factor_cols, factor_rows


@pytest.mark.parametrize("n", [1, 2, 7, 97, 1000, 1460, 100_003, 10**6, 10_131_227, 10**7, 10**9])
@pytest.mark.parametrize("d", [2, 3, 4])
def test_factor_rows_covers_with_little_padding(n, d):
    shape = factor_rows(n, d)
    assert len(shape) == d
    assert list(shape) == sorted(shape)
    assert math.prod(shape) >= n
    # Near-balanced, minimal padding: never worse than ceil of the balanced cube.
    balanced = math.ceil(n ** (1 / d)) ** d
    assert math.prod(shape) <= balanced
    if n >= 1000:
        assert math.prod(shape) / n - 1 < 0.01
    if n >= 10**5:
        assert max(shape) / min(shape) < 2.0


def test_factor_rows_prefers_exact_for_known_sizes():
    assert math.prod(factor_rows(10**6, 3)) == 10**6
    assert factor_rows(10**6, 3) == (100, 100, 100)


@pytest.mark.parametrize(
    "dim,expected", [(16, (2, 2, 4)), (32, (2, 4, 4)), (64, (4, 4, 4)), (128, (4, 4, 8))]
)
def test_factor_cols_balanced_exact(dim, expected):
    assert factor_cols(dim, 3) == expected


@pytest.mark.parametrize("dim", [1, 7, 12, 30, 100])
def test_factor_cols_exact_product(dim):
    for d in (2, 3, 4):
        shape = factor_cols(dim, d)
        assert math.prod(shape) == dim and len(shape) == d


def test_create_caps_ranks_at_full_rank():
    spec = ftt.TTSpec.create(10, 4, rank=1000)
    # Full ranks: min(prod of left p*q, prod of right p*q).
    sizes = [p * q for p, q in zip(spec.row_shape, spec.col_shape)]
    assert spec.ranks[1] == min(sizes[0], sizes[1] * sizes[2])
    assert spec.ranks[2] == min(sizes[0] * sizes[1], sizes[2])


def test_spec_shapes_and_compression():
    spec = ftt.TTSpec.create(10**7, 32, 32, row_shape=(200, 200, 250))
    assert spec.core_shapes == ((200, 1, 2, 32), (200, 32, 4, 32), (250, 32, 4, 1))
    assert spec.num_params == sum(np.prod(s) for s in spec.core_shapes)
    assert spec.compression_ratio == pytest.approx(10**7 * 32 / spec.num_params)
    assert ftt.TTSpec.from_cores([np.zeros(s) for s in spec.core_shapes], 10**7) == spec


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_embeddings=0, embedding_dim=4), "num_embeddings"),
        (dict(num_embeddings=100, embedding_dim=8, row_shape=(3, 3, 3)), "prod\\(row_shape\\)"),
        (dict(num_embeddings=10, embedding_dim=8, col_shape=(2, 2, 3)), "prod\\(col_shape\\)"),
        (dict(num_embeddings=10, embedding_dim=8, rank=(2,)), "internal ranks"),
        (dict(num_embeddings=10, embedding_dim=8, rank=0), "ranks"),
        (dict(num_embeddings=10, embedding_dim=8, num_cores=1), "at least 2 cores"),
    ],
)
def test_invalid_specs_raise_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ftt.TTSpec.create(**kwargs)


def test_from_cores_rejects_broken_rank_chain():
    with pytest.raises(ValueError, match="rank mismatch"):
        ftt.TTSpec.from_cores([np.zeros((2, 1, 2, 3)), np.zeros((2, 4, 2, 1))])


def test_create_takes_the_dim_under_either_name():
    import flowtt_jax as ftt

    assert ftt.TTSpec.create(1000, features=16, rank=4) == ftt.TTSpec.create(1000, 16, 4)
    with pytest.raises(TypeError, match="embedding_dim or features"):
        ftt.TTSpec.create(1000, 16, features=16)
    with pytest.raises(TypeError, match="embedding_dim or features"):
        ftt.TTSpec.create(1000)
