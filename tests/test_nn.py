"""xLSTM layers, blocks, stack and LM: parallel (chunkwise) mode, step mode and state passing
agree; configs validate; the LM trains and generates. Runs on the selected backend."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from xlstm_kernels import nn as xnn

E = 32


def _rel(a: mx.array, b: mx.array) -> float:
    a64 = np.asarray(a.astype(mx.float32), dtype=np.float64)
    b64 = np.asarray(b.astype(mx.float32), dtype=np.float64)
    return float(np.max(np.abs(a64 - b64)) / max(np.max(np.abs(b64)), 1e-12))


def _stack_config(kinds: str, **kw) -> xnn.xLSTMBlockStackConfig:
    """kinds like "msa": mLSTM, sLSTM, attention blocks in that order."""
    return xnn.xLSTMBlockStackConfig(
        embedding_dim=E,
        num_blocks=len(kinds),
        context_length=32,
        slstm_at=[i for i, c in enumerate(kinds) if c == "s"],
        attention_at=[i for i, c in enumerate(kinds) if c == "a"],
        mlstm_block=xnn.mLSTMBlockConfig(mlstm=xnn.mLSTMLayerConfig(num_heads=2, chunk_size=8)),
        slstm_block=xnn.sLSTMBlockConfig(slstm=xnn.sLSTMLayerConfig(num_heads=2)),
        attention_block=xnn.AttentionBlockConfig(num_heads=4, num_kv_heads=2),
        **kw,
    )


def _randomise(module: nn.Module, seed: int) -> None:
    """Non-trivial parameters everywhere (recurrent weights start at zero otherwise)."""
    rng = np.random.default_rng(seed)
    flat = nn.utils.tree_flatten(module.parameters())
    module.update(nn.utils.tree_unflatten(
        [(k, v + mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.1)) for k, v in flat]))


@pytest.mark.parametrize("kind", ["m", "s", "a"])
def test_block_step_mode_matches_parallel_mode(kind, kernel_backend):
    mx.random.seed(1)
    stack = xnn.xLSTMBlockStack(_stack_config(kind))
    _randomise(stack, 2)
    block = stack.blocks[0]
    x = mx.array(np.random.default_rng(3).standard_normal((2, 11, E)).astype(np.float32))
    y_par = block(x)
    state, ys = None, []
    for t in range(x.shape[1]):
        y_t, state = block.step(x[:, t], state)
        ys.append(y_t)
    assert _rel(mx.stack(ys, axis=1), y_par) < 1e-4


@pytest.mark.parametrize("kinds", ["ms", "msa"])
def test_stack_state_passing_equals_whole_sequence(kinds, kernel_backend):
    mx.random.seed(4)
    stack = xnn.xLSTMBlockStack(_stack_config(kinds))
    _randomise(stack, 5)
    x = mx.array(np.random.default_rng(6).standard_normal((1, 19, E)).astype(np.float32))
    whole = stack(x)
    first, state = stack(x[:, :7], return_state=True)
    second = stack(x[:, 7:], state)
    assert _rel(mx.concatenate([first, second], axis=1), whole) < 1e-4


def test_generate_is_consistent_with_the_full_forward(kernel_backend):
    """Greedy tokens from step mode equal the argmax of the parallel forward over the same tokens."""
    mx.random.seed(7)
    cfg = xnn.xLSTMLMModelConfig(vocab_size=17, **{k: v for k, v in _stack_config("ms").__dict__.items()})
    model = xnn.xLSTMLM(cfg)
    _randomise(model, 8)
    prompt = mx.array([1, 5, 2, 9])
    tokens = [int(t[0]) for t in xnn.generate(model, prompt, 6, temperature=0.0)]
    seq = mx.array([[1, 5, 2, 9, *tokens]])
    logits = model(seq)
    expected = np.asarray(mx.argmax(logits[0, 3:-1], axis=-1)).tolist()
    assert tokens == expected


def test_lm_training_reduces_loss(kernel_backend):
    mx.random.seed(9)
    cfg = xnn.xLSTMLMModelConfig(vocab_size=11, tie_weights=True, **{k: v for k, v in _stack_config("ms").__dict__.items()})
    model = xnn.xLSTMLM(cfg)
    import mlx.optimizers as optim

    opt = optim.Adam(learning_rate=1e-2)
    rng = np.random.default_rng(10)
    pattern = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4)
    loss_fn = lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean")  # noqa: E731
    step = nn.value_and_grad(model, loss_fn)
    losses = []
    for _ in range(12):
        s = rng.integers(0, 11, size=4)
        idx = s[:, None] + np.arange(13)[None]
        seq = mx.array(pattern[idx])
        loss, grads = step(model, seq[:, :-1], seq[:, 1:])
        opt.update(model, grads)
        mx.eval(loss, model.parameters())
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3])


def test_config_validation():
    with pytest.raises(ValueError, match="slstm_at"):
        xnn.xLSTMBlockStackConfig(num_blocks=2, embedding_dim=E, slstm_at=[2])
    with pytest.raises(ValueError, match="both"):
        xnn.xLSTMBlockStackConfig(num_blocks=2, embedding_dim=E, slstm_at=[0], attention_at=[0])
    with pytest.raises(ValueError, match="vocab_size"):
        xnn.xLSTMLMModelConfig(num_blocks=1, embedding_dim=E)
    with pytest.raises(ValueError, match="divisible"):
        xnn.sLSTMLayer(xnn.sLSTMLayerConfig(embedding_dim=30, num_heads=4))
    cfg = _stack_config("msa")
    assert [cfg.block_kind(i) for i in range(3)] == ["mlstm", "slstm", "attention"]
    assert cfg.mlstm_block.mlstm.embedding_dim == E and cfg.slstm_block.feedforward.embedding_dim == E


def test_causal_conv_state_passing():
    conv = xnn.CausalConv1d(6, 4)
    x = mx.array(np.random.default_rng(11).standard_normal((2, 9, 6)).astype(np.float32))
    whole, _ = conv(x)
    a, s = conv(x[:, :5])
    b, _ = conv(x[:, 5:], s)
    assert _rel(mx.concatenate([a, b], axis=1), whole) < 1e-6
    # y[t] = b + sum_j w[j] x[t-3+j] with zeros before the start
    xn, w = np.asarray(x), np.asarray(conv.weight)
    xp = np.concatenate([np.zeros((2, 3, 6)), xn], axis=1)
    ref = sum(xp[:, j : j + 9] * w[j] for j in range(4)) + np.asarray(conv.bias)
    assert np.max(np.abs(np.asarray(whole) - ref)) < 1e-5
