"""The Hopper guide (docs/custom-kernels-hopper.md): the code it shows is
docs/examples/hopper_gemm.py verbatim; that module's GEMM is right in the simulator (edges in
M, N and K, the stage ring wrapping across the tiles of a persistent block, both TMA-store
passes), compiles for sm_90a without spills or local memory, and is right on the GPU at full
size against torch.matmul. Its speed beside tilepy.gemm: bench/test_bench_guide_hopper.py."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "custom-kernels-hopper.md"
EXAMPLE = ROOT / "docs" / "examples" / "hopper_gemm.py"
# a block of the guide that is a piece of the example file is marked with this comment
MARK = "<!-- docs/examples/hopper_gemm.py -->"
#: the guide's promise: a warp-specialised GEMM in about 150 lines of code
CODE_LINES = 160
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


def example():
    """docs/examples/hopper_gemm.py as a module (it is not part of the tilepy package)."""
    spec = importlib.util.spec_from_file_location("hopper_gemm_guide", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def code_lines(src: str) -> int:
    """Lines of code: not blank, not comments, not docstrings."""
    import ast

    docs = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(src.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def test_the_guide_shows_the_example_file_verbatim():
    """The marked python blocks of the guide, in order, are the example file, whole; every
    python block of the guide also runs in the simulator (tests/test_docs.py)."""
    text = GUIDE.read_text()
    pieces = re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", text, flags=re.S)
    assert pieces, f"no block of {GUIDE.name} is marked {MARK}"
    assert text.count(MARK) == len(pieces), "a marker not followed by a python block"

    def lines(text):   # blank lines are where the guide splits the file into blocks
        return [line for line in text.splitlines() if line.strip()]

    assert lines("".join(pieces)) == lines(EXAMPLE.read_text()), \
        f"{GUIDE.name}'s marked blocks differ from {EXAMPLE.name}: copy the file's code in"
    assert code_lines(EXAMPLE.read_text()) <= CODE_LINES


def padded(rng, shape, np_dtype, pad=6):
    """A (rows, cols) view whose rows are 16-byte aligned but not contiguous."""
    rows, cols = shape
    width = -(-(cols + pad) // 8) * 8
    return rng.standard_normal((rows, width)).astype(np_dtype)[:, :cols]


def check(got, a, b, dtype):
    got = np.asarray(got).astype(np.float64)
    assert not np.isnan(got).any(), "NaN: an element was not written"
    ref = a.astype(np.float64) @ b.astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= TOL[dtype], err


@pytest.mark.sim
def test_edges_and_the_ring_across_persistent_tiles(monkeypatch):
    """M, N, K = 130, 120, 136 in 128 × 64 tiles: partial tiles in M, N and K (TMA zero-fills
    the loads, clips the stores); two persistent blocks of two tiles each, 3 k steps through
    2 stages (the ring and its parities run on across a block's tiles); out poisoned with NaN.
    A second call with new operands and no ``out`` goes through the cached plan (the maps
    re-encoded for the new pointers) into a new array."""
    from tilepy import devices

    monkeypatch.setattr(devices, "SIM_SMS", 2)
    hg = example()
    rng = np.random.default_rng(1)
    m, n, k = 130, 120, 136
    a, b = padded(rng, (m, k), np.float16), padded(rng, (k, n), np.float16)
    out = np.full((m, n), np.nan, np.float16)
    assert hg.matmul(a, b, out, block_n=64, stages=2) is out
    check(out, a, b, "float16")
    a, b = padded(rng, (m, k), np.float16), padded(rng, (k, n), np.float16)
    new = hg.matmul(a, b, block_n=64, stages=2)
    assert new.shape == (m, n) and new.dtype == np.float16
    check(new, a, b, "float16")
    assert len(hg._bound) == 1


@pytest.mark.sim
def test_two_store_passes_bfloat16():
    """block_n = 256 as on the GPU: each consumer's 64 × 256 tile goes out in two TMA-store
    passes of 128 columns through one staging buffer; N = 264 leaves a second column tile of
    8 columns whose second pass stores nothing. bfloat16, out poisoned with NaN."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    hg = example()
    rng = np.random.default_rng(2)
    a = rng.standard_normal((70, 72)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((72, 264)).astype(ml_dtypes.bfloat16)
    out = np.full((70, 264), np.nan, ml_dtypes.bfloat16)
    assert hg.matmul(a, b, out, block_n=256, stages=2) is out
    check(out, a, b, "bfloat16")


def test_refuses_bad_operands_before_launch():
    hg = example()
    a = np.zeros((16, 24), np.float16)
    with pytest.raises(ValueError, match=r"expected \(M, K\) @ \(K, N\)"):
        hg.matmul(a, np.zeros((16, 8), np.float16))
    with pytest.raises(ValueError, match=r"-> \(M, N\)"):
        hg.matmul(a, np.zeros((24, 8), np.float16), np.zeros((16, 16), np.float16))
    with pytest.raises(TypeError, match="dtype float32 is not supported"):
        hg.matmul(a.astype(np.float32), np.zeros((24, 8), np.float32))
    with pytest.raises(ValueError, match="block_n"):
        hg.hopper_gemm("float16", 192)


_COMPILE = """
import importlib.util, json, sys
from numba import config, types
assert not config.ENABLE_CUDASIM
spec = importlib.util.spec_from_file_location("hopper_gemm_guide", sys.argv[1])
hg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hg)
from tilepy.offline import compile_kernel
u16 = types.Array(types.uint16, 2, "C")
out = {}
for dtype in ("float16", "bfloat16"):
    kern = hg.hopper_gemm(dtype)           # the GPU config: 128 x 256 tiles, 4 stages
    rep = compile_kernel(f"guide_{dtype}", kern.py_func, (u16, u16, u16, types.uint8[::1]),
                         (9, 0, "a"), launch_bounds=(kern.threads, 1))
    d = dict(rep.__dict__)
    d.pop("ptx")
    d["smem_bytes"] = kern.smem_bytes
    out[dtype] = d
print(json.dumps(out))
"""


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills():
    """The guide's kernel at its GPU config (128 × 256, 4 stages, two consumers, setmaxnreg
    40 / 232), offline for sm_90a, float16 and bfloat16: within the 168 registers of a
    384-thread block, no spills, no local memory, and the instructions the guide describes."""
    from tilepy.offline import find_ptxas

    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(EXAMPLE)], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    for dtype, rep in reports.items():
        print(f"\n{dtype}: {rep['registers']} registers, spills {rep['spill_stores']} / "
              f"{rep['spill_loads']} B, stack {rep['stack_frame']} B, "
              f"{rep['smem_bytes']} B dynamic shared memory")
        assert rep["arch"] == "sm_90a"
        assert 0 < rep["registers"] <= 168, rep["registers"]
        assert rep["spill_stores"] == rep["spill_loads"] == 0, rep["ptxas_log"]
        assert rep["stack_frame"] == 0 and rep["local_bytes"] == 0, rep["ptxas_log"]
        c = rep["counts"]
        assert c["ld.local"] == c["st.local"] == 0, c
        assert c["wgmma.mma_async"] > 0 and c["setmaxnreg"] == 2, c
        assert c["cp.async.bulk.tensor"] > 0 and c["stmatrix"] > 0 and c["mbarrier"] > 0, c
        assert c["mma"] == c["ldmatrix"] == c["cp.async"] == 0, c   # Hopper paths only
        assert rep["smem_bytes"] <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_full_size_against_torch(dtype):
    """4096³ and shapes with edges (rows of odd widths as views of padded storage, out too),
    PyTorch tensors in and out (a given out, and a new one), against torch.matmul in float32;
    Numba device arrays too."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("not a compute capability 9.0 GPU")
    hg = example()
    tdt = getattr(torch, dtype)

    def padded_t(rows, cols):
        return torch.randn(rows, -(-cols // 8) * 8, device="cuda", dtype=tdt)[:, :cols]

    for m, n, k in [(4096, 4096, 4096), (3000, 2056, 1000), (70, 100, 258)]:
        a, b = padded_t(m, k), padded_t(k, n)
        out = torch.full((m, -(-n // 8) * 8), float("nan"), device="cuda", dtype=tdt)[:, :n]
        assert hg.matmul(a, b, out) is out
        ref = a.float() @ b.float()
        assert not bool(torch.isnan(out).any()), (m, n, k)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOL[dtype], (m, n, k, err)
        if n % 8 == 0:   # a new (contiguous) result needs rows of 16-byte multiples
            new = hg.matmul(a, b)
            assert isinstance(new, torch.Tensor) and new.dtype == tdt and new.shape == (m, n)
            torch.testing.assert_close(new, out, rtol=0, atol=0)
    if dtype == "float16":
        from numba import cuda

        x = np.random.default_rng(0).standard_normal((296, 200)).astype(np.float16)
        got = hg.matmul(cuda.to_device(x), cuda.to_device(x.T.copy())).copy_to_host()
        ref = x.astype(np.float64) @ x.T.astype(np.float64)
        assert np.abs(got - ref).max() / np.abs(ref).max() <= TOL[dtype]
