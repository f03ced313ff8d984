"""Spying on the kernel launches of memoised ops (shared by the tests that count launches).

Memoised ops (ops/_callcache.py) prepare a launch once per signature with
``prepare_launch`` and then run it per call; a spy therefore wraps the prepared run, and
clears the module's call memos so that calls prepared before the spy cannot bypass it.
"""

from __future__ import annotations

from typing import Any, Callable

from xlstm_kernels.ops._callcache import CallCache


def spy_prepared_launches(monkeypatch, module: Any, record: Callable[[Any, dict], Any]) -> None:
    """Make every launch that `module` prepares call ``record(spec, kwargs)`` (kwargs with
    this call's ``inputs``) before each run (a `record` that raises stops the op there)."""
    real = module.prepare_launch

    def prepare_spy(spec, **kwargs):
        run = real(spec, **kwargs)

        def recorded(inputs):
            record(spec, {**kwargs, "inputs": list(inputs)})
            return run(inputs)

        return recorded

    monkeypatch.setattr(module, "prepare_launch", prepare_spy)
    clear_call_memos(module)


def clear_call_memos(module: Any) -> None:
    """Forget the prepared calls of `module` (its CallCache objects)."""
    for memo in vars(module).values():
        if isinstance(memo, CallCache):
            memo.clear()
