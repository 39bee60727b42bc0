"""Counting calls into the package: Python functions (and generator resumptions) whose code lives
in ``mlx_lm_patches``, while a piece of code runs.

On Python >= 3.12 ``sys.monitoring`` reports the start and resumption of every code object and
is told to stop reporting the ones outside the package, so counting costs nearly nothing after
the first step; before 3.12 ``sys.setprofile`` sees every call (slower, same count).
"""

import collections
import os
import sys

import mlx_lm_patches

PACKAGE = os.path.dirname(os.path.abspath(mlx_lm_patches.__file__)) + os.sep


def _ours(code) -> bool:
    return code.co_filename.startswith(PACKAGE)


def count_calls(run):
    """``(result of run(), Counter of (file, function) -> calls into the package)``."""
    counts = collections.Counter()

    def note(code):
        counts[(code.co_filename[len(PACKAGE):], code.co_name)] += 1

    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        def profile(frame, event, arg):
            if event == "call" and _ours(frame.f_code):
                note(frame.f_code)

        sys.setprofile(profile)
        try:
            return run(), counts
        finally:
            sys.setprofile(None)

    tool = next(t for t in range(6) if monitoring.get_tool(t) is None)
    events = monitoring.events.PY_START | monitoring.events.PY_RESUME

    def started(code, offset):
        if not _ours(code):
            return monitoring.DISABLE
        note(code)

    monitoring.use_tool_id(tool, "mlx-lm-patches test: calls into the package")
    try:
        monitoring.register_callback(tool, monitoring.events.PY_START, started)
        monitoring.register_callback(tool, monitoring.events.PY_RESUME, started)
        monitoring.set_events(tool, events)
        try:
            return run(), counts
        finally:
            monitoring.set_events(tool, 0)
    finally:
        monitoring.register_callback(tool, monitoring.events.PY_START, None)
        monitoring.register_callback(tool, monitoring.events.PY_RESUME, None)
        monitoring.free_tool_id(tool)
        monitoring.restart_events()
