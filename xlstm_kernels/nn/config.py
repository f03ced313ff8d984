"""Configuration dataclasses, named as in NX-AI's xlstm package.

A model is described by an :class:`xLSTMLMModelConfig` (vocabulary, tying) around an
:class:`xLSTMBlockStackConfig` (how many blocks, which are sLSTM or attention blocks,
the rest mLSTM), whose block configs carry the layer configs. ``embedding_dim``,
``context_length`` and the like are filled in from the stack config when left at -1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


def round_up(value: float, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return int(-(-int(value + 0.999999) // multiple) * multiple)


@dataclass
class mLSTMLayerConfig:  # noqa: N801 (NX-AI's names)
    """mLSTM layer: up-projection, causal conv + SiLU, headwise q/k, the matrix-memory cell,
    multi-head LayerNorm, learnable skip, SiLU(z) output gate, down-projection."""

    embedding_dim: int = -1
    num_heads: int = 4
    proj_factor: float = 2.0
    conv1d_kernel_size: int = 4
    qkv_proj_blocksize: int = 4
    bias: bool = False
    context_length: int = -1
    chunk_size: int | None = None  # None: the mlstm chunk_size knob (XLSTM_MLSTM_CHUNK_SIZE, presets), else 64
    round_proj_up_to_multiple_of: int = 8

    @property
    def inner_dim(self) -> int:
        return round_up(self.proj_factor * self.embedding_dim, self.round_proj_up_to_multiple_of)


@dataclass
class sLSTMLayerConfig:  # noqa: N801
    """sLSTM layer: optional causal conv + SiLU feeding i and f, headwise gate projections,
    the scalar-memory cell with block-diagonal recurrence, group (multi-head) norm."""

    embedding_dim: int = -1
    num_heads: int = 4
    conv1d_kernel_size: int = 4
    bias_init: str = "powerlaw_blockdependent"
    context_length: int = -1


@dataclass
class FeedForwardConfig:
    """Gated feed-forward: act(x W_gate) * (x W_up) W_down, hidden = proj_factor * dim rounded up."""

    proj_factor: float = 1.3
    act_fn: str = "gelu"
    embedding_dim: int = -1
    round_proj_up_to_multiple_of: int = 64

    @property
    def hidden_dim(self) -> int:
        return round_up(self.proj_factor * self.embedding_dim, self.round_proj_up_to_multiple_of)


@dataclass
class mLSTMBlockConfig:  # noqa: N801
    mlstm: mLSTMLayerConfig = field(default_factory=mLSTMLayerConfig)


@dataclass
class sLSTMBlockConfig:  # noqa: N801
    slstm: sLSTMLayerConfig = field(default_factory=sLSTMLayerConfig)
    feedforward: FeedForwardConfig | None = field(default_factory=FeedForwardConfig)


@dataclass
class AttentionBlockConfig:
    """A pre-norm transformer block (RoPE attention with grouped KV heads + gated FFN)."""

    num_heads: int = 4
    num_kv_heads: int = 2
    rope_base: float = 10000.0
    feedforward: FeedForwardConfig = field(default_factory=lambda: FeedForwardConfig(proj_factor=2.667, act_fn="silu"))


@dataclass
class xLSTMBlockStackConfig:  # noqa: N801
    """`num_blocks` blocks of width `embedding_dim`; blocks listed in `slstm_at` are sLSTM
    blocks, those in `attention_at` attention blocks, the others mLSTM blocks."""

    mlstm_block: mLSTMBlockConfig | None = field(default_factory=mLSTMBlockConfig)
    slstm_block: sLSTMBlockConfig | None = field(default_factory=sLSTMBlockConfig)
    attention_block: AttentionBlockConfig | None = None
    context_length: int = 256
    num_blocks: int = 2
    embedding_dim: int = 128
    slstm_at: list[int] = field(default_factory=list)
    attention_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.embedding_dim <= 0:
            raise ValueError(f"num_blocks and embedding_dim must be positive, got {self.num_blocks}, {self.embedding_dim}")
        for name, at in (("slstm_at", self.slstm_at), ("attention_at", self.attention_at)):
            bad = [i for i in at if not 0 <= i < self.num_blocks]
            if bad:
                raise ValueError(f"{name} has block indices {bad} outside 0..{self.num_blocks - 1}")
        both = set(self.slstm_at) & set(self.attention_at)
        if both:
            raise ValueError(f"blocks {sorted(both)} are listed in both slstm_at and attention_at")
        if self.slstm_at and self.slstm_block is None:
            raise ValueError("slstm_at names blocks but slstm_block is None")
        if self.attention_at and self.attention_block is None:
            self.attention_block = AttentionBlockConfig()
        # Fill the shared sizes into the layer configs (as NX-AI does).
        if self.mlstm_block is not None:
            self.mlstm_block = replace(self.mlstm_block, mlstm=replace(
                self.mlstm_block.mlstm, embedding_dim=self.embedding_dim, context_length=self.context_length))
        if self.slstm_block is not None:
            ff = self.slstm_block.feedforward
            self.slstm_block = replace(
                self.slstm_block,
                slstm=replace(self.slstm_block.slstm, embedding_dim=self.embedding_dim, context_length=self.context_length),
                feedforward=None if ff is None else replace(ff, embedding_dim=self.embedding_dim),
            )
        if self.attention_block is not None:
            self.attention_block = replace(self.attention_block, feedforward=replace(
                self.attention_block.feedforward, embedding_dim=self.embedding_dim))

    def block_kind(self, index: int) -> str:
        """"slstm", "attention" or "mlstm" for block `index`."""
        if index in self.slstm_at:
            return "slstm"
        if index in self.attention_at:
            return "attention"
        return "mlstm"


@dataclass
class xLSTMLMModelConfig(xLSTMBlockStackConfig):  # noqa: N801
    """A language model: token embedding -> block stack -> (tied) output head."""

    vocab_size: int = -1
    tie_weights: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
