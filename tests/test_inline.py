"""tilepy.inline: device functions inlined by NVVM (forceinline), and the stand-in device that
lets kernels calling them compile where there is no CUDA driver."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tilepy
from tilepy import _env
from tilepy.inline import inline_device

from numba import cuda  # noqa: E402  (after tilepy: the simulator decision comes first)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import json, sys
    from numba import cuda, types
    from tilepy.inline import inline_device
    from tilepy.ptx.math import ex2_approx

    @inline_device
    def scaled(v, k):
        return ex2_approx(v) * k

    def kernel(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = scaled(x[i], types.float32(3.0))

    ptx, _ = cuda.compile_ptx(kernel, (types.float32[::1], types.float32[::1]), cc=(9, 0))
    lines = [l.strip() for l in ptx.splitlines()]
    outside = None
    try:
        cuda.get_current_device()
    except Exception as e:          # no driver here: the stand-in is for compiles only
        outside = type(e).__name__
    print(json.dumps({"ex2": sum(l.startswith("ex2.approx") for l in lines),
                      "calls": sum(l.startswith("call") for l in lines),
                      "target": ".target sm_90" in ptx, "outside": outside}))
""")


@pytest.mark.compile
@pytest.mark.skipif(_env.gpu_count() > 0, reason="checks the no-driver fallback")
def test_a_kernel_calling_inline_devices_compiles_without_a_driver():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"ex2": 1, "calls": 0, "target": True, "outside": "CudaSupportError"}, got


@pytest.mark.sim
@pytest.mark.skipif(not tilepy.SIMULATOR, reason="simulator")
def test_inline_devices_run_in_the_simulator():
    @inline_device
    def twice(v):
        return v * np.float32(2)

    @inline_device(ir=True)
    def scratch():
        return cuda.local.array(2, np.float32)

    @cuda.jit
    def kernel(x, out):
        i = cuda.grid(1)
        if i < x.size:
            s = scratch()
            s[0] = twice(x[i])
            out[i] = s[0]

    x = np.arange(5, dtype=np.float32)
    out = np.full_like(x, np.nan)
    kernel[1, 8](x, out)
    assert np.array_equal(out, 2 * x)
