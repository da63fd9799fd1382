"""Every op on the device that holds its inputs (``tilepy.devices``), checked against a list of
fake devices in the simulator: inputs placed on device 1 while device 0 is current, each op
called twice (the second call through its cached launch plan), then once with the same shapes
on device 0. The fake devices log every device query, context switch, allocation and launch
with the device it ran under: none may happen on the other device, none outside the inputs'
device, and a plan built on one device must never serve the other. Inputs on two devices are
a ``ValueError`` before anything is allocated or launched. The simulator has no second device:
what this cannot see (the CUDA driver's contexts themselves) is for a two-GPU machine
(``bench/multi_gpu.py``)."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import tilepy
from tilepy import devices, launch
from tilepy.devices import DeviceInfo

from test_ops_attention import check, rand, reference

pytestmark = pytest.mark.sim

FAKES = [DeviceInfo(0, "Fake GPU A", (0, 0), 4), DeviceInfo(1, "Fake GPU B", (0, 0), 3)]


def placed(fk, device, *arrays):
    return [fk.place(x, device) for x in arrays]


def matmul(a, b):
    return a.astype(np.float64) @ b.astype(np.float64)


def case_gemm(rng, fk, dev):
    a, b = placed(fk, dev, rand(rng, (20, 24), "float16"), rand(rng, (24, 40), "float16"))
    got = tilepy.gemm(a, b)
    np.testing.assert_allclose(got.astype(np.float64), matmul(a, b), atol=0.05, rtol=0.01)


def case_grouped_gemm(rng, fk, dev):
    a, b = placed(fk, dev, rand(rng, (9, 16), "float16"), rand(rng, (3, 16, 24), "float16"))
    ends = fk.place(np.array([4, 4, 9], np.int32), dev)
    got = tilepy.grouped_gemm(a, b, ends).astype(np.float64)
    want = np.concatenate([matmul(a[:4], b[0]), matmul(a[4:9], b[2])])
    np.testing.assert_allclose(got, want, atol=0.05, rtol=0.01)


def softmax64(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def case_softmax(rng, fk, dev):
    (x,) = placed(fk, dev, rng.standard_normal((5, 70)).astype(np.float32))
    np.testing.assert_allclose(tilepy.softmax(x), softmax64(x.astype(np.float64)), atol=1e-5)


def case_softmax_backward(rng, fk, dev):
    y = softmax64(rng.standard_normal((5, 70))).astype(np.float32)
    dy, y = placed(fk, dev, rng.standard_normal((5, 70)).astype(np.float32), y)
    y64, dy64 = y.astype(np.float64), dy.astype(np.float64)
    want = y64 * (dy64 - (dy64 * y64).sum(-1, keepdims=True))
    np.testing.assert_allclose(tilepy.softmax_backward(dy, y), want, atol=1e-5)


def case_gemm_softmax(rng, fk, dev):
    a, b = placed(fk, dev, rand(rng, (20, 16), "float16"), rand(rng, (16, 40), "float16"))
    got = tilepy.gemm_softmax(a, b).astype(np.float64)
    np.testing.assert_allclose(got, softmax64(matmul(a, b)), atol=5e-3)


def case_attention(rng, fk, dev):
    q, k, v = placed(fk, dev, *(rand(rng, (1, 2, 20, 16), "float16") for _ in range(3)))
    got = tilepy.flash_attention(q, k, v, causal=True)
    check(got, reference(q, k, v, True)[0], v, "float16")


def _document(b, h, q_idx, kv_idx):
    return (q_idx // 8) == (kv_idx // 8)


def case_attention_mask_mod(rng, fk, dev):
    """A mask_mod of no array argument: the op makes its block mask (a kernel of its own)."""
    q, k, v = placed(fk, dev, *(rand(rng, (1, 1, 24, 16), "float16") for _ in range(3)))
    got = tilepy.flash_attention(q, k, v, mask_mod=_document)
    check(got, reference(q, k, v, mask_mod=_document)[0], v, "float16")


def case_attention_backward(rng, fk, dev):
    q, k, v = placed(fk, dev, *(rand(rng, (1, 1, 20, 16), "float16") for _ in range(3)))
    out, lse = tilepy.flash_attention(q, k, v, causal=True, return_lse=True)
    (dout,) = placed(fk, dev, rand(rng, out.shape, "float16"))
    # (out and lse, made by the forward, are on the inputs' device already)
    assert fk.array_device(out) == dev and fk.array_device(lse) == dev
    dq, dk, dv = tilepy.flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    for g in (dq, dk, dv):
        assert g.shape == q.shape and np.isfinite(g.astype(np.float64)).all()


def case_varlen(rng, fk, dev):
    q, k, v = placed(fk, dev, *(rand(rng, (13, 2, 16), "float16") for _ in range(3)))
    cu = fk.place(np.array([0, 5, 5, 13], np.int32), dev)
    got = tilepy.flash_attention_varlen(q, k, v, cu, cu, 8, 8, causal=True)
    for s, e in ((0, 5), (5, 13)):
        t = lambda x: x[s:e].transpose(1, 0, 2)[None]   # noqa: E731
        want = reference(t(q), t(k), t(v), True)[0][0].transpose(1, 0, 2)
        check(got[s:e], want, v, "float16")


def case_kvcache(rng, fk, dev):
    q = rand(rng, (2, 1, 4, 32), "float16")
    kc, vc = rand(rng, (2, 40, 2, 32), "float16"), rand(rng, (2, 40, 2, 32), "float16")
    lens = np.array([17, 40], np.int32)
    q, kc, vc, lens = placed(fk, dev, q, kc, vc, lens)
    got = tilepy.flash_attention_with_kvcache(q, kc, vc, lens)
    for z in range(2):
        n = int(lens[z])
        t = lambda x: x.transpose(1, 0, 2)[None]   # noqa: E731
        want = reference(t(q[z]), t(kc[z, :n]), t(vc[z, :n]), True)[0][0].transpose(1, 0, 2)
        check(got[z], want, vc, "float16")


def case_quantize(rng, fk, dev):
    (x,) = placed(fk, dev, rand(rng, (6, 40), "float16"))
    codes, scales = tilepy.quantize_fp8(x, granularity="row")
    assert codes.shape == x.shape and scales.shape[0] == 6
    assert np.isfinite(np.asarray(scales, np.float64)).all()


def case_gemm_fp8(rng, fk, dev):
    import ml_dtypes

    f8 = ml_dtypes.float8_e4m3fn
    a = (rng.standard_normal((20, 64)) * 3).astype(f8)
    w = (rng.standard_normal((40, 64)) * 3).astype(f8)     # b = wᵀ: K-major
    a, w = placed(fk, dev, a, w)
    b = fk.place(w.T, dev)
    got = tilepy.gemm(a, b, out_dtype="float32")
    want = a.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


def case_attention_fp8(rng, fk, dev):
    from test_ops_attention_fp8 import codes
    from test_ops_attention_fp8 import reference as fp8_reference

    q, k, v = placed(fk, dev, codes(rng, (1, 2, 16, 16)), codes(rng, (1, 2, 20, 16)),
                     codes(rng, (1, 2, 20, 16)))
    got = tilepy.flash_attention(q, k, v, causal=True).astype(np.float64)
    want, _, bound = fp8_reference(q, k, v, 1.0, 1.0, 1.0, causal=True)
    assert (np.abs(got - want) <= bound).all()


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def check_log(fk, dev, what):
    """Every logged event ran under ``dev``: queries, switches, allocations, launches."""
    assert fk.events("launch"), f"{what}: nothing was launched"
    for kind in ("launch", "alloc", "current", "activate"):
        bad = [d for d in fk.events(kind) if d != dev]
        assert not bad, f"{what}: {kind} under device(s) {sorted(set(map(str, bad)))}, " \
                        f"not {dev}"
    asked = [d for d in fk.asked if d != dev]
    assert not asked, f"{what}: properties of device(s) {sorted(set(asked))} read"


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_runs_on_its_inputs_device(name):
    """Inputs on device 1, device 0 current: every query, allocation and launch of the first
    call and of the second (the cached plan) under device 1; then the same shapes on device
    0 run under device 0 (the device-1 plan is not reused)."""
    rng = np.random.default_rng()
    with devices.fake(FAKES, current=0) as fk:
        for dev in (1, 1, 0):
            del fk.log[:], fk.asked[:]
            CASES[name](rng, fk, dev)
            check_log(fk, dev, f"{name} on device {dev}")


@pytest.mark.parametrize("name", ["gemm", "attention", "softmax_backward"])
def test_inputs_on_two_devices_are_refused_before_anything_runs(name):
    rng = np.random.default_rng()
    with devices.fake(FAKES, current=0) as fk:
        if name == "gemm":
            a, b = rand(rng, (8, 8), "float16"), rand(rng, (8, 8), "float16")
            fk.place(a, 1), fk.place(b, 0)
            call = lambda: tilepy.gemm(a, b)   # noqa: E731
        elif name == "attention":
            q, k, v = (rand(rng, (1, 1, 8, 16), "float16") for _ in range(3))
            fk.place(q, 1), fk.place(k, 1), fk.place(v, 0)
            call = lambda: tilepy.flash_attention(q, k, v)   # noqa: E731
        else:
            dy, y = (rng.standard_normal((2, 8)).astype(np.float32) for _ in range(2))
            fk.place(dy, 0), fk.place(y, 1)
            call = lambda: tilepy.softmax_backward(dy, y)   # noqa: E731
        with pytest.raises(ValueError, match="different devices"):
            call()
        assert not fk.events("launch") and not fk.events("alloc")


def test_use_nests_and_restores():
    with devices.fake(FAKES, current=0) as fk:
        assert devices.entered() is None and devices.current_id() == 0
        with devices.use(1):
            assert devices.entered() == 1 and devices.current().name == "Fake GPU B"
            assert launch.sm_count(99) == 3
            with devices.use(0):
                assert devices.current_id() == 0 and launch.sm_count(99) == 4
            with devices.use(1):   # already entered: no switch
                pass
            assert devices.entered() == 1
        assert devices.entered() is None
        assert fk.events("activate") == [1, 0]
        with devices.use(None):   # inputs that name no device: nothing changes
            assert devices.entered() is None
        with pytest.raises(ValueError, match="no device 2"):
            with devices.use(2):
                pass
        assert devices.several()
    assert not devices.several() and devices.info().name == "simulator"


@cuda.jit
def add_one(x):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < x.shape[0]:
        x[i] += 1


def test_plan_launched_from_elsewhere_enters_its_device():
    """A launch plan built on device 1 and launched outside any ``use`` (a cached call)
    launches under device 1."""
    with devices.fake(FAKES, current=0) as fk:
        x = cuda.to_device(np.zeros(8, np.float32))
        with devices.use(1):
            plan = launch.LaunchPlan(add_one, (x,), 1, 32)
        assert plan.device == 1
        plan.launch(0, (x,))
        assert fk.events("launch") == [1]
        assert list(x.copy_to_host()) == [1] * 8


def test_a_launch_without_a_context_is_made_again_on_the_plans_device(monkeypatch):
    """The driver refusing a launch for want of a current context (a thread that has made no
    CUDA call yet replaying a cached plan): the plan enters its device and launches once
    more; refused again inside it, the error stands. (The driver's launch function stands in
    for cuLaunchKernel: the simulator has none.)"""
    ok, no_context = "CUDA_SUCCESS", "CUDA_ERROR_INVALID_CONTEXT"
    with devices.fake(FAKES[:1], current=0) as fk:
        x = cuda.to_device(np.zeros(8, np.float32))
        with devices.use(0):
            plan = launch.LaunchPlan(add_one, (x,), 1, 32)
        seen = []

        def launch_fn(func, *rest):
            seen.append(devices.entered())
            return (no_context if devices.entered() is None else ok,)

        plan._launch_fn, plan._func, plan._dims, plan._extra_addr = launch_fn, None, \
            (1, 1, 1, 32, 1, 1, 0), 0
        plan._success, plan._no_context, plan._ex_cfg = ok, no_context, None
        plan._ptr_slots, plan._scalar_slots = [], []
        monkeypatch.setattr(launch, "SIMULATOR", False)
        plan._go(0, [], [])
        assert seen == [None, 0] and fk.events("activate") == [0, 0]
        plan._launch_fn = lambda func, *rest: (no_context,)
        with pytest.raises(launch.NoContextError, match="INVALID_CONTEXT"):
            plan._go(0, [], [])


def test_tuning_keys_name_the_inputs_device():
    from tilepy.cache import current_gpu_name

    with devices.fake(FAKES, current=0):
        assert current_gpu_name(1) == "Fake GPU B" and current_gpu_name() == "Fake GPU A"
        with devices.use(1):
            assert current_gpu_name() == "Fake GPU B"
