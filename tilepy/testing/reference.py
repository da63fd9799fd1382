"""Float64 references the tests compare kernels with."""

from __future__ import annotations

import math

import numpy as np

#: The epilogue activations of :data:`tilepy.tile.epilogue.ACTIVATIONS` in float64 (``gelu``
#: the erf form).
ACTIVATIONS = {
    None: lambda v: v,
    "relu": lambda v: np.maximum(v, 0),
    "gelu": lambda v: 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2))),
    "gelu_tanh": lambda v: 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi)
                                                  * (v + 0.044715 * v**3))),
    "silu": lambda v: v / (1 + np.exp(-v)),
}


def reference_activation(v, name):
    """``name``'s activation of the float64 array ``v`` (None: ``v``)."""
    return ACTIVATIONS[name](np.asarray(v, np.float64))


def softmax_rows(s):
    """``(p, lse)`` in float64 of masked scores ``s`` (-inf: hidden): the row softmax
    (a row with no visible entry all 0) and its natural-log LSE (-inf for such a row)."""
    s = np.asarray(s, np.float64)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    safe = np.where(total > 0, total, 1)
    lse = np.where(total[..., 0] > 0, (m + np.log(safe))[..., 0], -np.inf)
    return np.where(total > 0, p / safe, 0), lse
