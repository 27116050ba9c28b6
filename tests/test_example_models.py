"""The two-tower retrieval and sequence examples train end to end at tiny sizes and learn
their planted structure (better than chance / the majority class by a margin)."""

from __future__ import annotations

from examples import sequence, two_tower


def _run(example, **flags) -> dict:
    """``example.run`` quietly with ``--flag value`` for each keyword (underscores as dashes)."""
    argv = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return example.run(argv + ["--eval-batches", "2", "--log-every", "0"], log=lambda *_: None)


def test_two_tower_learns_beyond_chance():
    got = _run(two_tower, users=3000, items=1000, steps=60, batch_size=64)
    assert got["top1"] > 4 * got["chance_top1"] and got["recall10"] > got["chance_recall10"] + 0.1, got
    assert set(got["out_of_range"].values()) == {0}  # every id of the synthetic data in range


def test_sequence_model_learns_beyond_the_majority_class():
    got = _run(sequence, items=2000, steps=250, batch_size=64)
    assert got["accuracy"] > got["majority"] + 0.1, got
