"""Programmatic dependent launch (sm_90): a kernel launched with the programmatic
stream-serialisation attribute (``tilepy.launch.LaunchPlan(..., dependent=True)``) may start
before the kernel ahead of it in the stream has finished; it calls :func:`griddepcontrol_wait`
before it reads anything that kernel wrote. The kernel ahead may call
:func:`griddepcontrol_launch_dependents` once its blocks need no more of the GPU to
themselves (each block's call, or its exit, counts; the dependent grid starts launching when
every block has done one or the other).

In the simulator kernels run one after the other: both are no-ops."""

from __future__ import annotations

from .asm import instruction


def _wait_twin():
    """Nothing to wait for: the simulator finished the kernel ahead before this one began."""


def _launch_dependents_twin():
    """Nothing to start early in the simulator."""


griddepcontrol_wait = instruction(
    "griddepcontrol_wait", "griddepcontrol.wait;", side_effect=True, clobber_memory=True,
    min_cc=(9, 0), twin=_wait_twin,
    doc="``griddepcontrol_wait()``: wait until the grids this one depends on (a launch with "
        "programmatic stream serialisation: the kernel ahead in the stream) have completed "
        "and their memory operations are visible; returns at once without such a "
        "dependency. Every thread that reads their results calls it first.")

griddepcontrol_launch_dependents = instruction(
    "griddepcontrol_launch_dependents", "griddepcontrol.launch_dependents;", side_effect=True,
    min_cc=(9, 0), twin=_launch_dependents_twin,
    doc="``griddepcontrol_launch_dependents()``: this block lets the dependent grid (launched "
        "with programmatic stream serialisation) start launching once every block of this "
        "grid has called it or exited; it orders no memory (the dependent waits with "
        "griddepcontrol_wait for this grid's completion).")
