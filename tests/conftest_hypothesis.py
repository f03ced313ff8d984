"""Hypothesis profiles for tests/test_properties.py.

* ``ci`` (the default): a modest, derandomized example count per op family, no deadline
  (the emulator compiles a kernel the first time a template is seen), too_slow and the
  function-scoped-fixture health checks suppressed (the backend fixture is a context
  manager that is the same for every example).
* ``thorough``: >= 500 examples per family, randomized; ``pytest tests/test_properties.py
  --hypothesis-profile=thorough`` (about 20-40 minutes on 2 cores, mostly compiling new
  kernel variants on the first run; later runs reuse the emulator's disk cache).

``--hypothesis-profile`` is read by Hypothesis' pytest plugin at start-up, before test
modules are imported, so the profiles must be registered from ``tests/conftest.py``
(``import conftest_hypothesis  # noqa: F401``). test_properties.py imports this module
too, so the ``ci`` default holds even without that line.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

CI_EXAMPLES = int(os.environ.get("XLSTM_HYPOTHESIS_CI_EXAMPLES", "8"))
THOROUGH_EXAMPLES = 500

_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]

settings.register_profile(
    "ci", max_examples=CI_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=_QUIET, print_blob=True
)
settings.register_profile(
    "thorough", max_examples=THOROUGH_EXAMPLES, deadline=None, suppress_health_check=_QUIET, print_blob=True
)

if settings.get_current_profile_name() == "default":  # no --hypothesis-profile given
    settings.load_profile("ci")
