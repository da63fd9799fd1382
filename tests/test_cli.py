"""python -m tilepy {demo, info, inspect, tune}: exit codes and what they say."""

import os
import subprocess
import sys

import pytest

import tilepy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=300, **env_vars):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env_vars)
    return subprocess.run([sys.executable, "-m", "tilepy", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT, check=False)


def test_bad_command_and_bad_arguments_exit_2():
    assert run("bogus").returncode == 2
    assert run("inspect", "gemm", "--dtype", "int8").returncode == 2
    res = run("inspect", "no_such_kernel")
    assert res.returncode == 2 and "inspect list" in res.stderr


def test_info_names_versions_and_target():
    res = run("info")
    assert res.returncode == 0
    for word in ("tilepy", "numba-cuda", "numpy", "NVVM", "tilepy cache", "kernel cache"):
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


@pytest.mark.compile
@pytest.mark.extended   # (the kernels' own compile tests check them; this, the CLI and the time)
def test_inspect_reports_the_hopper_defaults_offline():
    # the TMA GEMM with bias + GELU was the slowest kernel to compile (~100 s with Numba's
    # IR inlining); with LLVM-level inlining it takes seconds
    for name, ops in (("gemm_ws_bias_gelu", ("wgmma.mma_async=", "cp.async.bulk.tensor=")),
                      ("attention_wgmma", ("wgmma.mma_async=", "setmaxnreg=2"))):
        res = run("inspect", name, "--cc", "90a")
        assert res.returncode == 0, res.stderr
        assert all(op in res.stdout for op in ops), res.stdout
        if name == "attention_wgmma":
            # its producer warpgroup: a few values live across setmaxnreg are spilled once
            # per block (tests/test_ops_attention_wgmma.py checks the same, ≤ 64 B)
            st, ld = map(int, res.stdout.split("spill(st/ld)=")[1].split()[0].split("/"))
            assert st <= 64 and ld <= 96, res.stdout
        else:
            assert "spill(st/ld)=0/0" in res.stdout and "stack=0B" in res.stdout
        seconds = float(res.stdout.split("cold compile (NVVM + ptxas)")[1].split()[0])
        assert seconds < 60, res.stdout


@pytest.mark.parametrize("argv,message", [
    (["tune"], "the following arguments are required: op"),
    (["tune", "relu", "--shape", "1", "2", "3"], "invalid choice: 'relu'"),
    (["tune", "softmax", "--shape", "1", "2", "3"], "softmax takes ROWS N, got 3 values"),
    (["tune", "gemm", "--shape", "64", "64", "64", "--dtype", "float32"],
     "gemm tunes float16 or bfloat16"),
    (["tune", "gemm"], "the following arguments are required: --shape"),
    (["tune", "gemm", "--shape", "64", "64"], "--shape: gemm takes M N K, got 2 values"),
    (["tune", "attention", "--shape", "1", "8", "64"], "attention takes B H S D or B H SQ SK D"),
    (["tune", "attention", "--shape", "1", "8", "64", "0"], "expected a positive integer"),
    (["tune", "gemm", "--shape", "64", "0", "64"], "expected a positive integer, got 0"),
    (["tune", "gemm", "--shape", "64", "x", "64"], "expected a positive integer, got 'x'"),
    (["tune", "gemm", "--shape", "64", "64", "64", "--batch", "-1"], "positive integer"),
    (["tune", "gemm", "--shape", "64", "64", "64", "--dtype", "float64"], "invalid choice"),
])
def test_tune_arguments_are_checked(argv, message, capsys):
    from tilepy.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_tune_arguments_parse():
    from tilepy.__main__ import _parser

    args = _parser().parse_args(["tune", "gemm", "--shape", "4096", "1024", "512", "--batch",
                                 "4", "--dtype", "bfloat16", "--json", "x.json"])
    assert (args.op, args.shape, args.batch, args.dtype, args.repeat, args.json) == \
        ("gemm", [4096, 1024, 512], 4, "bfloat16", 20, "x.json")


def test_tune_without_a_gpu_is_one_clear_line():
    # NUMBA_ENABLE_CUDASIM=1 stands for "no GPU" on any machine
    res = run("tune", "gemm", "--shape", "64", "64", "64", NUMBA_ENABLE_CUDASIM="1")
    assert res.returncode == 1
    assert res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    assert "needs a CUDA GPU" in line and "simulator" in line
