"""Softmax: ``tilepy.softmax`` against ``torch.softmax`` and a device-to-device copy, same run.

Bandwidth-bound: throughput is GB/s of one read and one write of the tensor (the copy moves
the same bytes, so ``fraction_of_copy`` is how close the op gets to the memory ceiling). Timed
with CUDA events around ``INNER`` back-to-back calls on PyTorch's current stream (the median
of ``REPEAT`` such runs, divided by ``INNER``), so the host cost of tilepy's wrapper is hidden
behind the GPU work as it is in a real pipeline, and the same for the peers. tilepy writes into
a preallocated ``out``; ``torch.softmax`` allocates its result (from PyTorch's cache).

Shapes of issue 6: 16384×4096, 32768×1024, 4096×32768 in float32 and float16; plus the row
sweep of Triton's tutorial (4096 rows, 256 … 32768 columns).
"""

import pytest

from tilepy.testing.timing import time_cuda

SHAPES = [(16384, 4096), (32768, 1024), (4096, 32768)]
DTYPES = ["float32", "float16"]
SWEEP = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
INNER = 10
REPEAT = 15


def cuda_ms(torch, fn, repeat=REPEAT, inner=INNER, warmup=3):
    """Median milliseconds per call of ``fn`` (CUDA events around ``inner`` calls)."""
    return time_cuda(fn, warmup=warmup, repeat=repeat, inner=inner)


def measure(torch, record, gpu_name, rows, cols, dtype):
    """Check tilepy against PyTorch once, time tilepy / torch / copy, record the figures;
    return the tilepy call for benchmark.pedantic."""
    from tilepy.ops.softmax import plan, softmax

    tdt = getattr(torch, dtype)
    x = torch.randn(rows, cols, device="cuda", dtype=tdt)
    out = torch.empty_like(x)
    softmax(x, out=out)  # compile
    torch.cuda.synchronize()
    want = torch.softmax(x.float(), -1)
    err = ((out.float() - want).abs().max()).item()
    assert err < (1e-5 if dtype == "float32" else 2e-3), err

    ms = cuda_ms(torch, lambda: softmax(x, out=out))
    peer_ms = cuda_ms(torch, lambda: torch.softmax(x, -1))
    copy = torch.empty_like(x)
    copy_ms = cuda_ms(torch, lambda: copy.copy_(x))
    nbytes = 2 * x.numel() * x.element_size()
    p = plan(cols)
    record(gpu=gpu_name, shape=f"{rows}x{cols}", dtype=dtype, gbps=nbytes / ms / 1e6,
           peer="torch.softmax", peer_gbps=nbytes / peer_ms / 1e6, ratio=peer_ms / ms,
           copy_gbps=nbytes / copy_ms / 1e6, fraction_of_copy=copy_ms / ms,
           peer_fraction_of_copy=copy_ms / peer_ms, path=p.path, threads=p.threads,
           per_thread=p.per_thread, max_abs_err=err, timing=f"CUDA events, {INNER} calls "
           f"per event pair, median of {REPEAT}")
    return lambda: (softmax(x, out=out), torch.cuda.synchronize())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_softmax_tilepy_vs_torch(benchmark, record, torch, gpu_name, shape, dtype):
    run = measure(torch, record, gpu_name, *shape, dtype)
    benchmark.pedantic(run, rounds=5, iterations=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", SWEEP)
def test_softmax_row_sweep(benchmark, record, torch, gpu_name, cols, dtype):
    run = measure(torch, record, gpu_name, 4096, cols, dtype)
    benchmark.pedantic(run, rounds=5, iterations=1)
