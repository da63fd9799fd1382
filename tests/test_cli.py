"""python -m tilepy {demo, info, inspect}: exit codes and what they say."""

import os
import subprocess
import sys

import pytest

import tilepy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "tilepy", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def test_bad_command_and_bad_arguments_exit_2():
    assert run("bogus").returncode == 2
    assert run("inspect", "gemm", "--dtype", "int8").returncode == 2
    res = run("inspect", "no_such_kernel")
    assert res.returncode == 2 and "inspect list" in res.stderr


def test_info_names_versions_and_target():
    res = run("info")
    assert res.returncode == 0
    for word in ("tilepy", "numba-cuda", "numpy", "NVVM", "tilepy cache"):
        assert word in res.stdout
    assert ("simulator" in res.stdout) == tilepy.SIMULATOR


@pytest.mark.skipif(not tilepy.SIMULATOR, reason="the GPU demo is run by bench/gpu_check.sh")
def test_demo_in_the_simulator_says_so_and_checks_every_op():
    res = run("demo")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SIMULATOR" in res.stdout
    for op in ("tilepy.gemm", "tilepy.softmax", "tilepy.flash_attention"):
        assert op in res.stdout
    assert "FAIL" not in res.stdout


@pytest.mark.compile
def test_inspect_reports_the_gemm_kernel_offline():
    res = run("inspect", "gemm")
    assert res.returncode == 0, res.stderr
    assert "mma=" in res.stdout and "ldmatrix=" in res.stdout and "cp.async=" in res.stdout
    assert "spill(st/ld)=0/0" in res.stdout and "cold compile" in res.stdout
