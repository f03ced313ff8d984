"""Probe: what RoPE's one-token call costs past MLX's (session 21).

    python3 scripts/probe_rope_consts.py [--out rope_consts.json]      # on the GPU

At one position per sequence (decode) a chained call of our rope costs ~2.4 us more than
MLX's (sessions 17-20; a bare copy kernel chains faster than MLX's rope, so the launch is
not the cause). Our kernel reads its launch constants (sizes, scale) from a device array
before it can address x; MLX's kernel takes them by value. The variants, each chained and
interleaved with MLX's op (timing.measure_chained_variants, us per call):

* ``op``: ``xlstm_kernels.rope`` (memo, custom function, graph replay);
* ``raw``: the same launch called directly (no custom function, no replay);
* ``lit``: the body with params[] and scale written into the source as literals (what
  template constants would give): no dependent constant load before the first load of x;
* ``lit_off``: also the offset a literal (no offset load);
* ``lit_exp``: also the frequencies computed in the kernel (exp2), as MLX does: x is the
  only array read;
* ``raw_devoff``: ``raw`` with the offset in device memory (runtime.const_array) instead
  of the host array in MLX's managed memory;
* ``cf`` / ``cc`` / ``ccf``: ``raw`` inside an ``mx.custom_function``, inside
  ``mx.compile``, and both (what ``op`` replays);
* ``mlx_loop`` / ``op_loop``: MLX's op and ours with the offset advanced every second call
  (a decode loop's q and k share a step's offset): a new offset array every other call
  (ours: a lazily copied device value, one copy kernel per new offset);
* ``ccfv``: ``ccf`` with a VJP registered on the custom function (as ``op`` has);
* ``op_norep``: the op's stored call built without graph replay;
* ``raw_hostoff``: ``raw`` with the offset a host array (MLX's managed memory), as
  before session 21; ``raw_loop_dev`` / ``raw_loop_host``: ``raw`` with a new offset every
  second call, a lazily copied device value / a new host array;
* ``copy5``: a copy of x to y with the same five inputs bound, one element per thread:
  the floor of a custom-kernel launch of these bytes.

Each timed chain follows an untimed chain of the same variant (``PROBE_RC_SELF=0``: the
variants interleaved as timing.measure_chained_variants runs them, each chain after
another variant's, which costs 1.3-2.2 us a call: scripts/probe_chain_switch.py).
``PROBE_RC_ORDER=reverse`` runs the variants in reverse order after MLX's (each variant's
predecessor in the rotation changes). Shapes: ``PROBE_RC_SHAPES="B,H,L,D[,dtype] ..."`` (default the decode rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import _chain_once, fastest_quarter, measure_chained_variants
from xlstm_kernels.ops import rope as rope_ops
from xlstm_kernels.runtime import KernelSpec, const_array, current_backend, prepare_launch
from xlstm_kernels.runtime.sources import family_header

CALLS = 20
REPEATS = int(os.environ.get("PROBE_RC_REPEATS", "11"))
OFFSET = 4095
BASE = 10000.0


@dataclasses.dataclass(frozen=True)
class TextSpec(KernelSpec):
    """A KernelSpec whose body is given as text (the rope family's header)."""

    text: str = ""

    def source(self) -> str:
        return self.text

    def full_header(self) -> str:  # every header section of the family (its body is not in metal_src)
        return self.header + family_header(self.family)


def _literal_body(params: list[int], scale: float, offset: int | None, half: int | None) -> str:
    """The session-21 body with its constants as literals; ValueError where the body no
    longer reads them so (since session 29 the sizes come from the inputs' shapes, which
    is what the ``lit`` variants measured)."""
    body = rope_ops.ROPE.source()
    if "params[" not in body or "(scale * pos)" not in body:
        raise ValueError("metal_src/rope.metal no longer reads params[] (session 29: sizes from shapes)")
    body = re.sub(r"params\[(\d)\]", lambda m: str(params[int(m.group(1))]), body)
    body = body.replace("(scale * pos)", f"({scale!r}f * pos)")
    if offset is not None:
        body = body.replace("offsets[per_batch ? grp : 0u]", str(offset))
    if half is not None:  # freqs[j] = base^(j / half), as exp2(j * log2(base) / half)
        k = math.log2(BASE) / half
        body = body.replace("xk_load_runs_f<P, 1>(freqs, j0, P, half_dims, f);",
                            f"for (int k = 0; k < P; k++) {{ f[k] = metal::exp2(float(j0 + uint(k)) * {k!r}f); }}")
    return body


def _copy_body(n: int) -> str:
    return f"const uint i = thread_position_in_grid.x;\nif (i < {n}u) {{ y[i] = x[i]; }}\n"


def _spec(name: str, text: str) -> TextSpec:
    return TextSpec("rope", name, rope_ops.ROPE.input_names, ("y",), ensure_row_contiguous=False, text=text)


def _chains_after_self(order, x) -> dict[str, list[float]]:
    """Seconds per call of each variant's chain, each timed right after an untimed chain of
    the same variant (scripts/probe_chain_switch.py: a chain right after another op's
    costs 1.3-2.2 us a call more at these sizes, MLX's as well as ours, since the two
    share a CUDA graph key); the order rotates by one place per repeat."""
    times: dict[str, list[float]] = {k: [] for k, _ in order}
    for _, step in order:
        mx.eval(step(x))
        mx.eval(step(step(x)))
    for r in range(REPEATS):
        shift = r % len(order)
        for name, step in order[shift:] + order[:shift]:
            _chain_once(step, x, CALLS, False)
            times[name].append(_chain_once(step, x, CALLS, False))
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [(1, 32, 1, 128), (8, 32, 1, 128), (32, 32, 1, 128), (1, 32, 1, 64)]
    if os.environ.get("PROBE_RC_SHAPES"):
        shapes = [tuple(s.split(",")) for s in os.environ["PROBE_RC_SHAPES"].split()]
    backend = current_backend()
    rows = []
    t0 = time.perf_counter()
    for spec_ in shapes:
        shape = tuple(int(v) for v in spec_[:4])
        dtype = getattr(mx, spec_[4]) if len(spec_) > 4 else mx.bfloat16
        x = mx.random.normal(shape).astype(dtype)
        mx.eval(x)
        d = shape[-1]
        half = d // 2
        freqs32 = rope_ops._base_freqs(half, BASE)
        kw = rope_ops._launch_kwargs(x, d, False, 1.0, OFFSET, freqs32, False, backend)
        ins = kw["inputs"]
        b4, h4, seq_len, _ = kw["output_shapes"][0]
        n = rope_ops.ROWS_PER_THREAD
        params = [half, d, seq_len, h4, -(-h4 // n), 0]
        kernels = {"raw": rope_ops.ROPE}
        try:
            kernels.update({
                "lit": _spec("rope_lit", _literal_body(params, 1.0, None, None)),
                "lit_off": _spec("rope_lit_off", _literal_body(params, 1.0, OFFSET, None)),
                "lit_exp": _spec("rope_lit_exp", _literal_body(params, 1.0, OFFSET, half)),
            })
        except ValueError as e:
            print(f"lit variants dropped: {e}")
        runs = {name: prepare_launch(spec, **kw, backend=backend) for name, spec in kernels.items()}
        size = x.size
        ckw = dict(kw, grid=(size, 1, 1), threadgroup=(256, 1, 1), template=[("T", x.dtype)])
        runs["copy5"] = prepare_launch(_spec("rope_copy5", _copy_body(size)), **ckw, backend=backend)
        flat = tuple(kw["output_shapes"][0])

        def step_of(run):
            return lambda a: run([a.reshape(flat), *ins[1:]])[0].reshape(shape)

        mlx = lambda a: mx.fast.rope(a, d, traditional=False, base=BASE, scale=1.0, offset=OFFSET)  # noqa: E731
        ours = lambda a: xk.rope(a, d, base=BASE, offset=OFFSET)  # noqa: E731
        steps = {"mlx": mlx, "op": ours, **{k: step_of(r) for k, r in runs.items()}}
        raw = runs["raw"]
        counter = itertools.count(2 * OFFSET)
        steps["mlx_loop"] = lambda a: mx.fast.rope(a, d, traditional=False, base=BASE, scale=1.0,
                                                   offset=next(counter) // 2)
        steps["op_loop"] = lambda a: xk.rope(a, d, base=BASE, offset=next(counter) // 2)
        host_off = rope_ops._host_offset_array(OFFSET)
        steps["raw_hostoff"] = lambda a: raw([a.reshape(flat), host_off, *ins[2:]])[0].reshape(shape)
        steps["raw_loop_dev"] = lambda a: raw([a.reshape(flat), rope_ops._offset_array(next(counter) // 2, backend),
                                              *ins[2:]])[0].reshape(shape)
        steps["raw_loop_host"] = lambda a: raw([a.reshape(flat), mx.array([next(counter) // 2], dtype=mx.int32),
                                               *ins[2:]])[0].reshape(shape)
        dev_off = const_array([OFFSET], mx.int32)
        steps["raw_devoff"] = lambda a: raw([a.reshape(flat), dev_off, *ins[2:]])[0].reshape(shape)
        bare = lambda a, o, f: raw([a, o, f, *ins[3:]])[0]  # noqa: E731
        cf = mx.custom_function(bare)
        cc, ccf = mx.compile(bare), mx.compile(cf)
        cfv = mx.custom_function(bare)

        @cfv.vjp
        def _cfv_vjp(primals, cotangent, output):
            return cotangent, mx.zeros_like(primals[1]), mx.zeros_like(primals[2])

        offs = ins[1]
        built = rope_ops._build_call(x, d, False, BASE, 1.0, OFFSET, None, replay=False)
        steps["op_norep"] = lambda a: built(a, OFFSET, None)
        for name, fn in ((("cf", cf), ("cc", cc), ("ccf", ccf), ("ccfv", mx.compile(cfv)))
                         if backend != "emulate" else (("cf", cf),)):
            steps[name] = lambda a, fn=fn: fn(a, offs, freqs32)
        ref = mlx(x).astype(mx.float32)
        errs = {}
        for name, step in steps.items():
            if name not in ("copy5",) and "loop" not in name:
                o = step(x).astype(mx.float32)
                errs[name] = (mx.abs(o - ref).max() / mx.abs(ref).max()).item()
        order = list(steps.items())
        if os.environ.get("PROBE_RC_ORDER") == "reverse":  # MLX first, then the variants in reverse
            order = order[:1] + order[:0:-1]
        if os.environ.get("PROBE_RC_SELF", "1") == "1":
            times = _chains_after_self(order, x)
        else:
            times = measure_chained_variants([(k, (lambda s=s: s)) for k, s in order], x, calls=CALLS,
                                             repeats=REPEATS)
        times = {k: [t * 1e6 for t in ts] for k, ts in times.items()}
        tag = "x".join(map(str, shape)) + f" {dtype}"
        m = fastest_quarter(times["mlx"])
        print(f"{tag}: mlx q25 {m:.2f} med {statistics.median(times['mlx']):.2f} us")
        for name in steps:
            if name == "mlx":
                continue
            a = fastest_quarter(times[name])
            err = f"err {errs[name]:.1e}" if name in errs else ""
            print(f"  {name:8s} q25 {a:6.2f} med {statistics.median(times[name]):6.2f}  ratio(q25) {m / a:5.2f}  {err}",
                  flush=True)
            rows.append(dict(shape=list(shape), dtype=str(dtype), variant=name, all_us=times[name],
                             mlx_us=times["mlx"], err=errs.get(name)))
    _finish(args.out, rows, t0)


def _finish(out: str | None, rows: list, t0: float) -> None:
    """Print the run's total time; write `rows` as JSON to `out` when given."""
    print(f"total {time.perf_counter() - t0:.1f} s")
    if out:
        with open(out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
