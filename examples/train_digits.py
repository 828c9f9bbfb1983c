#!/usr/bin/env python3
"""Trains a small tinygrad MLP on scikit-learn's digits, fed by devbridge.Prefetcher, and checks it bit for bit.

    python examples/train_digits.py [--epochs N] [--backend host] [--depth 2] [--batch 64] [--no-jit]

The same training (same seed, same initial weights, same batch order, the same TinyJit step) runs twice:
fed by ``devbridge.Prefetcher`` (each batch staged through the bridge's ring into device memory while the
previous step computes, handed to tinygrad without a copy) and fed by ``tinygrad.Tensor(numpy_batch)``.
Every step's loss and the final weights must be the same bits; the script prints the per-epoch mean loss
of both and exits 1 on any difference.

TinyJit keeps the batch of its capture call (its second call) alive for as long as the jitted step lives,
so that batch's Prefetcher slot is never let go: at ``--depth 1`` the Prefetcher retires it (a
``RuntimeWarning`` says so, once) and stages into a fresh slot; at a larger depth it costs one batch of
look-ahead.

The data set is ``sklearn.datasets.load_digits`` (1797 8x8 images, shipped inside scikit-learn: nothing is
downloaded). Needs numpy, tinygrad and scikit-learn (``requirements-dev.txt``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np

SEED = 1234
# tinygrad devices a view of each backend becomes (to_tinygrad needs one it can wrap without a copy).
TINYGRAD_DEVICE = {"host": "CPU", "fake": "CPU", "cuda": "CUDA"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
        return value

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=positive, default=3, help="passes over the data (default 3)")
    parser.add_argument("--backend", choices=sorted(TINYGRAD_DEVICE), default="host", help="devbridge backend")
    parser.add_argument("--depth", type=positive, default=2, help="Prefetcher depth (default 2)")
    parser.add_argument("--batch", type=positive, default=64, help="batch size (default 64)")
    parser.add_argument("--no-jit", dest="jit", action="store_false", help="train without TinyJit")
    return parser.parse_args(argv)


def load_data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)  # pixels are 0..16
    labels = digits.target.astype(np.int32)
    return images, labels


def batches(images: np.ndarray, labels: np.ndarray, batch: int, epochs: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Shuffled batches of every epoch, in one fixed order; the partial last batch of an epoch is dropped
    (a jitted step takes one shape)."""
    order = np.random.default_rng(SEED)
    for _ in range(epochs):
        perm = order.permutation(len(images))
        for start in range(0, len(perm) - batch + 1, batch):
            index = perm[start:start + batch]
            yield images[index], labels[index]  # fancy indexing: fresh C-contiguous arrays


def initial_weights(features: int, hidden: int, classes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return {
        "w1": (rng.standard_normal((features, hidden)) * np.sqrt(2.0 / features)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, classes)) * np.sqrt(1.0 / hidden)).astype(np.float32),
        "b2": np.zeros(classes, np.float32),
    }


def training_mode() -> contextlib.AbstractContextManager:
    """tinygrad's optimizers step only in training mode: Tensor.train() before tinygrad 0.12, TRAINING=1 since."""
    from tinygrad import Tensor

    if hasattr(Tensor, "train"):
        return Tensor.train()
    from tinygrad.helpers import Context

    return Context(TRAINING=1)


def train(feed: Iterable[tuple[Any, Any]], weights: dict[str, np.ndarray], device: str, steps_per_epoch: int,
          jit: bool, label: str) -> tuple[list[float], dict[str, np.ndarray], float]:
    """Trains on ``feed`` (pairs of tinygrad Tensors); returns every step's loss, the final weights and the
    seconds it took."""
    from tinygrad import Tensor, TinyJit, nn

    def parameter(value: np.ndarray) -> Tensor:
        tensor = Tensor(value, device=device)
        if hasattr(tensor, "requires_grad"):  # older tinygrad; newer ones make every tensor a parameter
            tensor.requires_grad = True
        return tensor

    params = {name: parameter(value) for name, value in weights.items()}
    optimizer = nn.optim.SGD(list(params.values()), lr=0.2)

    def step(x: Tensor, y: Tensor) -> Tensor:
        optimizer.zero_grad()
        hidden = (x @ params["w1"] + params["b1"]).relu()
        loss = (hidden @ params["w2"] + params["b2"]).sparse_categorical_crossentropy(y)
        loss.backward()
        optimizer.step()
        return loss.realize()

    run: Callable[[Tensor, Tensor], Tensor] = TinyJit(step) if jit else step
    losses: list[float] = []
    start = time.perf_counter()
    with training_mode():
        for x, y in feed:
            losses.append(run(x, y).item())
            if len(losses) % steps_per_epoch == 0:
                epoch = len(losses) // steps_per_epoch
                print(f"{label:>10} epoch {epoch}: mean loss {np.mean(losses[-steps_per_epoch:]):.6f}")
    seconds = time.perf_counter() - start
    return losses, {name: t.numpy() for name, t in params.items()}, seconds


def first_difference(a: list[float], b: list[float]) -> str | None:
    if len(a) != len(b):
        return f"{len(a)} steps against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if np.float32(x).tobytes() != np.float32(y).tobytes():
            return f"step {i}: loss {x!r} against {y!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = TINYGRAD_DEVICE[args.backend]
    # Tensors made without device= land on tinygrad's default device: make it the views' device (on a
    # machine with an OpenCL driver tinygrad would pick CL). Everything below also names its device.
    os.environ.setdefault("DEV", device)

    import devbridge
    from tinygrad import Tensor

    images, labels = load_data()
    if args.batch > len(images):
        print(f"train_digits: --batch {args.batch} is more than the {len(images)} images", file=sys.stderr)
        return 2
    steps_per_epoch = len(images) // args.batch
    weights = initial_weights(images.shape[1], 64, 10)
    print(f"digits: {len(images)} images, {steps_per_epoch} batches of {args.batch} per epoch, "
          f"{args.epochs} epochs, TinyJit {'on' if args.jit else 'off'}, tinygrad device {device}")

    with devbridge.Bridge(backend=args.backend) as bridge:
        if args.backend == "fake":
            bridge.fake.set_auto_complete(True)
        prefetched = devbridge.Prefetcher(bridge, batches(images, labels, args.batch, args.epochs),
                                          depth=args.depth, to="tinygrad")
        bridge_losses, bridge_weights, bridge_s = train(prefetched, weights, device, steps_per_epoch, args.jit,
                                                        "Prefetcher")
        plain = ((Tensor(x, device=device), Tensor(y, device=device))
                 for x, y in batches(images, labels, args.batch, args.epochs))
        plain_losses, plain_weights, plain_s = train(plain, weights, device, steps_per_epoch, args.jit, "numpy")
        del prefetched

    print(f"time: Prefetcher {bridge_s:.3f} s, Tensor(numpy) {plain_s:.3f} s (one run each, the first compiling "
          "the kernels: not a benchmark; see bench/prefetch_bench.py)")
    problems = []
    if (difference := first_difference(bridge_losses, plain_losses)) is not None:
        problems.append(f"losses differ at {difference}")
    for name in weights:
        if bridge_weights[name].tobytes() != plain_weights[name].tobytes():
            problems.append(f"final {name} differs")
    if not np.isfinite(bridge_losses).all():
        problems.append("a loss is not finite")
    # The first loss is taken before any step: with one step there is nothing to compare.
    elif len(bridge_losses) > 1 and bridge_losses[-1] >= bridge_losses[0]:
        problems.append(f"the loss did not go down ({bridge_losses[0]:.4f} -> {bridge_losses[-1]:.4f})")
    if problems:
        print("MISMATCH: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"bit-exact: {len(bridge_losses)} losses and the final weights are the same bits with both feeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
