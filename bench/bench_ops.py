"""Norms, RoPE and attention vs their mx.fast counterparts, in the same run.

    python bench/bench_ops.py [--backend metal|emulate] [--families norm,rope,attention]
                              [--dtypes float32,float16,bfloat16] [--quick] [--out FILE]

Each family lives in bench/ops_<family>.py with `run(backend, dtypes, quick) -> rows`.
On Metal the rows give time, the ratio to MLX's op, GB/s or TFLOP/s and % of the
device roofline (from the matched preset); on the emulator only correctness (and the
emulated time) is meaningful, and the shapes are tiny.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))

FAMILIES = ("norm", "rope", "attention", "fused")


def print_rows(rows: list[dict]) -> None:
    keys = ["op", "shape", "dtype", "ours_ms", "mlx_ms", "ratio", "gbps", "tflops", "pct_roofline", "max_rel_err", "emulated_s"]
    present = [k for k in keys if any(k in r for r in rows)]
    print("  ".join(f"{k:>12}" for k in present))
    for r in rows:
        cells = []
        for k in present:
            v = r.get(k, "")
            cells.append(f"{v:>12.4g}" if isinstance(v, float) else f"{str(v):>12}")
        print("  ".join(cells))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("metal", "emulate"), default="metal" if mx.metal.is_available() else "emulate")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--dtypes", default="float32,float16,bfloat16")
    p.add_argument("--quick", action="store_true", help="small shapes (the default on the emulator)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtypes = [getattr(mx, d) for d in args.dtypes.split(",")]
    quick = args.quick or args.backend == "emulate"
    results = {}
    for family in args.families.split(","):
        try:
            module = importlib.import_module(f"xlstm_kernels.benchmarks.ops_{family}")
        except ModuleNotFoundError:
            print(f"(no bench module for {family})")
            continue
        print(f"== {family}")
        rows = module.run(args.backend, dtypes, quick)
        print_rows(rows)
        results[family] = rows
    out = Path(args.out or Path(__file__).parent / "results" / f"ops-{args.backend}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python bench/bench_ops.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "backend": args.backend, "machine": platform.platform(), "mlx": mx.__version__, "results": results,
    }, indent=2, default=str) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
