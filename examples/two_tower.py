"""A two-tower retrieval model on flowtt_jax: a user tower (a large dense user table with
sparse row-wise Adagrad updates, a small country table of another dim, the mean of a
variable-length history of items) and an item tower (the item id), the item table shared
by the item id and the history (TT-compressed), trained with an in-batch softmax.

Synthetic data with a planted structure: users and items have hidden vectors; a user's
next item is drawn with probability ~ exp(user . item) from a candidate pool, and the
history holds items drawn the same way. Reported: held-out in-batch top-1 accuracy and
recall@10 against chance (1/B, 10/B).

    python examples/two_tower.py --users 1000000 --items 500000 --steps 300

The towers call one ``TTEmbeddingCollection`` on feature subsets (the user tower's three
features, the item tower's one); ``flowtt_jax.sparse`` updates the user table's touched
rows only.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flowtt_jax import sparse as sp
from flowtt_jax.collection import TableConfig
from flowtt_jax.collection.config import SparseUpdate
from flowtt_jax.nnx import TTEmbeddingCollection

USER_FEATURES, ITEM_FEATURES = ("user", "country", "hist"), ("item",)


class Synth:
    """The planted world: hidden vectors of users and items (dim 8), countries by user."""

    def __init__(self, users: int, items: int, seed: int = 0, pool: int = 2048) -> None:
        rng = np.random.default_rng(seed)
        self.users, self.items = users, items
        self.user_vec = rng.standard_normal((users, 8)).astype(np.float32)
        self.item_vec = rng.standard_normal((items, 8)).astype(np.float32)
        self.pool = pool

    def batch(self, rng: np.random.Generator, size: int, max_hist: int = 12) -> dict:
        """``{"user", "country", "hist" (ids, lengths), "item"}`` of ``size`` examples."""
        users = rng.integers(0, self.users, size)
        cands = rng.integers(0, self.items, (size, self.pool))
        scores = np.einsum("bd,bkd->bk", self.user_vec[users], self.item_vec[cands]) * 1.5
        # max_hist + 1 draws per user ~ softmax(scores), by the Gumbel-max trick
        picks = np.argmax(scores[:, None, :] + rng.gumbel(size=(size, max_hist + 1, self.pool)), axis=-1)
        chosen = np.take_along_axis(cands, picks, axis=1)
        lengths = rng.integers(0, max_hist + 1, size)
        hist = np.concatenate([chosen[b, 1 : 1 + lengths[b]] for b in range(size)])
        # a static shape (one compiled step): padded to B * max_hist, the tail in no bag (under
        # jit, positions past offsets[-1] belong to no bag)
        hist = np.pad(hist, (0, size * max_hist - hist.size))
        return {
            "user": users,
            "country": users % 50,
            "hist": {"ids": hist, "offsets": np.concatenate([[0], np.cumsum(lengths)])},
            "item": chosen[:, 0],
        }


def tables(users: int, items: int, dim: int, rank: int, lr: float) -> list[TableConfig]:
    return [
        TableConfig("user", users, dim, kind="dense", sparse=SparseUpdate("rowwise_adagrad", lr)),
        TableConfig("country", 50, 8, kind="dense"),
        TableConfig("items", items, dim, rank=rank, feature_names=("item", "hist"), mode="mean"),
    ]


class TwoTower(nnx.Module):
    def __init__(self, cfgs: Sequence[TableConfig], dim: int, rngs: nnx.Rngs) -> None:
        self.embeddings = TTEmbeddingCollection(cfgs, rngs=rngs)
        self.user_mlp = nnx.Linear(2 * dim + 8, dim, rngs=rngs)
        self.item_mlp = nnx.Linear(dim, dim, rngs=rngs)

    def user(self, batch: dict) -> jax.Array:
        out = self.embeddings(batch)  # a feature subset: the user tower's
        return self.user_mlp(jnp.concatenate([out[f] for f in USER_FEATURES], -1))

    def item(self, items: jax.Array) -> jax.Array:
        return self.item_mlp(self.embeddings({"item": items})["item"])  # a feature subset


def _user_batch(raw: dict) -> dict:
    return jax.tree.map(jnp.asarray, {f: raw[f] for f in USER_FEATURES})


def loss_fn(model: TwoTower, users: dict, items: jax.Array) -> jax.Array:
    logits = model.user(users) @ model.item(items).T
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.arange(logits.shape[0])))


def make_train_step():
    """The jitted training step ``(model, optimizer, users, items) -> loss``: Adam (the
    optimizer's) for the parameters, the sparse rule for the sparse tables' touched rows;
    model and optimizer donated, so those rows are written in place."""
    grad_fn = sp.sparse_value_and_grad(loss_fn)

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(m, o, users, items):
        loss, grads, sparse = grad_fn(m, users, items)
        o.update(m, grads)
        sp.apply_sparse(m, sparse)
        return loss

    return train_step


def run(argv: Sequence[str] | None = None, log=print) -> dict:
    """Trains and evaluates; returns the held-out metrics."""
    args = parse_args(argv)
    world = Synth(args.users, args.items, seed=args.seed)
    model = TwoTower(
        tables(args.users, args.items, args.dim, args.rank, args.sparse_lr), args.dim, nnx.Rngs(args.seed)
    )
    opt = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
    train_step = make_train_step()

    @nnx.jit
    def scores(m, users, items):
        return m.user(users) @ m.item(items).T

    rng = np.random.default_rng(args.seed + 1)
    held_rng = np.random.default_rng(args.seed + 2)
    held = [world.batch(held_rng, args.batch_size) for _ in range(args.eval_batches)]
    t0, loss = time.perf_counter(), None
    for step in range(args.steps):
        raw = world.batch(rng, args.batch_size)
        loss = train_step(model, opt, _user_batch(raw), jnp.asarray(raw["item"]))
        if args.log_every and (step + 1) % args.log_every == 0:
            log(f"step {step + 1}: loss {float(loss):.4f}")
    jax.block_until_ready(loss)
    elapsed = time.perf_counter() - t0
    top1, top10 = [], []
    for raw in held:
        s = np.asarray(scores(model, _user_batch(raw), jnp.asarray(raw["item"])))
        rank = (s > np.diag(s)[:, None]).sum(1)
        top1.append(np.mean(rank == 0))
        top10.append(np.mean(rank < 10))
    b = args.batch_size
    result = {
        "top1": float(np.mean(top1)),
        "recall10": float(np.mean(top10)),
        "chance_top1": 1 / b,
        "chance_recall10": min(10, b) / b,
        "final_loss": float(loss),
        "steps_per_s": args.steps / elapsed,
        "out_of_range": model.embeddings.out_of_range(),
    }
    log(
        f"held-out in-batch top-1 {result['top1']:.3f} (chance {result['chance_top1']:.3f}), "
        f"recall@10 {result['recall10']:.3f} (chance {result['chance_recall10']:.3f}); "
        f"{result['steps_per_s']:.1f} steps/s (compile included)"
    )
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=100_000)
    p.add_argument("--items", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sparse-lr", type=float, default=0.05, help="the user table's row-wise Adagrad")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


if __name__ == "__main__":
    run()
