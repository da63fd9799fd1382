"""Several devices (``bench/multi_gpu.py``): the tensor-parallel transformer block over two
ranks against the same block on one device — on CPU over gloo with tilepy in the simulator
(the sharding arithmetic: the forward output and every gradient, input and weight shards),
and on two GPUs over NCCL; every op with its inputs on the second GPU while the first is
current, and the other way round. The per-device logic itself is checked against fake devices
in test_devices.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tilepy._env import gpu_count

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "multi_gpu.py"
two_gpus = pytest.mark.skipif(gpu_count() < 2, reason="needs two CUDA GPUs")


def run(args, tmp_path, timeout):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, *args, "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def torchrun(*args):
    return ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(29400 + os.getpid() % 1000), str(SCRIPT), *args]


@pytest.mark.sim
def test_tensor_parallel_block_matches_one_device_on_cpu(tmp_path):
    """Two gloo ranks, each with half the heads and half the MLP: output and gradients
    within float16 rounding of the whole block on one device (the script fails otherwise;
    checked here too)."""
    pytest.importorskip("torch")
    res = run(torchrun("tp", "--cpu", "--batch", "1", "--seq", "24", "--hidden", "32",
                       "--heads", "2", "--head-dim", "16"), tmp_path, 600)
    ranks = res["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert not r["failures"]
        assert set(r["errors"]) == {"out", "dx", "dwqkv", "dwo", "dw1", "db1", "dw2", "db2"}
        assert max(r["errors"].values()) < 2e-2


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("src", [1, 0])
def test_every_op_runs_on_the_inputs_gpu(tmp_path, src):
    res = run([str(SCRIPT), "devices", "--src", str(src)], tmp_path, 600)
    assert not res["failures"] and all(r["ok"] for r in res["rows"])


@pytest.mark.gpu
@two_gpus
def test_tensor_parallel_block_on_two_gpus(tmp_path):
    res = run(torchrun("tp", "--seq", "512", "--reps", "5"), tmp_path, 600)
    for r in res["ranks"]:
        assert not r["failures"], r["failures"]
