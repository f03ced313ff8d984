"""The main job: train a small character-level xLSTM LM on a shipped public-domain text.

``xlstm-kernels demo`` builds an xLSTM (mLSTM + sLSTM blocks), trains it with AdamW on
``xlstm_kernels/data/corpus.txt`` with a progress bar (loss, tokens/s), prints a
generated sample (prefill in chunkwise mode, then step mode with carried state), and
saves a loss-curve PNG. It runs on the active backend: Metal kernels on a Mac, the
reference ops on Linux (``--backend emulate`` runs every kernel through the emulator,
much slower).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from . import runtime
from .nn import (
    FeedForwardConfig,
    generate,
    mLSTMBlockConfig,
    mLSTMLayerConfig,
    sLSTMBlockConfig,
    sLSTMLayerConfig,
    xLSTMLM,
    xLSTMLMModelConfig,
)

__all__ = ["DemoResult", "load_corpus", "unigram_entropy", "run_demo"]


def load_corpus() -> str:
    """The shipped training text (public-domain poems and prose, ~8 KB)."""
    return resources.files("xlstm_kernels.data").joinpath("corpus.txt").read_text(encoding="utf-8")


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the token frequencies, in nats: the loss of the best context-free model."""
    p = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


@dataclass
class DemoResult:
    """What a demo run measured."""

    backend: str
    steps: int
    seconds: float
    tokens_per_s: float
    losses: list[float] = field(default_factory=list)
    final_train_loss: float = math.nan
    val_loss: float = math.nan
    unigram_entropy: float = math.nan
    sample: str = ""
    plot: str | None = None
    generate_tokens_per_s: float = math.nan


class _Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool, width: int = 28):
        self.total, self.enabled, self.width = total, enabled and total > 0, width

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        filled = int(self.width * step / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        sys.stderr.write(f"\r[{bar}] {step}/{self.total} {text}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def demo_config(vocab_size: int, context: int) -> xLSTMLMModelConfig:
    """Two blocks of width 64: an mLSTM block, then an sLSTM block with its FFN."""
    return xLSTMLMModelConfig(
        vocab_size=vocab_size,
        embedding_dim=64,
        num_blocks=2,
        slstm_at=[1],
        context_length=context,
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(num_heads=4, chunk_size=16)),
        slstm_block=sLSTMBlockConfig(slstm=sLSTMLayerConfig(num_heads=4), feedforward=FeedForwardConfig()),
    )


def _plot(losses: list[float], entropy: float, path: Path, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=1.0, color="#3b6ea8", label="training loss")
    if len(losses) >= 10:
        k = 10
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(losses) + 1), smooth, lw=2.0, color="#1d3d63", label="10-step mean")
    ax.axhline(entropy, color="#c0392b", ls="--", lw=1.2, label=f"unigram entropy {entropy:.2f} nats")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / char)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def run_demo(
    steps: int = 200,
    batch_size: int = 16,
    context: int = 64,
    learning_rate: float = 3e-3,
    seed: int = 0,
    out_dir: str | Path = ".",
    sample_chars: int = 240,
    max_seconds: float = 150.0,
    progress: bool = True,
    plot: bool = True,
) -> DemoResult:
    """Train the demo model and return what was measured.

    Args:
        steps: optimisation steps (stops earlier once `max_seconds` have passed).
        batch_size, context: sequences per step and characters per sequence.
        out_dir: where ``demo_loss.png`` goes.
        sample_chars: characters generated after training.
    """
    if steps <= 0 or batch_size <= 0 or context <= 1:
        raise ValueError(f"steps, batch_size must be positive and context > 1, got {steps}, {batch_size}, {context}")
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    text = load_corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], dtype=np.int32)
    # Every 10th block of 256 characters is held out, so validation covers every piece.
    blocks = [data[i : i + 256] for i in range(0, len(data), 256)]
    train = np.concatenate([b for i, b in enumerate(blocks) if i % 10 != 5])
    val = np.concatenate([b for i, b in enumerate(blocks) if i % 10 == 5])
    entropy = unigram_entropy(train, len(chars))

    model = xLSTMLM(demo_config(len(chars), context))
    optimizer = optim.AdamW(learning_rate=learning_rate, weight_decay=0.01)

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def batch(source: np.ndarray, n: int) -> tuple[mx.array, mx.array]:
        starts = rng.integers(0, len(source) - context - 1, size=n)
        idx = starts[:, None] + np.arange(context + 1)[None]
        seq = source[idx]
        return mx.array(seq[:, :-1]), mx.array(seq[:, 1:])

    backend = runtime.current_backend()
    bar = _Progress(steps, progress)
    losses: list[float] = []
    start = time.perf_counter()
    done = 0
    for step in range(1, steps + 1):
        x, y = batch(train, batch_size)
        loss, grads = loss_and_grad(model, x, y)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        losses.append(float(loss))
        done = step
        elapsed = time.perf_counter() - start
        bar.update(step, f"loss {losses[-1]:.3f}  {step * batch_size * context / elapsed:,.0f} tok/s")
        if elapsed > max_seconds:
            break
    bar.close()
    seconds = time.perf_counter() - start

    xv, yv = batch(val, 64)
    val_loss = float(loss_fn(model, xv, yv))

    prompt = "The "
    t0 = time.perf_counter()
    tokens = [int(t[0]) for t in generate(model, mx.array([index[c] for c in prompt]), sample_chars, 0.8,
                                          key=mx.random.key(seed))]
    gen_s = time.perf_counter() - t0
    sample = prompt + "".join(chars[t] for t in tokens)

    tail = losses[-20:]
    result = DemoResult(
        backend=backend,
        steps=done,
        seconds=seconds,
        tokens_per_s=done * batch_size * context / seconds,
        losses=losses,
        final_train_loss=float(np.mean(tail)),
        val_loss=val_loss,
        unigram_entropy=entropy,
        sample=sample,
        generate_tokens_per_s=sample_chars / gen_s if gen_s > 0 else math.nan,
    )
    if plot:
        result.plot = _plot(losses, entropy, Path(out_dir) / "demo_loss.png",
                            f"xLSTM char-LM ({backend} backend, {done} steps)")
    return result
