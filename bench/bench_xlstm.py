"""xLSTM kernels vs mx-ops versions, plus end-to-end tokens/s of the demo model.

    python bench/bench_xlstm.py [--backend metal|emulate|reference] [--dtypes ...] [--quick] [--out FILE]

* mLSTM: the chunkwise kernels vs an mx-ops implementation of the same chunkwise math
  (xlstm_kernels/benchmarks/ops_mlstm.py); target on Apple GPUs >= 2x at S >= 1024.
* sLSTM: the fused sequence kernel vs a per-step mx-ops loop (xlstm_kernels/benchmarks/ops_slstm.py);
  target >= 10x.
* end to end: training steps/s and tokens/s of the demo model (xlstm_kernels.demo),
  and generation tokens/s in step mode.
Shapes S = 512..4096, B*NH = 8..32, DH = 64..256 on Metal; tiny on the emulator.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_ops import print_rows  # noqa: E402

from xlstm_kernels import runtime  # noqa: E402
from xlstm_kernels.demo import demo_config  # noqa: E402
from xlstm_kernels.nn import generate, xLSTMLM  # noqa: E402


def end_to_end(backend: str, quick: bool) -> list[dict]:
    batch, context, steps, gen = (2, 16, 2, 8) if quick else (16, 64, 20, 200)
    rows = []
    with runtime.use_backend(backend):
        model = xLSTMLM(demo_config(64, context))
        opt = optim.AdamW(learning_rate=1e-3)
        step = nn.value_and_grad(model, lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean"))
        rng = np.random.default_rng(0)
        x = mx.array(rng.integers(0, 64, (batch, context + 1)))
        loss, grads = step(model, x[:, :-1], x[:, 1:])  # warm-up
        mx.eval(loss, grads)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss, grads = step(model, x[:, :-1], x[:, 1:])
            opt.update(model, grads)
            mx.eval(loss, model.parameters(), opt.state)
        train_s = (time.perf_counter() - t0) / steps
        rows.append({"op": "demo-train", "shape": f"{batch}x{context}", "dtype": "float32",
                     "ours_ms": train_s * 1e3, "tokens_per_s": batch * context / train_s})
        t0 = time.perf_counter()
        for tok in generate(model, mx.array([1, 2, 3]), gen, temperature=1.0, key=mx.random.key(0)):
            mx.eval(tok)
        gen_s = time.perf_counter() - t0
        rows.append({"op": "demo-generate", "shape": f"1x{gen}", "dtype": "float32",
                     "ours_ms": gen_s * 1e3 / gen, "tokens_per_s": gen / gen_s})
    for r in rows:
        print(f"{r['op']:<14} {r['shape']:<8} {r['ours_ms']:9.2f} ms  {r['tokens_per_s']:10.1f} tokens/s")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("metal", "emulate", "reference"),
                   default="metal" if mx.metal.is_available() else "emulate")
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtypes = [getattr(mx, d) for d in args.dtypes.split(",")]
    quick = args.quick or args.backend == "emulate"
    results = {}
    if args.backend != "reference":
        for family in ("mlstm", "slstm"):
            try:
                module = importlib.import_module(f"xlstm_kernels.benchmarks.ops_{family}")
            except ModuleNotFoundError:
                print(f"(no bench module for {family})")
                continue
            print(f"== {family}")
            results[family] = module.run(args.backend, dtypes, quick)
            print_rows(results[family])
    print("== end to end (demo model)")
    results["end_to_end"] = end_to_end(args.backend, quick)
    out = Path(args.out or Path(__file__).parent / "results" / f"xlstm-{args.backend}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python bench/bench_xlstm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "backend": args.backend, "machine": platform.platform(), "mlx": mx.__version__, "results": results,
    }, indent=2, default=str) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
