"""The tile generators composed into the mma.sync GEMM main loop (tilepy.ops.gemm_mma_sync).

Simulator: small tiles, shapes that are not multiples of the tile, both B layouts, every output
kind, bias and activations — against float64 NumPy, outputs poisoned beforehand.
GPU: the default 128×128×32 config at full size against float64 / cuBLAS.
"""

import math

import numpy as np
import pytest

from tilepy.ops.gemm_mma_sync import gemm_kernel, launch
from tilepy.testing.reference import ACTIVATIONS
from tilepy.tile.config import BlockTile, GemmConfig, Pipeline, WarpLayout

SMALL = GemmConfig(BlockTile(32, 32, 16), WarpLayout(2, 1), Pipeline(2))
SMALL3 = GemmConfig(BlockTile(16, 32, 32), WarpLayout(1, 2), Pipeline(3))


def to_bits(x, dtype):
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    # round-to-nearest-even float32 -> bfloat16 bits, vectorised (inputs here are finite)
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(bits, dtype):
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


ACT = ACTIVATIONS


def run_case(cfg, m, n, k, *, dtype="float16", out_kind="float32", b_k_major=True,
             activation=None, bias=False, alpha=1.0, beta=0.0, seed=None, device=None,
             **switches):
    rng = np.random.default_rng(seed)
    a = to_bits(rng.standard_normal((m, k)), dtype)
    b_log = to_bits(rng.standard_normal((k, n)), dtype)
    b = b_log if b_k_major else np.ascontiguousarray(b_log.T)
    bias_v = rng.standard_normal(n).astype(np.float32) if bias else np.zeros(1, np.float32)
    if out_kind == "float32":
        out = np.full((m, n), np.nan, np.float32)
    else:
        out = np.full((m, n), 0x7FFF, np.uint16)  # NaN bits in both 16-bit formats
    c = (rng.standard_normal((m, n)).astype(np.float32) if out_kind == "float32"
         else to_bits(rng.standard_normal((m, n)), out_kind)) if beta else np.zeros_like(out[:1, :1])
    kern = gemm_kernel(cfg, b_k_major, out_kind, activation, bias, bool(beta), **switches)
    ops = [x[None] for x in (a, b, out, c)] + [bias_v]
    if device is None:
        launch(kern, cfg, *ops, alpha, beta)
        got = out
    else:
        d = [device.to_device(x) for x in ops]
        launch(kern, cfg, *d, alpha, beta)
        got = d[2].copy_to_host()[0]
    got = got.astype(np.float64) if out_kind == "float32" else from_bits(got, out_kind)
    ref = alpha * (from_bits(a, dtype) @ from_bits(b_log, dtype))
    if bias:
        ref = ref + bias_v
    if beta:
        ref = ref + beta * (c.astype(np.float64) if out_kind == "float32" else from_bits(c, out_kind))
    ref = ACT[activation](ref)
    return got, ref


def assert_close(got, ref, out_kind, k):
    assert not np.isnan(got).any(), "unwritten or NaN elements"
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[out_kind]
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
    assert err <= tol, err


CASES = [
    # cfg, m, n, k, dtype, out_kind, b_k_major, activation, bias, beta
    (SMALL, 40, 56, 40, "float16", "float32", True, None, False, 0.0),
    (SMALL, 32, 32, 16, "bfloat16", "bfloat16", True, None, False, 1.0),
    (SMALL, 17, 24, 24, "float16", "float16", False, "gelu", True, 0.0),
    (SMALL3, 8, 40, 72, "bfloat16", "float32", False, "silu", True, -0.5),
    (SMALL3, 20, 16, 8, "float16", "float16", True, "relu", True, 2.0),
    (SMALL, 1, 8, 8, "float16", "float32", True, "gelu_tanh", False, 0.0),
]


@pytest.mark.sim
@pytest.mark.parametrize("cfg,m,n,k,dtype,out_kind,b_k_major,act,bias,beta", CASES)
def test_gemm_main_loop_in_simulator(cfg, m, n, k, dtype, out_kind, b_k_major, act, bias, beta):
    cfg = GemmConfig(cfg.block, cfg.warps, cfg.pipeline, dtype)
    got, ref = run_case(cfg, m, n, k, dtype=dtype, out_kind=out_kind, b_k_major=b_k_major,
                        activation=act, bias=bias, alpha=0.5, beta=beta)
    assert_close(got, ref, out_kind, k)


@pytest.mark.sim
@pytest.mark.parametrize("switches", [dict(late_issue=True), dict(double_buffer=False),
                                      dict(late_issue=True, double_buffer=False, group_m=1)])
def test_experiment_switches_keep_results(switches):
    cfg = GemmConfig(SMALL3.block, SMALL3.warps, SMALL3.pipeline, "float16")
    got, ref = run_case(cfg, 24, 40, 80, out_kind="float32", **switches)
    assert_close(got, ref, "float32", 80)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("b_k_major", [True, False])
@pytest.mark.parametrize("m,n,k", [(1000, 1064, 520), (4096, 4096, 4096)])
def test_gemm_main_loop_on_gpu(dtype, b_k_major, m, n, k):
    from numba import cuda

    cfg = GemmConfig(dtype=dtype)
    got, ref = run_case(cfg, m, n, k, dtype=dtype, out_kind="float32", b_k_major=b_k_major,
                        activation="gelu", bias=True, device=cuda)
    assert_close(got, ref, "float32", k)
