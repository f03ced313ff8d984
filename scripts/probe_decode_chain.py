"""Probe: the split-KV tile pass 1's block size and stages for one decode sequence, chained
and interleaved with MLX (session 17).

    python3 scripts/probe_decode_chain.py [--out decode_chain.json]      # on the GPU

`scripts/probe_decode.py` times each variant apart from the others; chained decode times
moved by up to 2x between its rows (session 14). Here every repeat runs one chain (20
calls, each taking the last one's output as its query) of MLX's SDPA and of every
variant, the order rotating, and each row is the median over PROBE_DC_REPEATS repeats.
PROBE_DC_MODE=rules (default): block-size rules (RULES, patching ops.attention._mma_block_for;
PROBE_DC_RULES="shipped tg512" names them, tgN: the shipped rule aiming for N groups).
PROBE_DC_MODE=grid: a variant patches ops.attention's SPLIT_KV_MMA_TARGET_GROUPS (tgN: the block size is 4096
halved until the grid has N threadgroups; PROBE_DC_GROUPS) and SPLIT_KV_MMA_MAX_STAGES (stN; PROBE_DC_STAGES), and the call
memo is cleared around it (each chain replays a graph recorded under the variant).
PROBE_DC_SHAPES="B,Hq,Hkv,Lk,D ..." picks the shapes; dtype bfloat16. PROBE_DC_MARGINAL=1 (session 26):
each time is the chain's steady state (timing.measure_marginal: a 2n-call chain's time beyond an
n-call one; MLX's CUDA backend launches its first graph only after up to 100 encoded calls, so a
20-call chain also counts the host's encoding); bsN rules: N keys a block on every shape.
Dotted rule names combine tokens (session 27): "nw4.bs1024" runs 4 simdgroups per tile pass 1
threadgroup (SPLIT_KV_MMA_WARPS) at 1024 keys a block; "nw2" the shipped block rule; "nw4.tg128.st2"
aims for 128 threadgroups at 2 stages; ktN: tiles of N keys (SPLIT_KV_MMA_TILE); pf0 / pf1 (session 28):
pass 2 without / with its first batch of loads ahead of the lse reduction (REDUCE_PREFETCH).
clN (session 38): the split_kv_cluster knob N (threadgroup clusters; cuda needs MLX_USE_CUDA_GRAPHS=0;
no clN token: the shipped default, none). sm0 / sm1 (session 39): one-launch decode
(attention_decode_stream) off / on wherever it can run (no smN token: the shipped automatic rule).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx

import xlstm_kernels as xk
from xlstm_kernels.benchmarks.timing import fastest_quarter, measure_chained_variants
from xlstm_kernels.ops import attention as att

CALLS = 20
REPEATS = int(os.environ.get("PROBE_DC_REPEATS", "9"))
GROUPS = tuple(int(v) for v in os.environ.get("PROBE_DC_GROUPS", "128 256 512 1024").split())
STAGES = tuple(int(v) for v in os.environ.get("PROBE_DC_STAGES", "2 3 4").split())
_shipped_rule = att._mma_block_for


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _floor_rule(lo: int, blocks: int):
    """The shipped block size, raised to at least `lo` keys and to at most `blocks` key
    blocks (pass 2 merges 32 blocks at a time)."""
    return lambda per_block, lk, target=None, clusters=False: max(_shipped_rule(per_block, lk, target), lo,
                                                                  _pow2_at_least(-(-lk // blocks)))


def _groups_rule(groups: int):
    """The shipped rule aiming for `groups` threadgroups whatever the head width."""
    return lambda per_block, lk, target=None, clusters=False: _shipped_rule(per_block, lk, groups)


def _fixed_rule(bs: int):
    """Every call `bs` keys a block, whatever the shape (session 26's marginal chains)."""
    return lambda per_block, lk, target=None, clusters=False: bs


RULES = {"shipped": _shipped_rule, "max32": _floor_rule(64, 32), "max32 min128": _floor_rule(128, 32),
         "max16 min128": _floor_rule(128, 16)}
RULES.update({f"bs{bs}": _fixed_rule(bs) for bs in (64, 128, 256, 512, 1024, 2048, 4096)})
# PROBE_DC_RULES="shipped tg512": the rules compared (tgN: _groups_rule(N))
_names = os.environ.get("PROBE_DC_RULES", "").split()
_REDUCE_BATCH = att.REDUCE_BATCH
_PREFETCH = att.REDUCE_PREFETCH
_WARPS = att.SPLIT_KV_MMA_WARPS
_TILE = att.SPLIT_KV_MMA_TILE
_cluster_for = att._cluster_for
_clusters_possible = att._clusters_possible
_use_stream = att._use_stream


def _token(name: str, prefix: str) -> int | None:
    """N of the first token prefixN of a dotted rule name ("nw4.bs1024": nw 4, bs 1024)."""
    for tok in name.split("."):
        if tok.startswith(prefix) and tok[len(prefix):].isdigit():
            return int(tok[len(prefix):])
    return None


def _rule_of(name: str):
    """A rule name's block-size rule: tgN, bsN or a RULES name among its dotted tokens, else
    the shipped rule. rbN (session 26): pass 2 loads N blocks at a time (REDUCE_BATCH); nwN
    (session 27): the tile pass 1 runs N simdgroups per threadgroup (SPLIT_KV_MMA_WARPS)."""
    for tok in name.split("."):
        if tok.startswith("tg") and tok[2:].isdigit():
            return _groups_rule(int(tok[2:]))
        if tok in RULES:
            return RULES[tok]
    return _shipped_rule


if _names:
    RULES = {n: _rule_of(n) for n in _names}


def _use(groups: int | None, stages: int | None, saved: dict, rule=None, name: str = "") -> None:
    att.REDUCE_BATCH = _token(name, "rb") or _REDUCE_BATCH
    pf = _token(name, "pf")
    att.REDUCE_PREFETCH = _PREFETCH if pf is None else bool(pf)
    att.SPLIT_KV_MMA_WARPS = _token(name, "nw") or _WARPS
    att.SPLIT_KV_MMA_TILE = _token(name, "kt") or _TILE
    att.SPLIT_KV_MMA_TARGET_GROUPS = groups or saved["SPLIT_KV_MMA_TARGET_GROUPS"]
    att.SPLIT_KV_MMA_MAX_STAGES = stages or saved["SPLIT_KV_MMA_MAX_STAGES"]
    att._mma_block_for = rule or _shipped_rule
    cl = _token(name, "cl")
    sm = _token(name, "sm")
    att._use_stream = _use_stream if sm is None else (
        lambda knob, q, k, v, m, backend: bool(sm) and att._stream_refusal(q, k, v, backend) is None)
    att._cluster_for = _cluster_for if cl is None else (lambda knob, *a: _cluster_for(cl, *a))
    att._clusters_possible = _clusters_possible if cl is None else (lambda knob, *a: _clusters_possible(cl, *a))
    att._CALLS.clear()
    att._FAMILIES.clear()
    att._LAST_FAMILY[0] = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = [(1, 32, 8, lk, 128) for lk in (1024, 2048, 4096, 8192, 16384, 32768)] + [
        (8, 32, 8, 8192, 128), (4, 32, 8, 32768, 128), (16, 32, 8, 4096, 128), (1, 32, 32, 16384, 64),
        (1, 32, 32, 4096, 128), (4, 32, 8, 2048, 128)]
    if os.environ.get("PROBE_DC_SHAPES"):
        shapes = [tuple(int(v) for v in s.split(",")) for s in os.environ["PROBE_DC_SHAPES"].split()]
    saved = {k: getattr(att, k) for k in ("SPLIT_KV_MMA_TARGET_GROUPS",
                                          "SPLIT_KV_MMA_MAX_STAGES")}
    print(f"shipped: groups {saved['SPLIT_KV_MMA_TARGET_GROUPS']}, stages {saved['SPLIT_KV_MMA_MAX_STAGES']}, "
          f"warps {_WARPS}; "
          f"{CALLS} chained calls, median of {REPEATS} interleaved repeats, us per call")
    rows = []
    t0 = time.perf_counter()
    for (b, hq, hkv, lk, d) in shapes:
        q = mx.random.normal((b, hq, 1, d)).astype(mx.bfloat16)
        k = mx.random.normal((b, hkv, lk, d)).astype(mx.bfloat16)
        v = mx.random.normal((b, hkv, lk, d)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        scale = d**-0.5
        ours = lambda a: xk.scaled_dot_product_attention(a, k, v, scale=scale)  # noqa: E731
        mlx = lambda a: mx.fast.scaled_dot_product_attention(a, k, v, scale=scale)  # noqa: E731
        ref = mlx(q).astype(mx.float32)
        if os.environ.get("PROBE_DC_MODE", "rules") == "rules":
            variants = [("mlx", None, None)] + [(name, None, None) for name in RULES]
        else:
            variants = [("mlx", None, None)] + [(f"tg{g} st{s}", g, s) for g in GROUPS for s in STAGES]
        errs = {}
        plans = {}

        def prepare(name, g, s):
            if name == "mlx":
                return mlx
            _use(g, s or _token(name, "st"), saved, RULES.get(name), name)
            if name not in errs:
                o = ours(q).astype(mx.float32)
                errs[name] = (mx.abs(o - ref).max() / mx.abs(ref).max()).item()
                cl_knob = _token(name, "cl")
                bs = att._auto_block_size_mma(q, k, v, "cuda", cl_knob)
                nw = att._mma_warps(hq // hkv, d, d, q.dtype, "cuda")
                cl = att._cluster_for(cl_knob, -(-lk // bs), hq // hkv, d, d, q.dtype, "cuda")
                plans[name] = f"bs{bs} nb{-(-lk // bs)} w{nw} c{cl}"
                if att._use_stream(None, q, k, v, att._check_inputs(q, k, v, scale, None), "cuda"):
                    plans[name] = "stream " + "x".join(map(str, att._stream_plan(hq // hkv, d, d, q.dtype, "cuda")))
            return ours

        times = measure_chained_variants([(n, (lambda n=n, g=g, s=s: prepare(n, g, s))) for n, g, s in variants], q,
                                         calls=CALLS, repeats=REPEATS,
                                         marginal=os.environ.get("PROBE_DC_MARGINAL", "0") == "1")
        times = {n: [t * 1e6 for t in ts] for n, ts in times.items()}
        _use(None, None, saved)
        m = statistics.median(times["mlx"])
        nbytes = k.nbytes + v.nbytes
        print(f"{b}x{hq}x{hkv}x{lk} D{d}: mlx {m:.1f} us")
        for name, g, s in variants[1:]:
            t = statistics.median(times[name])
            print(f"  {name:12s} {plans[name]:12s} {t:7.1f} us  ratio {m / t:5.2f}  q25 {fastest_quarter(times[name]):6.1f}"
                  f"  spread {min(times[name]):6.1f}-{max(times[name]):6.1f}  err {errs[name]:.1e}", flush=True)
            rows.append(dict(shape=[b, hq, hkv, lk, d], variant=name, plan=plans[name], chain_us=t, mlx_chain_us=m,
                             ratio=m / t, err=errs[name], kv_bytes=nbytes, all_us=times[name]))
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
