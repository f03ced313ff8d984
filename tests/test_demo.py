"""The main job end to end on tiny settings: it trains, samples and writes its plot."""

from __future__ import annotations

import math

from xlstm_kernels.demo import load_corpus, run_demo, unigram_entropy


def test_demo_runs_end_to_end(kernel_backend, tmp_path):
    r = run_demo(steps=3, batch_size=2, context=16, sample_chars=6, out_dir=tmp_path, progress=False)
    assert r.backend == kernel_backend and r.steps == 3 and len(r.losses) == 3
    assert all(math.isfinite(v) for v in r.losses) and math.isfinite(r.val_loss)
    assert r.sample.startswith("The ") and len(r.sample) == 4 + 6
    assert (tmp_path / "demo_loss.png").stat().st_size > 1000


def test_unigram_entropy_of_the_corpus():
    import numpy as np

    text = load_corpus()
    chars = sorted(set(text))
    tokens = np.array([chars.index(c) for c in text])
    h = unigram_entropy(tokens, len(chars))
    assert 2.5 < h < math.log(len(chars))  # English letters: ~3 nats, below uniform
