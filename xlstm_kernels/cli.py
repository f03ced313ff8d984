"""The ``xlstm-kernels`` command line: thin wrappers over library functions."""

from __future__ import annotations

import argparse
import os
import sys

from . import runtime

__all__ = ["main"]


def _check_backend(explicit: str | None) -> str:
    """`check`, `bench` and `tune` exercise kernels: on Metal or CUDA where there is such a
    GPU, else through the emulator, unless a backend was chosen (flag or environment)."""
    if explicit:
        return explicit
    if os.environ.get(runtime.ENV_VAR, "").strip():
        return runtime.current_backend()
    for gpu in ("metal", "cuda"):
        if gpu in runtime.BACKENDS and runtime.available(gpu)[0]:
            return gpu
    return "emulate"


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


DEFAULT_OUT = "xlstm-kernels-results"


def _argtype(parse, name: str):
    """An argparse `type=` from a benchmarks.args parser: its error names the argument."""

    def convert(text: str):
        from .benchmarks.args import BenchArgumentError

        try:
            return parse(text, name)
        except BenchArgumentError as e:
            msg = str(e)
            raise argparse.ArgumentTypeError(msg[len(name) + 2:] if msg.startswith(name + ": ") else msg) from None

    return convert


_OPTION_NAMES = ("ops", "op", "dtypes", "dtype", "shapes", "limit", "paths", "repeats", "backend")


def _fail(command: str, e: BaseException) -> int:
    """Print a library error as the command's error (no traceback); exit status 2."""
    msg = str(e)
    head = msg.split(":", 1)[0]
    if head in _OPTION_NAMES:  # the library names its parameter; the user typed the option
        msg = "--" + msg
    print(f"xlstm-kernels {command}: error: {msg}", file=sys.stderr)
    return 2


def _command_line(argv: list[str] | None) -> str:
    return "xlstm-kernels " + " ".join(argv if argv is not None else sys.argv[1:])


def _cmd_bench(args: argparse.Namespace) -> int:
    from .benchmarks import BenchArgumentError, format_table, run_bench, save_results
    from .benchmarks.report import format_row, table_header
    from .tiles import TileConfigError

    backend = runtime.current_backend()
    print(f"xlstm-kernels bench: our kernels vs MLX on backend '{backend}'", flush=True)
    header_shown = []

    def on_row(row: dict) -> None:
        if not header_shown:
            print(table_header(row.get("emulated", False)), flush=True)
            header_shown.append(True)
        print(format_row(row), flush=True)

    try:
        res = run_bench(args.ops, args.dtypes, args.shapes, quick=args.quick, backend=backend, warmup=args.warmup,
                        repeats=args.repeats, seed=args.seed, on_row=on_row,
                        on_note=lambda s: print(f"note: {s}", flush=True))
        res.command = _command_line(getattr(args, "argv", None))
        files = save_results(res, args.out)
    except (BenchArgumentError, TileConfigError, runtime.BackendUnavailableError, OSError) as e:
        return _fail("bench", e)
    if not res.rows:
        print(format_table([], res.emulated))
    d = res.device
    print(f"device {d['name']} (family {d['family']}); roofline {res.roofline}")
    from .benchmarks.copy_rate import target_summary

    for line in target_summary(res.rows, res.copy):
        print(line)
    failed = [r for r in res.rows if not r.get("ok")]
    print(f"{len(res.rows) - len(failed)} ok, {len(failed)} failed, {len(res.skipped)} families skipped, "
          f"{len(res.errors)} family errors in {res.seconds:.1f} s")
    for e in res.errors:
        print(f"error: {e['family']}: {e['error']}")
    print("saved " + ", ".join(files[k] for k in ("json", "csv", "png")))
    return 0 if res.ok else 1


def _cmd_tune(args: argparse.Namespace) -> int:
    from .benchmarks import BenchArgumentError, format_leaderboard, tune, write_presets
    from .benchmarks.tuner import TuneError, ensure_presets_file, presets_target, save_tune
    from .tiles import KNOB_OPS, TileConfigError
    from .tiles.env import ENV_PRESETS
    from .tiles.knobs import knob_env_vars

    backend = runtime.current_backend()
    knob_op = args.op in KNOB_OPS
    if args.shapes is not None:  # the number of sizes depends on the op
        from .benchmarks.args import parse_shapes
        from .benchmarks.tune_knobs import parse_knob_shapes

        try:
            args.shapes = (parse_knob_shapes(args.op, args.shapes, "--shapes") if knob_op
                           else parse_shapes(args.shapes, "--shapes"))
        except BenchArgumentError as e:
            print(f"xlstm-kernels tune: error: argument {e}", file=sys.stderr)
            return 2
    if args.paths is not None and knob_op:
        print(f"xlstm-kernels tune: error: argument --paths: applies to the GEMM ops only; {args.op} sweeps its "
              f"knobs {', '.join(KNOB_OPS[args.op])}", file=sys.stderr)
        return 2
    try:
        if args.write and os.environ.get(ENV_PRESETS, "").strip() and ensure_presets_file(presets_target()):
            print(f"created {presets_target()} (named by {ENV_PRESETS})", flush=True)
        prefix = f"XLSTM_{args.op.upper()}_" if knob_op else "XLSTM_GEMM_"
        if args.env:
            mode = f"a subprocess per candidate with {prefix}* set"
        else:
            mode = "in process (the op's knob arguments)" if knob_op else "in process (tiles=)"
        print(f"xlstm-kernels tune: {args.op} {args.dtype} on backend '{backend}', {mode}", flush=True)
        watched = set(knob_env_vars(args.op)) if knob_op else None
        shadowing = sorted(v for v in os.environ if os.environ[v].strip()
                           and (v in watched if knob_op else v.startswith("XLSTM_GEMM_")))
        if args.write and shadowing:
            print(f"note: {', '.join(shadowing)} set: environment variables take precedence over the preset file, "
                  "so the written winners apply once they are unset", flush=True)
        if backend == "emulate":
            print("note: emulator: times are CPU-emulator times (they rank configs for the emulator's 'cpu' family, "
                  "not for a GPU); tiny shapes and the quick grid only", flush=True)
        res = tune(args.op, args.dtype, args.shapes, env=args.env, quick=args.quick, limit=args.limit,
                   paths=args.paths, backend=backend, warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                   progress=not args.no_progress)
        print(format_leaderboard(res, top=args.top))
        write_error = None
        if args.write and res.winners:
            try:
                write_presets(res)
            except (TileConfigError, OSError) as e:  # the sweep's results are saved all the same
                write_error = e
        files = save_tune(res, args.out)
        print(f"saved {files['json']}, {'bar chart' if knob_op else 'heatmap'} {files['png']}")
        if write_error is not None:
            return _fail("tune", write_error)
        if args.write and not res.winners:
            print("nothing written: no candidate was correct on every shape of a class", file=sys.stderr)
        elif args.write:
            section = "kernel_shapes" if knob_op else "shapes"
            print(f"wrote winners for family '{res.device['family']}' to {res.presets_path} "
                  f"({section}.<class>.{res.op}.{res.dtype}; the runtime loads this file)")
        else:
            print(f"(not written; --write stores the winners in {presets_target()})")
    except (BenchArgumentError, TileConfigError, TuneError, runtime.BackendUnavailableError, OSError) as e:
        return _fail("tune", e)
    return 0 if res.winners else 1


def _cmd_info(args: argparse.Namespace) -> int:
    import json

    from .benchmarks import BenchArgumentError, collect_info, format_info

    try:
        info = collect_info(args.shapes, args.dtype)
    except BenchArgumentError as e:
        return _fail("info", e)
    print(json.dumps(info, indent=2, default=str) if args.json else format_info(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .benchmarks.args import parse_dtypes, parse_positive_int, parse_shapes
    from .benchmarks.suite import parse_ops
    from .benchmarks.tuner import PATHS, TUNABLE_OPS, parse_tune_op

    def one_dtype(text: str, name: str) -> str:
        from .benchmarks.args import BenchArgumentError

        dts = parse_dtypes(text, name)
        if len(dts) != 1:
            raise BenchArgumentError(f"{name}: one dtype, got {text!r}")
        return dts[0]

    def nonneg(text: str, name: str) -> int:
        from .benchmarks.args import BenchArgumentError

        if not text.strip().isdigit():
            raise BenchArgumentError(f"{name}: must be a non-negative integer, got {text!r}")
        return int(text)

    def any_shapes(text: str, name: str) -> list[tuple[int, ...]]:
        """Sizes joined by 'x' (the op decides how many: checked by tune)."""
        return parse_shapes(text, name, dims=None, form="sizes joined by 'x' in the op's notation, e.g. 64x64x64")

    def paths(text: str, name: str) -> list[str]:
        from .benchmarks.args import parse_names

        return parse_names(text, name, PATHS, what="path")

    backend_help = "backend for this command (also accepted before the command)"

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
    d.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default=".", help="directory for demo_loss.png (default: current)")
    d.add_argument("--max-seconds", type=float, default=150.0, help="stop training after this long (default 150)")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser(
        "bench", help="time our kernels vs the MLX built-ins (table, JSON, CSV, PNG)",
        description="For each op, shape and dtype: our kernel vs the MLX built-in (or an mx-ops composite) in "
                    "the same run, after warm-up, median of repeats synchronised with mx.eval; max relative error "
                    "vs float64. On the emulator: correctness and the emulated rate only. "
                    "Output schema: docs/BENCH_SCHEMA.md.")
    b.add_argument("--ops", type=_argtype(parse_ops, "--ops"), default="all",
                   help="comma list of families gemm,norm,rope,attention,mlstm,slstm (or all) and/or GEMM ops "
                        "gemm_av,gemm_at_b,gemm_a_bt,linear (default: all)")
    b.add_argument("--dtypes", type=_argtype(parse_dtypes, "--dtypes"), default="float32,float16,bfloat16",
                   help="comma list of float32,float16,bfloat16 (default: all three)")
    b.add_argument("--shapes", type=_argtype(parse_shapes, "--shapes"), default=None,
                   help="GEMM shapes MxNxK (output M x N, reduction K), comma-separated, e.g. 1x4096x4096,512x512x512 "
                        "(default: by backend; tiny on the emulator)")
    b.add_argument("--quick", action="store_true", help="small shapes, few repeats (CI smoke test; < 1 min on the emulator)")
    b.add_argument("--out", default=DEFAULT_OUT, help=f"directory for bench-<backend>.json/.csv/.png (default: {DEFAULT_OUT})")
    b.add_argument("--repeats", type=_argtype(parse_positive_int, "--repeats"), default=None,
                   help="timed runs per case (default: 20 on Metal, 5 with --quick, 1 on the emulator)")
    b.add_argument("--warmup", type=_argtype(nonneg, "--warmup"), default=None, help="untimed runs first, at least 1 (compiles; default 3, 2 with --quick, 1 on the emulator)")
    b.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    b.add_argument("--backend", choices=runtime.BACKENDS, default=argparse.SUPPRESS, help=backend_help)
    b.set_defaults(func=_cmd_bench)

    t = sub.add_parser(
        "tune", help="sweep a kernel's tile configs or knobs, print a leaderboard, optionally write the winners "
                     "to the user presets",
        description="Enumerate every valid config of the op (GEMM: GemmConfig.validate rejects the rest; norms, "
                    "attention, mLSTM, sLSTM, fused: their knobs, checked like the runtime checks them), time each with a "
                    "progress bar, print a leaderboard and save a heatmap of time over (TM, TN) (knob ops: a bar chart). "
                    "With --write, store the winners per (device family, op, dtype, shape class) in the user preset "
                    "YAML the runtime loads ($XLSTM_KERNELS_PRESETS if set, else ~/.config/xlstm_kernels/presets.yaml).")
    t.add_argument("--op", required=True, type=_argtype(parse_tune_op, "--op"),
                   help=f"op to tune: {', '.join(TUNABLE_OPS)}")
    t.add_argument("--dtype", type=_argtype(one_dtype, "--dtype"), default="float16",
                   help="float32, float16 or bfloat16 (default float16)")
    t.add_argument("--shapes", type=_argtype(any_shapes, "--shapes"), default=None,
                   help="comma-separated shapes in the op's notation: GEMM MxNxK (output M x N, reduction K); "
                        "rms_norm/layer_norm ROWSxN; attention BxHxLqxLkxD (Lq <= 8 tunes the split-KV block size, "
                        "else block_q x block_k); mlstm BxHxSxD; slstm BxHxSxDH; fused MxNxK (fused_norm_linear) (default: tiny on "
                        "the emulator, about one per shape class on a GPU)")
    t.add_argument("--env", action="store_true",
                   help="run each candidate in a subprocess configured with XLSTM_GEMM_* (knob ops: "
                        "XLSTM_<OP>_<KNOB>) variables")
    t.add_argument("--write", action="store_true", help="store the winners in the user preset YAML")
    t.add_argument("--quick", action="store_true", help="a small grid of candidates (implied on the emulator)")
    t.add_argument("--limit", type=_argtype(parse_positive_int, "--limit"), default=None,
                   help="run at most N candidates per shape (the current config first, then a seeded shuffle)")
    t.add_argument("--paths", type=_argtype(paths, "--paths"), default=None,
                   help="GEMM ops only: restrict to scalar and/or simd (M == 1 shapes tune the gemv kernel)")
    t.add_argument("--repeats", type=_argtype(parse_positive_int, "--repeats"), default=None,
                   help="timed runs per candidate (default 10 on Metal, 5 on the emulator)")
    t.add_argument("--warmup", type=_argtype(nonneg, "--warmup"), default=None, help="untimed runs per candidate, at least 1 (default 2 on Metal, 1 on the emulator)")
    t.add_argument("--seed", type=int, default=0, help="seed of the inputs and of the candidate shuffle")
    t.add_argument("--top", type=_argtype(parse_positive_int, "--top"), default=10, help="leaderboard rows per shape")
    t.add_argument("--out", default=DEFAULT_OUT, help=f"directory for tune-<op>-<dtype>-<backend>.json/.png (default: {DEFAULT_OUT})")
    t.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    t.add_argument("--backend", choices=runtime.BACKENDS, default=argparse.SUPPRESS, help=backend_help)
    t.set_defaults(func=_cmd_tune)

    i = sub.add_parser("info", help="versions, device, preset family, backend, env overrides, configs per op",
                       description="MLX version, device name and architecture, matched preset family, active backend, "
                                   "every XLSTM_* override with its value, and the config explain() picks for sample shapes.")
    i.add_argument("--shapes", type=_argtype(parse_shapes, "--shapes"), default=None,
                   help="sample GEMM shapes MxNxK (default 512x512x512,1x4096x4096)")
    i.add_argument("--dtype", type=_argtype(one_dtype, "--dtype"), default="float16", help="dtype of the samples (default float16)")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.add_argument("--backend", choices=runtime.BACKENDS, default=argparse.SUPPRESS, help=backend_help)
    i.set_defaults(func=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        backend = _check_backend(args.backend) if args.command in ("check", "bench", "tune") else args.backend
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
