"""The epilogue's activations as device functions (simulator: the PTX twins), against float64."""

import math

import numpy as np
import pytest
from numba import cuda

from tilepy.tile.epilogue import activation_fn


def _apply(name, xs):
    act = activation_fn(name)

    @cuda.jit
    def kern(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = act(x[i])

    x = np.asarray(xs, dtype=np.float32)
    out = np.full_like(x, np.float32(12345.0))
    kern[(x.size + 127) // 128, 128](x, out)
    return out


def test_gelu_matches_float64_erf_on_both_sides():
    """gelu(v) = v/2 · erfc(−v/√2) through the fast erfc: relative error of a few 1e-6 over
    [−9, 9] — also where Φ(v) is tiny (v ≪ 0), which 0.5·v·(1 + erf) loses to cancellation."""
    x = np.concatenate([np.linspace(-9, 9, 2001), -np.logspace(-7, 0.9, 200),
                        np.logspace(-7, 0.9, 200), [0.0]]).astype(np.float32)
    got = _apply("gelu", x).astype(np.float64)
    ref = np.array([0.5 * float(v) * math.erfc(-float(v) / math.sqrt(2)) for v in x])
    nz = ref != 0
    rel = np.abs(got[nz] - ref[nz]) / np.abs(ref[nz])
    assert rel.max() < 2e-5, (rel.max(), x[nz][rel.argmax()])
    assert got[~nz].tolist() == [0.0] * int((~nz).sum())


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
def test_gelu_special_values():
    got = _apply("gelu", [np.inf, np.nan, -1e30, 1e30])
    assert got[0] == np.inf and np.isnan(got[1])
    assert got[2] == 0.0 and got[3] == np.float32(1e30)


@pytest.mark.parametrize("name", ["relu", "gelu_tanh", "silu"])
def test_other_activations_against_float64(name):
    x = np.linspace(-8, 8, 513).astype(np.float32)
    xd = x.astype(np.float64)
    ref = {"relu": np.maximum(xd, 0),
           "gelu_tanh": 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3))),
           "silu": xd / (1 + np.exp(-xd))}[name]
    got = _apply(name, x)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
