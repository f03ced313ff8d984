"""Prepared op calls, memoised per call signature: a repeated call's host path in microseconds.

An op's first call with a given signature (shapes, dtypes, flags, eps, ...) validates its
arguments, resolves tiles / knobs, builds the launch plan and the differentiable function;
later calls with the same signature *and the same configuration* reuse that function.
MLX's own ops spend ~2 us on the host per call; without this memo ours spent ~40 us in
Python, which capped every small or medium memory-bound op (see docs/CUDA.md).

The configuration is everything a resolve reads, compared on every lookup:
the backend (``use_backend`` / ``XLSTM_KERNELS_BACKEND``), every environment variable
the tile and knob resolvers read, the preset files' stamps (re-read at most every
``tiles.presets.STAMP_TTL_S``; ``tiles.reload_presets()`` forces it) and
``set_gemm_tiles``. So a changed variable or preset applies to the very next call, as
without the memo.

    _CALLS = CallCache("rms_norm")
    fn = _CALLS.get(key)
    if fn is None:
        fn = ...build...
        _CALLS.put(key, fn)
    return fn(x, w)

Only calls whose result depends on nothing but the key may be memoised (arrays are
arguments of the stored function, never part of it, except constants the op made).

Graph replay (:func:`replayable`): on the ``cuda`` and ``metal`` backends the stored
function's array core (the ``mx.custom_function`` and its launches) goes through
``mx.compile``, so a repeated call replays the recorded graph in C++ instead of running
the launch code in Python (H100 host: rms_norm 19 -> 5 us, decode attention 88 -> 12 us
per call; outputs and gradients bit-identical). On by default; ``XLSTM_KERNELS_REPLAY=0``
turns it off (:func:`replay_enabled`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Hashable

import mlx.core as mx

from ..runtime import backends as backends_mod
from ..tiles import env as env_mod
from ..tiles import knobs as knobs_mod
from ..tiles import presets as presets_mod
from ..tiles import resolve as resolve_mod

__all__ = ["CallCache", "REPLAY_BACKENDS", "REPLAY_ENV_VAR", "bare_unless_traced", "config_token", "placeholder",
           "replayable", "traced"]

REPLAY_ENV_VAR = "XLSTM_KERNELS_REPLAY"
# cuda: small constant inputs in device memory (runtime.const_array, cuda/constants.py)
DEVICE_CONSTS_ENV_VAR = "XLSTM_KERNELS_CUDA_DEVICE_CONSTS"
# Backends whose kernels are MLX primitives (mx.fast.metal_kernel / cuda_kernel), which a
# compiled graph can hold. The emulator runs kernels eagerly on the CPU and the reference
# backend is plain mx ops: neither gains anything from replay.
REPLAY_BACKENDS = ("cuda", "metal")

_all_env = env_mod.make_snapshot((backends_mod.ENV_VAR, REPLAY_ENV_VAR, DEVICE_CONSTS_ENV_VAR, *env_mod.GEMM_ENV_VARS,
                                  *knobs_mod._ALL_VARS))
_epochs: dict[tuple, int] = {}
# (env, override, gemm version, reloads, time, token) of the last configuration seen
_memo: list = [(None, None, None, None, -1e9, 0)]
_override = backends_mod._override
_version = resolve_mod._PROCESS_VERSION
_reloads = presets_mod.RELOADS
_monotonic = time.monotonic
_default_stream = mx.default_stream
_get_ident = threading.get_ident
_main_ident = threading.main_thread().ident
_default_device = mx.default_device


def config_token() -> int:
    """A small int that changes whenever any tile / knob / backend resolve could.

    The environment, the use_backend override and set_gemm_tiles' version are compared
    on every call; the preset files' stamps are re-read when those change, after
    reload_presets() or every STAMP_TTL_S. Equal configurations get equal tokens.

    The environment check is exact and cheap: :func:`tiles.env.make_snapshot` returns
    its previous tuple (the same object) while ``os.environ`` has not changed
    (:func:`tiles.env.environ_version`, a count of its changes: ~0.2 us where comparing
    the whole environment cost 0.5-2 us, session 22), so the usual call costs an identity
    test here; any change made through ``os.environ`` shows at the next call."""
    env = _all_env()
    override = _override.get()
    m_env, m_override, m_version, m_reloads, m_time, m_token = _memo[0]
    if (env is m_env or env == m_env) and override == m_override and _version[0] == m_version \
            and _reloads[0] == m_reloads and _monotonic() - m_time < presets_mod.STAMP_TTL_S:
        return m_token
    version, reloads, now = _version[0], _reloads[0], _monotonic()
    stamps = presets_mod.stack_stamps(env_mod.snapshot())
    token = _epochs.setdefault((override, version, env, stamps), len(_epochs))
    _memo[0] = (env, override, version, reloads, now, token)
    return token


def placeholder(dtype: mx.Dtype) -> mx.array:
    """A new one-element array of `dtype` standing in for an absent optional kernel input.

    A new array per use site: one array object passed both as an input of a replayed
    (``mx.compile``'d) function and used inside it as a constant makes MLX refuse the graph
    ("Attempting to compile a function with uncaptured inputs": the GEMM's call wrapper and
    its launcher, session 5). Made from data, so it is materialised at once: a
    lazily built constant (``mx.zeros``) kept by a memo would be evaluated by whichever
    thread first evaluates a graph using it, on the stream of the thread that built it
    (MLX's GPU streams belong to their thread: "There is no Stream(gpu, 0) in current
    thread", session 4), and evaluating it when made (``mx.eval``) synchronises with the
    GPU: a call that is not memoised (``tiles=`` of a dict, ``knobs=``) then waited for all
    the work queued before it (GEMM probe, session 5: 400+ us per call)."""
    return mx.array([0], dtype=dtype)


def replay_enabled() -> bool:
    """Whether :func:`replayable` compiles (``XLSTM_KERNELS_REPLAY``: 1 / unset = on; 0 = off).

    On by default. Ops are safe to call from several threads with it (the main thread
    replays, other threads run the launch code; tests/test_concurrency.py on the H100):
    session 4 saw "There is no Stream(gpu, 0) in current thread" because lazily built
    constant arrays kept by the memo were evaluated on another thread; they are now
    materialised when made (:func:`constant`)."""
    text = os.environ.get(REPLAY_ENV_VAR)
    if text is None or text.strip().lower() in ("", "1", "true", "on", "yes"):
        return True
    if text.strip().lower() in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{REPLAY_ENV_VAR}={text!r}: expected 1 or 0 (on / off)")


#: Traced calls in a row (no plain call between them) after which a signature stops going
#: through its compiled function and calls the custom function directly (a loop that only
#: differentiates: ``mx.compile`` adds its wrapper's cost to every traced call and replays
#: nothing for it).
MAX_TRACED_TRIES = 16
#: A signature calling its custom function directly checks every PROBE_PERIOD-th call
#: whether the arrays are plain (:func:`traced`), and goes back to replay if they are.
PROBE_PERIOD = 16

_probe_calls = [0]
# (dtype, ndim) of each input of the probe's calls known to be in mx.compile's cache: there
# the probe's Python runs only for tracers (a signature is added after a call without tracers)
_probe_known: set = set()


def _probe_mark(*arrays):
    _probe_calls[0] += 1
    return arrays[0]


# shapeless: a growing KV cache's new shapes every step must not re-trace it
_probe = mx.compile(_probe_mark, shapeless=True)


def traced(arrays) -> bool:
    """Whether `arrays` (a non-empty sequence) holds a tracer: the call is being
    differentiated (``mx.grad``, ``mx.vjp``, ``mx.jvp``), vmapped or compiled by the caller.

    MLX does not show a tracer to Python, but ``mx.compile`` does: a compiled function runs
    its Python on every call whose inputs include a tracer, and on no call after the first
    otherwise. So a compiled identity is called: if its Python does not run, no tracer.
    If it does, the call was traced or was the first of its input signature (dtypes and
    ranks; the probe is shapeless, and compile's cache is also per default stream): a
    signature already seen without tracers (``_probe_known``) is then traced; otherwise the
    identity is called again, and its Python runs again iff traced.

    Wrong answers can only be True for plain arrays (a new stream, or compile disabled),
    which costs the caller speed, never a gradient: False means the Python did not run.
    Off the main thread the answer is always True (the probe's count is one shared cell:
    another thread's probe could reset it between this one's call and its read)."""
    if _get_ident() != _main_ident:
        return True
    _probe_calls[0] = 0
    _probe(*arrays)
    if not _probe_calls[0]:
        return False
    key = tuple((a.dtype, a.ndim) for a in arrays)
    if key in _probe_known:
        return True
    _probe_calls[0] = 0
    _probe(*arrays)
    if _probe_calls[0]:
        return True
    _probe_known.add(key)
    return False


def bare_unless_traced(fn: Callable, backend: str, bare: Callable) -> Callable:
    """For calls that are not replayed (a decode loop's growing cache: a new shape every
    call): `bare` (`fn`'s forward without its ``mx.custom_function``) where the arrays are
    not traced, `fn` where they are (:func:`traced`), on the backends that replay;
    elsewhere `fn`. Saves the custom function's Python round trip and its two graph nodes
    per plain call."""
    if backend not in REPLAY_BACKENDS:
        return fn

    def call(*arrays):
        return fn(*arrays) if traced(arrays) else bare(*arrays)

    return call


# the states of a replayable signature (per default stream)
_CHECKING = 0  # no graph recorded yet: each call asks traced(); the first plain one records
_REPLAYING = 1  # recorded: every call goes through the compiled function
_DIRECT = 2  # traced calls only, lately: `fn` itself, traced() every PROBE_PERIOD calls


def replayable(fn: Callable, backend: str, bare: Callable | None = None) -> Callable:
    """`fn` through ``mx.compile`` when `backend` launches MLX primitives, else `fn`.

    `fn` must be the array core of one memoised call signature: it takes only arrays
    whose values may change between calls, and everything else it uses (launch plans,
    constant arrays the op made, scalars) is fixed by the memo key. Its first call per
    input shapes / dtypes records the graph (our Python runs once); later calls replay
    it. Gradients and vmap go through the compiled function as through `fn`.

    `bare`: `fn`'s forward without its ``mx.custom_function`` (the same launches). A custom
    function with a VJP adds two graph nodes per output (MLX's ``StopGradient`` and
    ``CustomTransforms``), ~0.5 us of every evaluated call on an H100 (session 21,
    scripts/probe_rope_consts.py: ccf against ccfv). With `bare` the recorded graph is
    the bare forward, recorded at the first call whose arrays are not traced
    (:func:`traced`); calls with traced arrays (gradients, vmap, a caller's compile) run
    `fn`, the custom function, as before.

    Traced calls (an eager training loop: ``mx.grad`` of a model every step) gain nothing
    from ``mx.compile``, which runs our Python for them and adds its own wrapper's cost
    (~5 us of the eager VJP's host time on an H100, session 22). So a signature whose last
    MAX_TRACED_TRIES calls were all traced calls `fn` directly, and every PROBE_PERIOD-th
    call checks whether its arrays are plain: if they are, it replays again (the
    compiled function, recording the bare forward if it has not yet)."""
    if backend not in REPLAY_BACKENDS or not replay_enabled():
        return fn
    # Only the main thread replays: MLX's GPU streams belong to their thread, and compiled
    # graphs run from other threads failed on the H100 ("There is no Stream(gpu, 0) in
    # current thread", tests/test_concurrency.py), even recorded per thread; other threads
    # run `fn` itself. One recording per default stream (mx.stream(...) contexts); MLX keys
    # compiled graphs on the Python function, so each recording gets its own.
    # (Streams compare by value but hash by identity: a short list, scanned.)
    # An entry: [stream, compiled, state, count]; count: traced calls in a row (_CHECKING,
    # _REPLAYING) or calls since the last check (_DIRECT).
    compiled: list[list] = []
    lock = threading.Lock()
    recording_bare = [False]
    record_ran = [0]

    def replay(*arrays):
        if _get_ident() != _main_ident:
            return fn(*arrays)
        stream = _default_stream(_default_device())
        for entry in compiled:
            if entry[0] == stream:
                return _STATES[entry[2]](entry, arrays)

        def record(*a):
            record_ran[0] += 1
            return bare(*a) if recording_bare[0] else fn(*a)

        with lock:
            entry = next((e for e in compiled if e[0] == stream), None)
            if entry is None:
                entry = [stream, mx.compile(record), _CHECKING if bare is not None else _REPLAYING, 0]
                compiled.append(entry)
        return _STATES[entry[2]](entry, arrays)

    def replaying(entry, arrays):
        """The compiled function; its Python runs only for a traced call (or the recording)."""
        record_ran[0] = 0
        out = entry[1](*arrays)
        if not record_ran[0]:
            entry[3] = 0
        else:
            entry[3] += 1
            if entry[3] >= MAX_TRACED_TRIES:
                entry[2], entry[3] = _DIRECT, 0
        return out

    def start_replay(entry, arrays):
        """A plain call: replay from now on (recording the bare forward if not yet)."""
        recording_bare[0] = bare is not None
        try:
            out = entry[1](*arrays)
        finally:
            recording_bare[0] = False
        entry[2], entry[3] = _REPLAYING, 0
        return out

    def checking(entry, arrays):
        """A call before any recording: record it if `arrays` are plain."""
        if not traced(arrays):
            return start_replay(entry, arrays)
        entry[3] += 1
        if entry[3] >= MAX_TRACED_TRIES:
            entry[2], entry[3] = _DIRECT, 0
        return fn(*arrays)

    def direct(entry, arrays):
        """`fn` itself; every PROBE_PERIOD-th call first checks for plain arrays."""
        entry[3] += 1
        if entry[3] >= PROBE_PERIOD:
            entry[3] = 0
            if not traced(arrays):
                return start_replay(entry, arrays)
        return fn(*arrays)

    _STATES = (checking, replaying, direct)
    return replay


class CallCache:
    """Memo of prepared calls of one op: key -> value, valid for the current configuration.

    Entries made under another configuration stay (switching back and forth, e.g. between
    backends in tests, reuses them); the memo is cleared when it holds `maxsize` entries.
    """

    def __init__(self, name: str, maxsize: int = 1024) -> None:
        self.name = name
        self.maxsize = maxsize
        self._entries: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        # bumped whenever entries are dropped (clear, or the memo full): a caller that keeps
        # a found value aside (ops.attention's last decode family) compares it to know the
        # value is still the memo's
        self.epoch = 0

    def get(self, key: Hashable) -> Any:
        """The value stored for `key` under the current configuration, else None."""
        try:
            return self._entries.get((key, config_token()))
        except TypeError:  # an unhashable key part: never memoised
            return None

    def put(self, key: Hashable, value: Any) -> Any:
        """Store `value` for `key` under the current configuration; returns `value`."""
        try:
            full = (key, config_token())
            hash(full)
        except TypeError:
            return value
        with self._lock:
            if len(self._entries) >= self.maxsize:
                self._entries.clear()
                self.epoch += 1
            self._entries[full] = value
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.epoch += 1

    def __len__(self) -> int:
        return len(self._entries)
