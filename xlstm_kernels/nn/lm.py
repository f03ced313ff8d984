"""xLSTM language model and sampling."""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from .config import xLSTMLMModelConfig
from .stack import xLSTMBlockStack


def _check_tokens(tokens, layout: str, ndim: int, name: str = "tokens") -> None:
    if not isinstance(tokens, mx.array) or not mx.issubdtype(tokens.dtype, mx.integer):
        what = tokens.dtype if isinstance(tokens, mx.array) else type(tokens).__name__
        raise TypeError(f"xLSTMLM: {name} must be an integer mx.array {layout} of token ids, got {what}")
    if tokens.ndim != ndim:
        raise ValueError(f"xLSTMLM: {name} must have shape {layout}, got {tuple(tokens.shape)}")


class xLSTMLM(nn.Module):  # noqa: N801
    """tokens (B, S) int -> logits (B, S, vocab_size)."""

    def __init__(self, config: xLSTMLMModelConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.embedding_dim)
        self.stack = xLSTMBlockStack(config)
        if not config.tie_weights:
            self.head = nn.Linear(config.embedding_dim, config.vocab_size, bias=False)

    def _logits(self, h: mx.array) -> mx.array:
        return self.embedding.as_linear(h) if self.config.tie_weights else self.head(h)

    def __call__(self, tokens: mx.array, state=None, return_state: bool = False):
        _check_tokens(tokens, "(B, S)", 2)
        h, state = self.stack(self.embedding(tokens), state, return_state=True)
        logits = self._logits(h)
        return (logits, state) if return_state else logits

    def step(self, token: mx.array, state):
        """token (B,) int -> (logits (B, vocab), state)."""
        _check_tokens(token, "(B,)", 1, "token")
        h, state = self.stack.step(self.embedding(token), state)
        return self._logits(h), state


def generate(
    model: xLSTMLM,
    prompt: mx.array,
    max_tokens: int,
    temperature: float = 1.0,
    key: mx.array | None = None,
) -> Iterator[mx.array]:
    """Yield `max_tokens` sampled tokens (each (B,)) after `prompt` (B, S) or (S,).

    The prompt runs in parallel/chunkwise mode (prefill) and returns every block's state;
    each new token then runs in step mode with that state. temperature 0 is greedy.
    """
    if prompt.ndim == 1:
        prompt = prompt[None]
    if max_tokens < 0 or temperature < 0:
        raise ValueError(f"max_tokens and temperature must be >= 0, got {max_tokens}, {temperature}")
    logits, state = model(prompt, return_state=True)
    logits = logits[:, -1]
    for _ in range(max_tokens):
        if temperature == 0:
            token = mx.argmax(logits, axis=-1)
        else:
            if key is None:
                token = mx.random.categorical(logits * (1.0 / temperature))
            else:
                key, sub = mx.random.split(key)
                token = mx.random.categorical(logits * (1.0 / temperature), key=sub)
        yield token
        logits, state = model.step(token, state)
