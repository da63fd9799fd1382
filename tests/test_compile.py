"""Offline compile layer: every PTX intrinsic, alone in a probe kernel, for sm_80 and sm_90.

Runs ``python -m tilepy.offline tilepy.ptx.probes:compile_all`` once, in a subprocess without
the simulator, and checks per probe: the PTX holds exactly one of the intended instruction,
``ptxas -v`` accepts it with no stack frame, spills or local memory, and a compute capability
that lacks the instruction is refused with a clear error instead of a ptxas failure.
"""

import pytest

from tilepy.offline import find_ptxas, run_in_subprocess
from tilepy.ptx import asm, probes

pytestmark = pytest.mark.compile

probes.load_all()
NAMES = sorted(asm.REGISTRY) + sorted(probes.EXTRA)


@pytest.fixture(scope="session")
def reports():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    return run_in_subprocess("tilepy.ptx.probes:compile_all")


def _min_cc(name):
    if name in asm.REGISTRY:
        return asm.REGISTRY[name][1].min_cc
    return probes.EXTRA[name][3]


@pytest.mark.xdist_group("probe_reports")   # one worker compiles them (-n 2)
@pytest.mark.parametrize("cc", probes.CCS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("name", NAMES)
def test_probe_compiles_to_the_instruction(reports, name, cc):
    entry = reports[f"{name}@sm_{cc[0]}{cc[1]}"]
    assert "error" not in entry, entry.get("error")
    min_cc = _min_cc(name)
    if min_cc and tuple(cc) < tuple(min_cc):
        assert "needs compute capability" in entry.get("refused", ""), entry
        return
    assert "refused" not in entry, entry["refused"]
    assert entry["found"] == 1, f"{entry['opcode']} occurs {entry['found']} times in the PTX"
    assert entry["stack_frame"] == 0 and entry["local_bytes"] == 0
    assert entry["spill_stores"] == 0 and entry["spill_loads"] == 0
    assert 0 < entry["registers"] <= 64


@pytest.mark.xdist_group("probe_reports")
def test_every_probe_was_compiled(reports):
    assert {r["probe"] for r in reports.values()} == set(NAMES)


@pytest.fixture(scope="session")
def gemm_reports():
    return run_in_subprocess("tilepy.ops.gemm_mma_sync:compile_reports")


@pytest.mark.xdist_group("gemm_mma_sync_reports")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gemm_main_loop_128x128x32_3_stages_8_warps(gemm_reports, dtype):
    rep = gemm_reports[f"gemm_{dtype}"]
    assert "128x128x32 block, 2x4 warps" in rep["config"] and "3 stages" in rep["config"]
    c = rep["counts"]
    assert c["mma"] >= 16 and c["ldmatrix"] >= 6 and c["cp.async"] >= 4
    assert c["cp.async.wait"] >= 1 and c["ld.local"] == 0 and c["st.local"] == 0
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["stack_frame"] == 0
    assert rep["local_bytes"] == 0
    assert rep["registers"] <= 168, rep["registers"]
    print(f"gemm {dtype}: {rep['registers']} registers, cold compile {rep['compile_seconds']:.1f} s")


@pytest.fixture(scope="session")
def typing_errors():
    return run_in_subprocess("tilepy.ptx.probes:typing_errors")


@pytest.mark.parametrize("case,expect", [
    ("mma_with_float64_fragment", "mma_m16n8k16_f16_f32(u32, u32, u32, u32, u32, u32, f32"),
    ("mma_with_array_operand", "mma_m16n8k16_f16_f32(u32"),
    ("shared_addr_of_scalar", "shared_addr(array, index)"),
])
@pytest.mark.xdist_group("typing_errors")
def test_wrong_operand_types_name_the_intrinsic(typing_errors, case, expect):
    msg = typing_errors[case]["message"]
    assert msg is not None and "TypingError" in msg and expect in msg, msg


def test_float32_simt_gemm_compiles_without_local_memory():
    rep = run_in_subprocess("tilepy.ops.gemm_simt:compile_reports")["gemm_simt"]
    assert rep["counts"]["mma"] == 0 and rep["counts"]["bar.sync"] >= 2
    assert rep["stack_frame"] == 0 and rep["spill_stores"] == 0 and rep["local_bytes"] == 0


@pytest.fixture(scope="session")
def softmax_backward_reports():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: install the test extra (nvidia-cuda-nvcc)")
    return run_in_subprocess("tilepy.ops.softmax_backward:compile_reports")


def _softmax_backward_kernels():
    from tilepy.ops import softmax_backward

    return [name for name, *_ in softmax_backward.compile_plans()]


@pytest.mark.xdist_group("softmax_backward_reports")
@pytest.mark.parametrize("name", _softmax_backward_kernels())
def test_softmax_backward_kernel_compiles_without_spills(softmax_backward_reports, name):
    """Every warp / block bucket and the two-pass kernel of softmax_backward and
    log_softmax_backward (the GPU plans, 16-byte and scalar accesses): no spills, no local
    memory, within the register file at its launch bounds (64 registers for two 512-thread
    blocks per SM), dy and y loaded 16 bytes at a time where the views allow it."""
    rep = softmax_backward_reports[f"{name}:A"]
    assert "error" not in rep, rep.get("error")
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert rep["stack_frame"] == 0 and rep["local_bytes"] == 0
    assert rep["counts"]["ld.local"] == 0 and rep["counts"]["st.local"] == 0
    assert rep["maxntid"]
    assert rep["registers"] * rep["threads"] <= 65536, rep["registers"]
    if rep["launch_bounds"] == [512, 2]:
        assert rep["registers"] <= 64, rep["registers"]
    assert rep["counts"]["shfl"] >= 5                      # the warp's part of the row sum
    assert (rep["ex2"] > 0) == rep["log"]                  # exp(y): log_softmax's only
    if rep["vec"] > 1:
        assert rep["vector_loads"] >= 2, rep["vector_loads"]
    else:
        assert rep["vector_loads"] == 0
