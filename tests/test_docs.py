"""Every ```python block in README.md and docs/*.md runs (in the simulator in CI), so the docs
cannot drift from the code. Blocks of one file run in order in one namespace."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.sim
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_examples_run(path):
    code = blocks(path)
    namespace = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(code):
        exec(compile(block, f"{path.name}[block {i}]", "exec"), namespace)


def test_there_are_examples():
    assert sum(len(blocks(p)) for p in FILES) >= 3


def test_performance_page_is_generated_from_the_results():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


GUIDE_SMALL = "cfg = GemmConfig(BlockTile(32, 32, 16), WarpLayout(2, 1), Pipeline(2))"
GUIDE_BIG = "cfg = GemmConfig(BlockTile(128, 128, 32), WarpLayout(2, 2), Pipeline(4))"

_GUIDE_COMPILE = """
import json, pathlib, re, sys
from numba import config, cuda, types
assert not config.ENABLE_CUDASIM
code = re.findall(r"```python\\n(.*?)```", pathlib.Path(sys.argv[1]).read_text(), flags=re.S)
ns = {"__name__": "doc_custom_offline"}
exec(compile(code[0].replace(sys.argv[2], sys.argv[3]), "custom-kernels.md[block 0]", "exec"), ns)
u16 = types.Array(types.uint16, 3, "C")
sig = (u16, u16, types.Array(types.float32, 3, "C"), types.float32[::1])
ptx, _ = cuda.compile_ptx(ns["batched_gemm_bias_gelu"].py_func, sig, cc=(9, 0))
print(json.dumps({k: ptx.count(k) for k in ("mma.sync", "ldmatrix", "cp.async")}))
"""


def test_custom_kernel_guide_compiles_for_the_gpu():
    """The simulator runs any Python, so it cannot tell whether the guide's kernel is one that
    Numba can compile for a GPU (a config object used inside the kernel, say, is not): compile
    it for sm_90 with the GPU-sized tile, offline, and check it uses the tensor-core path."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _GUIDE_COMPILE,
                           str(ROOT / "docs" / "custom-kernels.md"), GUIDE_SMALL, GUIDE_BIG],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["mma.sync"] > 0 and counts["ldmatrix"] > 0 and counts["cp.async"] > 0, counts


@pytest.mark.gpu
def test_custom_kernel_guide_on_the_gpu_against_cublas(capsys):
    """The guide's kernel, as written but with a GPU-sized tile (the one the guide names),
    on device arrays: checked against PyTorch (cuBLAS) and timed beside it (printed; the
    benchmark suites are where speed is recorded)."""
    torch = pytest.importorskip("torch")
    import numpy as np
    from numba import cuda

    from tilepy.testing.timing import time_cuda

    path = ROOT / "docs" / "custom-kernels.md"
    small, big = GUIDE_SMALL, GUIDE_BIG
    code = blocks(path)
    assert small in code[0], "the guide's config line changed: update this test"
    ns = {"__name__": "doc_custom_gpu"}
    for i, block in enumerate(code[:3]):       # imports + config, the kernel, run()
        exec(compile(block.replace(small, big), f"custom-kernels.md[block {i}]", "exec"), ns)
    z, m, n, k = 4, 2048, 2048, 2048
    a = torch.randn(z, m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(z, k, n, device="cuda", dtype=torch.float16)
    bias = torch.randn(n, device="cuda")
    out = torch.empty(z, m, n, device="cuda")
    args = [cuda.as_cuda_array(t.view(torch.int16)).view(np.uint16) for t in (a, b)]
    args += [cuda.as_cuda_array(out), cuda.as_cuda_array(bias)]
    kern, cfg, stage = ns["batched_gemm_bias_gelu"], ns["cfg"], ns["STAGE"]
    ns["allow_dynamic_shared"](kern, tuple(args), 2 * stage)
    grid = (-(-n // cfg.block.n), -(-m // cfg.block.m), z)
    launch = kern[grid, cfg.threads, 0, 2 * stage]
    launch(*args)
    torch.cuda.synchronize()
    ref = torch.nn.functional.gelu(a.float() @ b.float() + bias)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-3, err
    ms = time_cuda(lambda: launch(*args), warmup=2, repeat=10)
    peer = time_cuda(lambda: torch.nn.functional.gelu(torch.matmul(a, b) + bias),
                     warmup=2, repeat=10)
    flop = 2 * z * m * n * k
    with capsys.disabled():
        print(f"\ncustom-kernels guide kernel, {z}x{m}x{n}x{k} fp16 -> f32 + bias + GELU: "
              f"{flop / ms / 1e9:.0f} TFLOPS; torch matmul + bias + gelu "
              f"{flop / peer / 1e9:.0f} TFLOPS ({peer / ms:.2f}x); max rel err {err:.1e}")
