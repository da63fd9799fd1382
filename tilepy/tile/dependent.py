"""Programmatic dependent launch as a kernel piece: a kernel launched with programmatic stream
serialisation (``tilepy.launch.LaunchPlan(..., dependent=True)``, sm_90) may begin while the
kernel ahead of it in the stream is still running — its blocks' launch and set-up (shared
memory, mbarrier initialisation) overlap that kernel's tail instead of following it.

:func:`dependent_launch` gives ``begin()``: every thread of the kernel calls it once, after
its block's set-up and before its first access to global memory (a load, a store, an
atomic, a tensor-map fence or TMA). It waits until the kernel ahead has finished and its
writes are visible (:func:`tilepy.ptx.griddep.griddepcontrol_wait`), then lets the kernel
behind start launching (:func:`~tilepy.ptx.griddep.griddepcontrol_launch_dependents`: the
dependent grid launches once every block of this one has called it or exited). Nothing
this kernel reads or writes is touched before the kernel ahead has completed, so a launch
with the attribute is correct whatever ran before it; one without runs ``begin`` as two
instructions that return at once.

``dependent_launch(enabled, trigger="late")`` moves the second half to ``release()``, which
every thread calls once when its block needs no more of the GPU for itself (say, a GEMM's last
loads issued or its main loop done): the kernel behind then launches only as this one
finishes, not from its start (``begin`` alone waits). With ``trigger="early"`` ``release``
does nothing. ``dependent_launch(False)`` gives a ``begin`` and a ``release`` that do nothing
(the plain kernel's code)."""

from __future__ import annotations

import functools

from ..inline import device_namespace, inline_device
from ..ptx.griddep import griddepcontrol_launch_dependents, griddepcontrol_wait


@functools.cache
def dependent_launch(enabled: bool, trigger: str = "early"):
    """The namespace ``begin()``, ``release()`` of the module docstring; no-ops unless
    ``enabled``. ``trigger``: ``"early"`` (in ``begin``) or ``"late"`` (in ``release``)."""
    if trigger not in ("early", "late"):
        raise ValueError(f"dependent_launch: trigger {trigger!r} is 'early' or 'late'")
    WAIT = bool(enabled)
    EARLY = WAIT and trigger == "early"
    LATE = WAIT and trigger == "late"

    @inline_device
    def begin():
        if WAIT:
            griddepcontrol_wait()
        if EARLY:
            griddepcontrol_launch_dependents()

    @inline_device
    def release():
        if LATE:
            griddepcontrol_launch_dependents()

    return device_namespace(f"dependent_launch({bool(enabled)}, {trigger})", begin=begin,
                            release=release)


__all__ = ["dependent_launch"]
