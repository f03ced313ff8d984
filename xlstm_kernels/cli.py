"""The ``xlstm-kernels`` command line: thin wrappers over library functions."""

from __future__ import annotations

import argparse
import os
import sys

from . import runtime

__all__ = ["main"]


def _check_backend(explicit: str | None) -> str:
    """`check` exercises kernels: Metal if there is a GPU, else the emulator,
    unless a backend was chosen (flag or environment)."""
    if explicit:
        return explicit
    if os.environ.get(runtime.ENV_VAR, "").strip():
        return runtime.current_backend()
    return "metal" if runtime.available("metal")[0] else "emulate"


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import HEADER, format_row, run_checks

    backend = runtime.current_backend()
    print(f"xlstm-kernels check: every shipped kernel vs float64 references on backend '{backend}'")
    print(HEADER, flush=True)
    results = run_checks(seed=args.seed, on_result=lambda r: print(format_row(r), flush=True))
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    backend = runtime.current_backend()
    print(f"xlstm-kernels demo: training a character-level xLSTM (mLSTM + sLSTM blocks) on backend '{backend}'")
    r = run_demo(steps=args.steps, seed=args.seed, out_dir=args.out, max_seconds=args.max_seconds)
    print(f"trained {r.steps} steps in {r.seconds:.1f} s ({r.tokens_per_s:,.0f} tokens/s)")
    print(f"loss: final train {r.final_train_loss:.3f}, validation {r.val_loss:.3f} nats/char; "
          f"unigram entropy of the text {r.unigram_entropy:.3f}")
    print(f"sample ({r.generate_tokens_per_s:,.0f} tokens/s, step mode with carried state):")
    print("  " + r.sample.replace("\n", "\n  "))
    if r.plot:
        print(f"loss curve: {r.plot}")
    ok = r.final_train_loss < r.unigram_entropy - 0.3
    print("result: " + ("learned (loss clearly below the unigram entropy)" if ok else "NOT below the unigram entropy"))
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlstm-kernels", description=__doc__)
    p.add_argument(
        "--backend",
        choices=runtime.BACKENDS,
        help=f"backend for this command (default: ${runtime.ENV_VAR}, else metal if available, else reference)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="run every shipped kernel against float64 references and print a table")
    c.add_argument("--seed", type=int, default=0, help="seed for the random inputs (default 0)")
    c.set_defaults(func=_cmd_check)
    d = sub.add_parser("demo", help="train a small xLSTM LM on a shipped text, print a sample, save a loss plot")
    d.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default=".", help="directory for demo_loss.png (default: current)")
    d.add_argument("--max-seconds", type=float, default=150.0, help="stop training after this long (default 150)")
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        backend = _check_backend(args.backend) if args.command == "check" else args.backend
    except ValueError as e:
        print(f"xlstm-kernels: {e}", file=sys.stderr)
        return 2
    if backend:
        ok, why = runtime.available(backend)
        if not ok:
            print(f"xlstm-kernels: backend '{backend}' is not available: {why}", file=sys.stderr)
            return 2
        with runtime.use_backend(backend):
            return args.func(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
