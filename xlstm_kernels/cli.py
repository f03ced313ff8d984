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
