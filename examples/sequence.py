"""A sequence model on flowtt_jax: a user's last items (up to 50, variable length) looked up
unpooled from a TT item table, padded to ``[B, L, D]`` with a mask, attention from the
last item over the sequence, and a softmax over the next item's category.

Synthetic data with a planted structure: items belong to categories; a user's sequence
walks the categories by a user-type's step (``c -> c + step``, with noise), items drawn
within the category; the target is the next item's category. Reported: held-out accuracy
against the majority class.

    python examples/sequence.py --items 1000000 --steps 300

The batch is a ``KeyedJagged`` (one feature, lengths per example, ids padded to a static
``B * L`` so one program serves every batch: the tail is in no bag);
``TTEmbeddingCollection.lookup`` gives each id's row and ``KeyedJagged.to_padded`` the
``[B, L, D]`` rows and mask.
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

from flowtt_jax import KeyedJagged
from flowtt_jax.collection import TableConfig
from flowtt_jax.nnx import TTEmbeddingCollection


class Synth:
    """Items in ``cats`` categories (item i is in category i % cats); user types step by 1..3."""

    def __init__(self, items: int, cats: int, max_len: int, seed: int = 0) -> None:
        self.items, self.cats, self.max_len = items, cats, max_len
        self.rng = np.random.default_rng(seed)

    def batch(self, rng: np.random.Generator, size: int) -> tuple[KeyedJagged, np.ndarray]:
        """``(KeyedJagged of the histories, next categories [B])``."""
        steps = rng.integers(1, 4, size)
        lengths = rng.integers(1, self.max_len + 1, size)
        start = rng.integers(0, self.cats, size)
        pos = np.arange(self.max_len + 1)
        noise = (rng.random((size, self.max_len + 1)) < 0.15) * rng.integers(
            0, self.cats, (size, self.max_len + 1)
        )
        cats = (start[:, None] + steps[:, None] * pos + noise) % self.cats
        items = rng.integers(0, self.items // self.cats, (size, self.max_len + 1)) * self.cats + cats
        # the history: the last lengths[b] items before the target (position lengths[b])
        ids = np.concatenate([items[b, : lengths[b]] for b in range(size)])
        ids = np.pad(ids, (0, size * self.max_len - ids.size))  # static shape, the tail in no bag
        target = cats[np.arange(size), lengths]
        kjt = KeyedJagged(jnp.asarray(ids), lengths=jnp.asarray(lengths[None, :]), keys=("hist",))
        return kjt, target


class NextCategory(nnx.Module):
    def __init__(self, items: int, cats: int, dim: int, rank: int, max_len: int, rngs: nnx.Rngs) -> None:
        self.embeddings = TTEmbeddingCollection(
            [TableConfig("items", items, dim, rank=rank, feature_names=("hist",))], rngs=rngs
        )
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, dim)))
        self.query = nnx.Linear(dim, dim, rngs=rngs)
        self.key = nnx.Linear(dim, dim, rngs=rngs)
        self.out = nnx.Linear(2 * dim, cats, rngs=rngs)
        self.max_len = max_len

    def __call__(self, batch: KeyedJagged) -> jax.Array:
        rows = self.embeddings.lookup(batch)  # [n, D]: each id's row
        seq, mask = batch.to_padded(rows, self.max_len)["hist"]  # [B, L, D], [B, L]
        lengths = jnp.sum(mask, axis=1)
        last = jnp.take_along_axis(seq, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
        x = seq + self.position[...]
        logits = jnp.einsum("bd,bld->bl", self.query(last), self.key(x)) / np.sqrt(x.shape[-1])
        attn = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        context = jnp.einsum("bl,bld->bd", attn, x)
        return self.out(jnp.concatenate([context, last], -1))


def run(argv: Sequence[str] | None = None, log=print) -> dict:
    """Trains and evaluates; returns the held-out metrics."""
    args = parse_args(argv)
    world = Synth(args.items, args.cats, args.max_len, args.seed)
    model = NextCategory(args.items, args.cats, args.dim, args.rank, args.max_len, nnx.Rngs(args.seed))
    opt = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)

    def loss_fn(m, batch, target):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(m(batch), target))

    @nnx.jit
    def train_step(m, o, batch, target):
        loss, grads = nnx.value_and_grad(loss_fn)(m, batch, target)
        o.update(m, grads)
        return loss

    predict = nnx.jit(lambda m, batch: jnp.argmax(m(batch), -1))
    rng, held_rng = np.random.default_rng(args.seed + 1), np.random.default_rng(args.seed + 2)
    held = [world.batch(held_rng, args.batch_size) for _ in range(args.eval_batches)]
    t0, loss = time.perf_counter(), None
    for step in range(args.steps):
        batch, target = world.batch(rng, args.batch_size)
        loss = train_step(model, opt, batch, jnp.asarray(target))
        if args.log_every and (step + 1) % args.log_every == 0:
            log(f"step {step + 1}: loss {float(loss):.4f}")
    jax.block_until_ready(loss)
    elapsed = time.perf_counter() - t0
    acc = np.mean([np.mean(np.asarray(predict(model, b)) == t) for b, t in held])
    majority = np.mean([np.mean(t == np.bincount(t, minlength=args.cats).argmax()) for _, t in held])
    result = {
        "accuracy": float(acc),
        "majority": float(majority),
        "final_loss": float(loss),
        "steps_per_s": args.steps / elapsed,
    }
    log(
        f"held-out next-category accuracy {acc:.3f} (majority class {majority:.3f}); "
        f"{result['steps_per_s']:.1f} steps/s (compile included)"
    )
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=200_000)
    p.add_argument("--cats", type=int, default=20)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


if __name__ == "__main__":
    run()
