"""tilepy's ops as PyTorch operators: ``torch.ops.tilepy.*``.

Each public op is a ``torch.library`` operator in the ``tilepy`` namespace with

* a CUDA (and, in the CUDA simulator, CPU) implementation that runs the tilepy op on the
  tensors' memory, on the caller's current stream;
* a fake (meta) implementation that runs the op's own argument checks on metadata alone and
  returns an empty result of the right shape, dtype, strides and device — so
  ``torch.compile(fullgraph=True)`` traces a model that calls tilepy with no graph break, and
  a bad argument raises the same error under compilation as in eager mode;
* an autograd formula: ``gemm`` in ``a``, ``b``, ``bias`` and ``c`` (through its fused
  activation; the backward products run on ``tilepy.gemm`` itself, transposes as views),
  ``grouped_gemm`` in ``a`` and ``b``,
  ``softmax`` / ``log_softmax`` through tilepy's backward kernels, ``gemm_softmax`` by both.
  ``flash_attention`` through ``flash_attention_backward`` (also an operator of its own, with
  the LSE's gradient when the forward's LSE is used downstream).

``tilepy.gemm(a, b)`` on tensors calls the operator only when PyTorch needs to see it:
under compilation, when a gradient is wanted, under a dispatch / function mode or functorch
transform, or for tensor subclasses. A plain eager call (the common inference case) goes to
the op directly, which costs a few microseconds less than the dispatcher.

The ``out=`` forms are operators of their own (``gemm_out``, ``softmax_out``, …) that mutate
``out``; like PyTorch's ``out=`` functions they do not differentiate (a ``TypeError`` when a
gradient would be needed). ``config=`` (an explicit kernel config) is an eager-only tuning
knob: it runs the op directly, outside ``torch.compile`` graphs and autograd.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import api
from ..ops import attention as _attention
from ..ops import attention_backward as _attention_backward
from ..ops import attention_kvcache as _kvcache
from ..ops import attention_varlen as _varlen
from ..ops import gemm as _gemm
from ..ops import attention_fp8 as _attention_fp8
from ..ops import gemm_fp8 as _gemm_fp8
from ..ops import gemm_softmax as _gemm_softmax
from ..ops import grouped_gemm as _grouped
from ..ops import quantize as _quantize
from ..ops import softmax as _softmax
from ..ops import softmax_backward as _softmax_backward

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

_lib = torch.library.Library("tilepy", "DEF")

_SCHEMAS = {
    "gemm": "gemm(Tensor a, Tensor b, Tensor? bias, Tensor? c, str? activation, float alpha, "
            "float beta, ScalarType? out_dtype, bool allow_tf32) -> Tensor",
    "gemm_out": "gemm_out(Tensor a, Tensor b, Tensor? bias, Tensor? c, str? activation, "
                "float alpha, float beta, bool allow_tf32, Tensor(a!) out) -> ()",
    "softmax": "softmax(Tensor x, int axis) -> Tensor",
    "softmax_out": "softmax_out(Tensor x, int axis, Tensor(a!) out) -> ()",
    "log_softmax": "log_softmax(Tensor x, int axis) -> Tensor",
    "log_softmax_out": "log_softmax_out(Tensor x, int axis, Tensor(a!) out) -> ()",
    "softmax_backward": "softmax_backward(Tensor dy, Tensor y, int axis) -> Tensor",
    "log_softmax_backward": "log_softmax_backward(Tensor dy, Tensor y, int axis) -> Tensor",
    "softmax_backward_out": "softmax_backward_out(Tensor dy, Tensor y, int axis, "
                            "Tensor(a!) out) -> ()",
    "log_softmax_backward_out": "log_softmax_backward_out(Tensor dy, Tensor y, int axis, "
                                "Tensor(a!) out) -> ()",
    "gemm_softmax": "gemm_softmax(Tensor a, Tensor b, float scale) -> Tensor",
    "gemm_softmax_out": "gemm_softmax_out(Tensor a, Tensor b, float scale, Tensor(a!) out) "
                        "-> ()",
    # window_left / window_right: the key window (-1 unbounded); softcap 0.0: none;
    # alibi_slopes: ALiBi's (heads_q,) or (batch, heads_q) float32 slopes, None: none
    "flash_attention": "flash_attention(Tensor q, Tensor k, Tensor v, bool causal, "
                       "float? scale, int window_left, int window_right, float softcap, "
                       "bool return_lse, str layout, Tensor? alibi_slopes=None) "
                       "-> (Tensor, Tensor)",
    "flash_attention_out": "flash_attention_out(Tensor q, Tensor k, Tensor v, bool causal, "
                           "float? scale, int window_left, int window_right, float softcap, "
                           "bool return_lse, str layout, Tensor(a!) out, "
                           "Tensor? alibi_slopes=None) -> Tensor",
    "flash_attention_backward": "flash_attention_backward(Tensor dout, Tensor q, Tensor k, "
                                "Tensor v, Tensor out, Tensor lse, Tensor? dlse, bool causal, "
                                "float? scale, int window_left, int window_right, "
                                "float softcap, str layout, bool deterministic, "
                                "Tensor? alibi_slopes=None) -> (Tensor, Tensor, Tensor)",
    "flash_attention_backward_out": "flash_attention_backward_out(Tensor dout, Tensor q, "
                                    "Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
                                    "float? scale, int window_left, int window_right, "
                                    "float softcap, str layout, bool deterministic, "
                                    "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, "
                                    "Tensor? alibi_slopes=None) -> ()",
    # packed sequences: cu_seqlens int32 (n + 1), lse (heads_q, total_q)
    "flash_attention_varlen": "flash_attention_varlen(Tensor q, Tensor k, Tensor v, "
                              "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
                              "int max_seqlen_k, bool causal, float? scale, int window_left, "
                              "int window_right, float softcap, bool return_lse, "
                              "bool check_seqlens, Tensor? alibi_slopes=None) "
                              "-> (Tensor, Tensor)",
    "quantize_fp8": "quantize_fp8(Tensor x, str granularity, str dtype) -> (Tensor, Tensor)",
    # float8_e4m3fn q, k, v; descales one value or (batch, heads_kv); bfloat16 out
    "flash_attention_fp8": "flash_attention_fp8(Tensor q, Tensor k, Tensor v, bool causal, "
                           "float? scale, int window_left, int window_right, float softcap, "
                           "Tensor? descale_q, Tensor? descale_k, Tensor? descale_v, "
                           "bool return_lse, str layout) -> (Tensor, Tensor)",
    # float8 a (M, K), b (K, N) K-major; scales per tensor, row / column or block
    "gemm_fp8": "gemm_fp8(Tensor a, Tensor b, Tensor? scale_a, Tensor? scale_b, "
                "ScalarType? out_dtype, Tensor? bias=None, str? activation=None) -> Tensor",
    "grouped_gemm": "grouped_gemm(Tensor a, Tensor b, Tensor offsets, bool check_offsets) "
                    "-> Tensor",
    "grouped_gemm_weight_grad": "grouped_gemm_weight_grad(Tensor a, Tensor dout, "
                                "Tensor offsets, int groups) -> Tensor",
    # a KV cache (contiguous or paged), k / v appended into it first: the caches are written
    "flash_attention_with_kvcache": "flash_attention_with_kvcache(Tensor q, Tensor(a!) k_cache, "
                                    "Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? k, "
                                    "Tensor? v, Tensor? block_table, bool causal, "
                                    "float? scale, int window_left, int window_right, "
                                    "float softcap, bool return_lse, bool check_seqlens, "
                                    "int? num_splits=None) "
                                    "-> (Tensor, Tensor)",
    "flash_attention_varlen_backward": "flash_attention_varlen_backward(Tensor dout, "
                                       "Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                                       "Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                                       "int max_seqlen_q, int max_seqlen_k, bool causal, "
                                       "float? scale, int window_left, int window_right, "
                                       "float softcap, bool check_seqlens, "
                                       "Tensor? alibi_slopes=None, Tensor? dlse=None) "
                                       "-> (Tensor, Tensor, Tensor)",
}


def _register(name, impl, fake):
    """Define ``tilepy::name``, implement it for CUDA (and CPU, where the simulator runs
    kernels on CPU tensors and where a real GPU's op gives its 'move it to the GPU' error),
    and give it its fake implementation."""
    _lib.define(_SCHEMAS[name])
    _lib.impl(name, impl, "CUDA")
    _lib.impl(name, impl, "CPU")
    torch.library.register_fake(f"tilepy::{name}", fake, lib=_lib)
    return getattr(torch.ops.tilepy, name).default


# ---- when the dispatcher can be skipped -----------------------------------------------------

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_jit_tracing = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_functorch = torch._C._are_functorch_transforms_active


def _direct(*tensors) -> bool:
    """True when nothing in PyTorch needs to see this call (eager, no mode, no transform,
    plain tensors, no gradient wanted): the op may run without the dispatcher."""
    if _is_compiling() or _dispatch_modes() or _function_modes() or _functorch() or \
            _jit_tracing() is not None:
        return False
    grad = _grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


_bump = torch.autograd.graph.increment_version


def _written(result, out):
    """``result`` of a direct call; a caller's ``out`` it wrote has its version counter
    advanced, as an in-place PyTorch op would (autograd then refuses a saved tensor that was
    overwritten)."""
    if out is not None and not out.is_inference():
        _bump(out)
    return result


def _wants_grad(*tensors) -> bool:
    return _grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _no_grad_for(op: str, why: str, **tensors) -> None:
    """``TypeError`` naming the first of ``tensors`` that would need a gradient ``op`` does
    not give (``why``)."""
    if _grad_enabled():
        for name, t in tensors.items():
            # (not a tensor — a number, a NumPy array: the op's own checks name it)
            if getattr(t, "requires_grad", False):
                raise TypeError(f"{op}: {name} requires grad, but {why}; detach it or run "
                                "under torch.no_grad()")


def _tensors_or_none(op: str, what: str, **args) -> None:
    """A ``TypeError`` naming the first of ``args`` that is neither None nor a tensor (the
    operator's schema would refuse it with PyTorch's own message)."""
    for name, x in args.items():
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be {what} or None, got {type(x).__name__}")


def _no_double_backward(op: str, **tensors) -> None:
    """In a backward formula whose operator has no backward of its own: a ``TypeError``
    where a gradient of the gradients is being recorded (``create_graph=True``) through one
    of ``tensors``, which would otherwise come out silently wrong (PyTorch only warns that the
    operator has no autograd kernel)."""
    _no_grad_for(op, "its backward has no backward of its own (no double backward: "
                 "create_graph=True)", **tensors)


@functools.cache
def _eager_only():
    """A caller of its first argument outside compiled graphs (an explicit ``config``), made
    on first use: ``torch.compiler.disable`` imports torch._dynamo, a second of import time."""
    return torch.compiler.disable(lambda fn, *args, **kwargs: fn(*args, **kwargs))


def _configured(op: str, fn, tensors: dict, **kwargs):
    _no_grad_for(op, "an explicit config= runs the op outside autograd (leave config unset "
                 "to differentiate)", **tensors)
    return _eager_only()(fn, **tensors, **kwargs)


# ---- gemm -----------------------------------------------------------------------------------

def _gemm_impl(a, b, bias, c, activation, alpha, beta, out_dtype, allow_tf32):
    return _gemm.gemm(a, b, bias=bias, activation=activation, alpha=alpha, beta=beta, c=c,
                      out_dtype=out_dtype, allow_tf32=allow_tf32)


def _gemm_fake(a, b, bias, c, activation, alpha, beta, out_dtype, allow_tf32):
    shape, dtype = _gemm.output_spec(a, b, bias=bias, activation=activation, beta=beta, c=c,
                                     out_dtype=out_dtype, allow_tf32=allow_tf32)
    return a.new_empty(shape, dtype=_DTYPES[dtype])


def _gemm_out_impl(a, b, bias, c, activation, alpha, beta, allow_tf32, out):
    _gemm.gemm(a, b, bias=bias, activation=activation, alpha=alpha, beta=beta, c=c, out=out,
               out_dtype=out.dtype, allow_tf32=allow_tf32)


def _gemm_out_fake(a, b, bias, c, activation, alpha, beta, allow_tf32, out):
    _gemm.output_spec(a, b, bias=bias, activation=activation, beta=beta, c=c, out=out,
                      out_dtype=out.dtype, allow_tf32=allow_tf32)


_gemm_op = _register("gemm", _gemm_impl, _gemm_fake)
_gemm_out_op = _register("gemm_out", _gemm_out_impl, _gemm_out_fake)


def gemm(a, b, bias, activation, alpha, beta, c, out, out_dtype, config, allow_tf32):
    """``tilepy.gemm`` on PyTorch tensors (see :func:`tilepy.ops.gemm.gemm`)."""
    if beta == 0:
        c = None            # not read (BLAS): no gradient either
    if config is not None:
        return _configured("gemm", _gemm.gemm, dict(a=a, b=b, bias=bias, c=c, out=out),
                           activation=activation, alpha=alpha, beta=beta,
                           out_dtype=out_dtype, config=config, allow_tf32=allow_tf32)
    if _direct(a, b, bias, c, out):
        return _written(_gemm.gemm(a, b, bias=bias, activation=activation, alpha=alpha,
                                   beta=beta, c=c, out=out, out_dtype=out_dtype,
                                   allow_tf32=allow_tf32), out)
    alpha, beta = float(alpha), float(beta)
    if out is not None:
        _no_out_grad("gemm", out, a=a, b=b, bias=bias, c=c)
        _gemm_out_op(a, b, bias, c, activation, alpha, beta, allow_tf32, out)
        return out
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        from ..arrays import dtype_name

        out_dtype = _DTYPES.get(dtype_name(out_dtype), out_dtype)
    return _gemm_op(a, b, bias, c, activation, alpha, beta, out_dtype, allow_tf32)


def _no_out_grad(op: str, out, **tensors) -> None:
    if _wants_grad(out, *tensors.values()):
        raise TypeError(f"{op}: out= does not differentiate (as PyTorch's out= functions do "
                        "not); leave out unset, or run under torch.no_grad()")


def _gemm_setup(ctx, inputs, output):
    a, b, bias, c, activation, alpha, beta, _, _ = inputs
    ctx.activation, ctx.alpha, ctx.beta = activation, alpha, beta
    ctx.save_for_backward(a, b, bias, c, output if activation == "relu" else None)


def _sum_to(x, shape, dtype):
    """``x`` summed (in float32) over the leading axes that ``shape`` broadcasts, as
    ``dtype``."""
    if tuple(x.shape) != tuple(shape):
        x = x.float()
        while x.dim() > len(shape):
            x = x.sum(0)
        if x.dim() and x.shape[0] != shape[0]:
            x = x.sum(0, keepdim=True)
    return x.to(dtype)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def _activation_grad(activation, z):
    """d act(z) / dz, float32."""
    if activation == "gelu":
        return 0.5 * (1.0 + torch.erf(z * math.sqrt(0.5))) + z * torch.exp(-0.5 * z * z) / \
            math.sqrt(2.0 * math.pi)
    if activation == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_C * z * z * z))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * _GELU_C * z * z)
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    raise ValueError(f"no derivative for activation {activation!r}")


def _gemm_backward(ctx, dy):
    a, b, bias, c, y = ctx.saved_tensors
    act, alpha, beta = ctx.activation, ctx.alpha, ctx.beta
    need_a, need_b, need_bias, need_c = ctx.needs_input_grad[:4]
    if act is None:
        dz = dy
    elif act == "relu":
        dz = dy * (y > 0)
    else:   # the pre-activation again: one more product, instead of keeping it
        z = api.gemm(a, b, bias=bias, alpha=alpha, out_dtype=torch.float32)
        if c is not None:
            z = z + beta * c.float()
        dz = dy.float() * _activation_grad(act, z)
    g = dz.to(a.dtype)
    da = db = dbias = dc = None
    if need_a:   # a broadcast over the batch: products in float32, summed by _sum_to
        summed = g.dim() == 3 and (a.dim() == 2 or a.shape[0] != g.shape[0])
        da = api.gemm(g, b.mT, alpha=alpha, out_dtype=torch.float32 if summed else None)
        da = _sum_to(da, a.shape, a.dtype)
    if need_b:
        if b.dim() == 2 and g.dim() == 3:   # b broadcast over a's batch: one product
            k, n = b.shape
            db = api.gemm(a.reshape(-1, k).mT, g.reshape(-1, n), alpha=alpha)
        else:
            db = api.gemm(a.mT, g, alpha=alpha, out_dtype=torch.float32 if
                          b.dim() == 3 and b.shape[0] != g.shape[0] else None)
        db = _sum_to(db, b.shape, b.dtype)
    if need_bias:
        dbias = dz.float().sum(tuple(range(dz.dim() - 1))).to(bias.dtype)
    if need_c:
        dc = _sum_to(beta * dz.float(), c.shape, c.dtype)
    return da, db, dbias, dc, None, None, None, None, None


torch.library.register_autograd("tilepy::gemm", _gemm_backward, setup_context=_gemm_setup,
                                lib=_lib)


# ---- grouped_gemm ---------------------------------------------------------------------------

def _grouped_impl(a, b, offsets, check_offsets):
    return _grouped.grouped_gemm(a, b, offsets, check_offsets=check_offsets)


def _grouped_fake(a, b, offsets, check_offsets):
    shape, dtype = _grouped.output_spec(a, b, offsets)
    return a.new_empty(shape)


def _grouped_wgrad_impl(a, dout, offsets, groups):
    return _grouped.grouped_gemm_weight_grad(a, dout, offsets, groups)


def _grouped_wgrad_fake(a, dout, offsets, groups):
    return a.new_empty((groups, a.shape[1], dout.shape[1]))


_grouped_op = _register("grouped_gemm", _grouped_impl, _grouped_fake)
_grouped_wgrad_op = _register("grouped_gemm_weight_grad", _grouped_wgrad_impl,
                              _grouped_wgrad_fake)


def grouped_gemm(a, b, offsets, out, check_offsets, config):
    """``tilepy.grouped_gemm`` on PyTorch tensors: the ``tilepy::grouped_gemm`` operator
    (fake tensors, ``torch.compile``, autograd: ``a``'s gradient is a grouped GEMM against
    ``b``'s transposed view, ``b``'s the ``tilepy::grouped_gemm_weight_grad`` operator:
    :func:`tilepy.ops.grouped_gemm.grouped_gemm_weight_grad`'s default, one launch while a
    graph is captured); with ``out=`` or a ``config`` an eager call without a gradient."""
    op = "grouped_gemm"
    if config is not None:
        return _configured(op, _grouped.grouped_gemm, dict(a=a, b=b, offsets=offsets,
                                                           out=out),
                           check_offsets=check_offsets, config=config)
    if _direct(a, b, offsets, out):
        return _written(_grouped.grouped_gemm(a, b, offsets, out=out,
                                              check_offsets=check_offsets), out)
    if out is not None:
        _no_out_grad(op, out, a=a, b=b)
        return _eager_only()(_grouped.grouped_gemm, a, b, offsets, out=out,
                             check_offsets=check_offsets)
    return _grouped_op(a, b, offsets, bool(check_offsets))


def _grouped_setup(ctx, inputs, output):
    a, b, offsets, _ = inputs
    ctx.save_for_backward(a, b, offsets)


def _grouped_backward(ctx, dy):
    a, b, offsets = ctx.saved_tensors
    da = db = None
    if ctx.needs_input_grad[0]:
        da = _grouped_op(dy, b.mT, offsets, False)
    if ctx.needs_input_grad[1]:
        _no_double_backward("grouped_gemm", a=a, dy=dy)   # (da's is a grouped_gemm: it has)
        db = _grouped_wgrad_op(a, dy, offsets, b.shape[0])
    return da, db, None, None


torch.library.register_autograd("tilepy::grouped_gemm", _grouped_backward,
                                setup_context=_grouped_setup, lib=_lib)


# ---- gemm on float8 inputs ------------------------------------------------------------------

def _gemm_fp8_impl(a, b, scale_a, scale_b, out_dtype, bias=None, activation=None):
    return _gemm_fp8.gemm_fp8(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                              bias=bias, activation=activation)


def _gemm_fp8_fake(a, b, scale_a, scale_b, out_dtype, bias=None, activation=None):
    shape, dtype = _gemm_fp8.output_spec(a, b, scale_a=scale_a, scale_b=scale_b,
                                         out_dtype=out_dtype, bias=bias, activation=activation)
    return a.new_empty(shape, dtype=_DTYPES[dtype])


_gemm_fp8_op = _register("gemm_fp8", _gemm_fp8_impl, _gemm_fp8_fake)


def gemm_fp8(a, b, scale_a, scale_b, out_dtype, out, config, bias=None, activation=None):
    """``tilepy.gemm`` on float8 PyTorch tensors: the ``tilepy::gemm_fp8`` operator (fake
    tensors, ``torch.compile``, CUDA graphs); no gradient (``TypeError`` for an input that
    requires one). ``out=`` and ``config=`` run the op directly (eager only)."""
    _tensors_or_none("gemm", "a float32 tensor on a's device (0-d for one scale)",
                     scale_a=scale_a, scale_b=scale_b)
    _no_grad_for("gemm", "float8 inputs have no gradient here", a=a, b=b, bias=bias)
    if out is not None or config is not None or _direct(a, b, scale_a, scale_b, bias):
        return _gemm_fp8.gemm_fp8(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                  out=out, config=config, bias=bias, activation=activation)
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        from ..arrays import dtype_name

        out_dtype = _DTYPES.get(dtype_name(out_dtype), out_dtype)
    return _gemm_fp8_op(a, b, scale_a, scale_b, out_dtype, bias, activation)


# ---- flash_attention on float8 inputs ------------------------------------------------------

def _attention_fp8_impl(q, k, v, causal, scale, wl, wr, softcap, dq, dk, dv, return_lse,
                        layout):
    res = _attention_fp8.flash_attention_fp8(
        q, k, v, causal=causal, scale=scale, window=(wl, wr), softcap=softcap, descale_q=dq,
        descale_k=dk, descale_v=dv, return_lse=return_lse, layout=layout)
    return res if return_lse else (res, _no_lse(q))


def _attention_fp8_fake(q, k, v, causal, scale, wl, wr, softcap, dq, dk, dv, return_lse,
                        layout):
    shape, lse_shape = _attention_fp8.output_spec(
        q, k, v, causal=causal, scale=scale, window=(wl, wr), softcap=softcap, descale_q=dq,
        descale_k=dk, descale_v=dv, layout=layout)
    return (q.new_empty(shape, dtype=torch.bfloat16),
            q.new_empty(lse_shape, dtype=torch.float32) if return_lse else _no_lse(q))


_attention_fp8_op = _register("flash_attention_fp8", _attention_fp8_impl, _attention_fp8_fake)


def flash_attention_fp8(q, k, v, causal, scale, window, softcap, descales, return_lse, out,
                        layout, config):
    """``tilepy.flash_attention`` on float8 PyTorch tensors: the ``tilepy::flash_attention_fp8``
    operator (fake tensors, ``torch.compile``, CUDA graphs); no gradient (``TypeError`` for an
    input that requires one). ``out=`` and ``config=`` run the op directly (eager only)."""
    dq, dk, dv = descales
    _tensors_or_none("flash_attention", "a float32 tensor on q's device (0-d for one value)",
                     descale_q=dq, descale_k=dk, descale_v=dv)
    _no_grad_for("flash_attention", "float8 inputs have no gradient here", q=q, k=k, v=v,
                 descale_q=dq, descale_k=dk, descale_v=dv)
    if out is not None or config is not None or _direct(q, k, v, dq, dk, dv):
        return _written(_attention_fp8.flash_attention_fp8(
            q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, descale_q=dq,
            descale_k=dk, descale_v=dv, return_lse=return_lse, out=out, layout=layout,
            config=config), out)
    wl, wr, cap = _variant_args(causal, window, softcap)
    if scale is not None:
        scale = _float_arg("flash_attention", "scale", scale)
    res, lse = _attention_fp8_op(q, k, v, causal, scale, wl, wr, cap, dq, dk, dv, return_lse,
                                 layout)
    return (res, lse) if return_lse else res


# ---- quantize_fp8 ---------------------------------------------------------------------------

_GRANULARITY = {"tensor": "tensor", "row": "row", (1, 128): "1x128", (128, 128): "128x128"}
_GRANULARITY_BACK = {v: k for k, v in _GRANULARITY.items()}


def _quantize_impl(x, granularity, dtype):
    return _quantize.quantize_fp8(x, granularity=_GRANULARITY_BACK[granularity], dtype=dtype)


def _quantize_fake(x, granularity, dtype):
    shape, scales = _quantize.output_spec(x, granularity=_GRANULARITY_BACK[granularity],
                                          dtype=dtype)
    return (x.new_empty(shape, dtype=getattr(torch, _quantize.FORMATS[dtype])),
            x.new_empty(scales, dtype=torch.float32))


_quantize_op = _register("quantize_fp8", _quantize_impl, _quantize_fake)


def quantize_fp8(x, granularity, dtype):
    """``tilepy.quantize_fp8`` on PyTorch tensors: the ``tilepy::quantize_fp8`` operator (fake
    tensors, ``torch.compile``); no gradient (``TypeError`` for an input that requires one)."""
    op = "quantize_fp8"
    _no_grad_for(op, "quantisation has no gradient here", x=x)
    gran = granularity if isinstance(granularity, str) else tuple(granularity)
    if _direct(x) or gran not in _GRANULARITY:
        return _quantize.quantize_fp8(x, granularity=granularity, dtype=dtype)
    return _quantize_op(x, _GRANULARITY[gran], dtype)


# ---- softmax, log_softmax and their backward ------------------------------------------------

def _softmax_fake(x, axis):
    shape, dtype = _softmax.output_spec(x, axis)
    return x.new_empty(shape)


def _softmax_out_fake(x, axis, out):
    _softmax.output_spec(x, axis, out=out)


_softmax_ops = {
    False: _register("softmax", lambda x, axis: _softmax.softmax(x, axis), _softmax_fake),
    True: _register("log_softmax", lambda x, axis: _softmax.log_softmax(x, axis),
                    _softmax_fake),
}


def _softmax_out_impl(x, axis, out):
    _softmax.softmax(x, axis, out=out)


def _log_softmax_out_impl(x, axis, out):
    _softmax.log_softmax(x, axis, out=out)


_softmax_out_ops = {False: _register("softmax_out", _softmax_out_impl, _softmax_out_fake),
                    True: _register("log_softmax_out", _log_softmax_out_impl,
                                    _softmax_out_fake)}


def _backward_fake(dy, y, axis):
    shape, dtype = _softmax_backward.output_spec(dy, y, axis)
    return dy.new_empty(shape)


_backward_ops = {
    False: _register("softmax_backward",
                     lambda dy, y, axis: _softmax_backward.softmax_backward(dy, y, axis),
                     _backward_fake),
    True: _register("log_softmax_backward",
                    lambda dy, y, axis: _softmax_backward.log_softmax_backward(dy, y, axis),
                    _backward_fake),
}


def _backward_out_fake(dy, y, axis, out):
    _softmax_backward.output_spec(dy, y, axis, out=out)


def _softmax_backward_out_impl(dy, y, axis, out):
    _softmax_backward.softmax_backward(dy, y, axis, out=out)


def _log_softmax_backward_out_impl(dy, y, axis, out):
    _softmax_backward.log_softmax_backward(dy, y, axis, out=out)


_backward_out_ops = {
    False: _register("softmax_backward_out", _softmax_backward_out_impl, _backward_out_fake),
    True: _register("log_softmax_backward_out", _log_softmax_backward_out_impl,
                    _backward_out_fake)}


def softmax(x, axis, out, config, log: bool):
    """``tilepy.softmax`` / ``log_softmax`` on PyTorch tensors."""
    fn = _softmax.log_softmax if log else _softmax.softmax
    name = "log_softmax" if log else "softmax"
    if config is not None:
        return _configured(name, fn, dict(x=x, out=out), axis=axis, config=config)
    if _direct(x, out):
        return _written(fn(x, axis, out=out), out)
    if out is not None:
        _no_out_grad(name, out, x=x)
        _softmax_out_ops[log](x, axis, out)
        return out
    return _softmax_ops[log](x, axis)


def softmax_backward(dy, y, axis, out, config, log: bool):
    """``tilepy.softmax_backward`` / ``log_softmax_backward`` on PyTorch tensors (not
    differentiable themselves: no double backward)."""
    name = "log_softmax_backward" if log else "softmax_backward"
    fn = _softmax_backward.log_softmax_backward if log else _softmax_backward.softmax_backward
    if config is not None:
        return _configured(name, fn, dict(dy=dy, y=y, out=out), axis=axis, config=config)
    why = "tilepy's backward ops are not differentiable (no double backward)"
    _no_grad_for(name, why, dy=dy, y=y, out=out)
    if _direct(dy, y, out):
        return _written(fn(dy, y, axis, out=out), out)
    if out is not None:
        _backward_out_ops[log](dy, y, axis, out)
        return out
    return _backward_ops[log](dy, y, axis)


def _softmax_setup(ctx, inputs, output):
    ctx.axis = inputs[1]
    ctx.save_for_backward(output)


def _softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return api.softmax_backward(dy, y, ctx.axis), None


def _log_softmax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return api.log_softmax_backward(dy, y, ctx.axis), None


torch.library.register_autograd("tilepy::softmax", _softmax_grad, setup_context=_softmax_setup,
                                lib=_lib)
torch.library.register_autograd("tilepy::log_softmax", _log_softmax_grad,
                                setup_context=_softmax_setup, lib=_lib)


# ---- gemm_softmax -----------------------------------------------------------------------------

def _gemm_softmax_fake(a, b, scale):
    shape, dtype = _gemm_softmax.output_spec(a, b, scale=scale)
    return a.new_empty(shape)


def _gemm_softmax_out_fake(a, b, scale, out):
    _gemm_softmax.output_spec(a, b, scale=scale, out=out)


_gemm_softmax_op = _register(
    "gemm_softmax", lambda a, b, scale: _gemm_softmax.gemm_softmax(a, b, scale=scale),
    _gemm_softmax_fake)


def _gemm_softmax_out_impl(a, b, scale, out):
    _gemm_softmax.gemm_softmax(a, b, scale=scale, out=out)


_gemm_softmax_out_op = _register("gemm_softmax_out", _gemm_softmax_out_impl,
                                 _gemm_softmax_out_fake)


def gemm_softmax(a, b, scale, out, config):
    """``tilepy.gemm_softmax`` on PyTorch tensors."""
    if config is not None:
        return _configured("gemm_softmax", _gemm_softmax.gemm_softmax, dict(a=a, b=b, out=out),
                           scale=scale, config=config)
    if _direct(a, b, out):
        return _written(_gemm_softmax.gemm_softmax(a, b, scale=scale, out=out), out)
    scale = _float_arg("gemm_softmax", "scale", scale)
    if out is not None:
        _no_out_grad("gemm_softmax", out, a=a, b=b)
        _gemm_softmax_out_op(a, b, scale, out)
        return out
    return _gemm_softmax_op(a, b, scale)


def _gemm_softmax_setup(ctx, inputs, output):
    a, b, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(a, b, output)


def _gemm_softmax_grad(ctx, dy):
    a, b, y = ctx.saved_tensors
    ds = api.softmax_backward(dy, y, -1)
    need_a, need_b = ctx.needs_input_grad[:2]
    da = api.gemm(ds, b.mT, alpha=ctx.scale) if need_a else None
    db = api.gemm(a.mT, ds, alpha=ctx.scale) if need_b else None
    return da, db, None


torch.library.register_autograd("tilepy::gemm_softmax", _gemm_softmax_grad,
                                setup_context=_gemm_softmax_setup, lib=_lib)


# ---- flash_attention ------------------------------------------------------------------------

def _no_lse(q):
    return q.new_empty((0,), dtype=torch.float32)


def _attention_impl(q, k, v, causal, scale, wl, wr, softcap, return_lse, layout,
                    alibi_slopes=None):
    res = _attention.flash_attention(q, k, v, causal=causal, scale=scale, window=(wl, wr),
                                     softcap=softcap, alibi_slopes=alibi_slopes,
                                     return_lse=return_lse, layout=layout)
    return res if return_lse else (res, _no_lse(q))


def _attention_fake(q, k, v, causal, scale, wl, wr, softcap, return_lse, layout,
                    alibi_slopes=None):
    shape, lse_shape, _ = _attention.output_spec(q, k, v, causal=causal, scale=scale,
                                                 window=(wl, wr), softcap=softcap,
                                                 alibi_slopes=alibi_slopes, layout=layout)
    return q.new_empty(shape), (q.new_empty(lse_shape, dtype=torch.float32) if return_lse
                                else _no_lse(q))


def _attention_out_impl(q, k, v, causal, scale, wl, wr, softcap, return_lse, layout, out,
                        alibi_slopes=None):
    res = _attention.flash_attention(q, k, v, causal=causal, scale=scale, window=(wl, wr),
                                     softcap=softcap, alibi_slopes=alibi_slopes,
                                     return_lse=return_lse, out=out, layout=layout)
    return res[1] if return_lse else _no_lse(q)


def _attention_out_fake(q, k, v, causal, scale, wl, wr, softcap, return_lse, layout, out,
                        alibi_slopes=None):
    _, lse_shape, _ = _attention.output_spec(q, k, v, causal=causal, scale=scale,
                                             window=(wl, wr), softcap=softcap,
                                             alibi_slopes=alibi_slopes, out=out,
                                             layout=layout)
    return q.new_empty(lse_shape, dtype=torch.float32) if return_lse else _no_lse(q)


_attention_op = _register("flash_attention", _attention_impl, _attention_fake)
_attention_out_op = _register("flash_attention_out", _attention_out_impl, _attention_out_fake)


def _variant_args(causal, window, softcap):
    """``(window_left, window_right, softcap)`` for the operators' schema, checked as the op
    checks them (``causal`` a bool first: the schema's type)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    (wl, wr), cap = _attention.check_variant(causal, window, softcap)
    return wl, wr, cap


def flash_attention(q, k, v, causal, scale, window, softcap, return_lse, out, layout, config,
                    alibi_slopes=None):
    """``tilepy.flash_attention`` on PyTorch tensors (``alibi_slopes`` an operator argument:
    no graph break; no gradient flows into it, and slopes that require grad are a
    ``NotImplementedError``)."""
    _no_hook_arg_grads("flash_attention", alibi_slopes, ())
    if config is not None:
        return _configured("flash_attention", _attention.flash_attention,
                           dict(q=q, k=k, v=v, out=out), causal=causal, scale=scale,
                           window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                           return_lse=return_lse, layout=layout, config=config)
    if _direct(q, k, v, out, alibi_slopes):
        return _written(_attention.flash_attention(q, k, v, causal=causal, scale=scale,
                                                   window=window, softcap=softcap,
                                                   alibi_slopes=alibi_slopes,
                                                   return_lse=return_lse, out=out,
                                                   layout=layout), out)
    wl, wr, cap = _variant_args(causal, window, softcap)
    if scale is not None:
        scale = _float_arg("flash_attention", "scale", scale)
    if out is not None:
        _no_out_grad("flash_attention", out, q=q, k=k, v=v)
        lse = _attention_out_op(q, k, v, causal, scale, wl, wr, cap, return_lse, layout, out,
                                alibi_slopes)
        return (out, lse) if return_lse else out
    res, lse = _attention_op(q, k, v, causal, scale, wl, wr, cap,
                             True if _wants_grad(q, k, v) else return_lse, layout,
                             alibi_slopes)
    return (res, lse) if return_lse else res


def flash_attention_mods(q, k, v, causal, scale, window, softcap, mods, return_lse, out,
                         layout, config):
    """``tilepy.flash_attention`` with user functions or ALiBi (``mods``: ``(score_mod,
    score_mod_grad, mask_mod, alibi_slopes, mod_args, block_mask)``) on PyTorch tensors:
    outside compiled graphs (a Python function is no operator argument), differentiable in q,
    k and v through :func:`tilepy.flash_attention_backward` with the same functions (not in
    the slopes or ``mod_args``: a tensor among them that requires grad is a
    ``NotImplementedError``)."""
    score_mod, score_mod_grad, mask_mod, alibi_slopes, mod_args, block_mask = mods
    kwargs = dict(causal=causal, scale=scale, window=window, softcap=softcap,
                  alibi_slopes=alibi_slopes, score_mod=score_mod,
                  score_mod_grad=score_mod_grad, mask_mod=mask_mod, mod_args=mod_args,
                  block_mask=block_mask, layout=layout)
    _no_hook_arg_grads("flash_attention", alibi_slopes,
                       block_mask.function(None, mod_args)[1]
                       if hasattr(block_mask, "function") else mod_args)
    if not _wants_grad(q, k, v):
        res = _eager_only()(_attention.flash_attention, q=q, k=k, v=v, return_lse=return_lse,
                            out=out, config=config, **kwargs)
        return _written(res, out)
    if config is not None:
        _no_grad_for("flash_attention", "an explicit config= runs the op outside autograd "
                     "(leave config unset to differentiate)", q=q, k=k, v=v)
    if out is not None:
        _no_out_grad("flash_attention", out, q=q, k=k, v=v)
    if score_mod is not None and score_mod_grad is None:
        raise NotImplementedError(
            "tilepy.flash_attention: the backward of a score_mod needs its derivative: pass "
            "score_mod_grad=(score, b, h, q_idx, kv_idx) -> d score_mod / d score (or detach "
            "q, k and v, or run under torch.no_grad())")
    res, lse = _eager_only()(_UserFunctionsAttention.apply, q, k, v, kwargs)
    return (res, lse) if return_lse else res


class _UserFunctionsAttention(torch.autograd.Function):
    """flash_attention with user functions and its backward, eagerly."""

    @staticmethod
    def forward(ctx, q, k, v, kwargs):
        out, lse = _attention.flash_attention(q, k, v, return_lse=True, **kwargs)
        ctx.kwargs = kwargs
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _attention_backward.flash_attention_backward(
            dout, q, k, v, out, lse, dlse=dlse, **ctx.kwargs)
        return dq, dk, dv, None


def _no_hook_arg_grads(op: str, alibi_slopes, mod_args) -> None:
    """``NotImplementedError`` for slopes or ``mod_args`` tensors that require grad: their
    gradients are not computed, and a silently missing gradient is worse than an error."""
    named = [("alibi_slopes", alibi_slopes)] + [
        (f"mod_args[{i}]", x) for i, x in enumerate(
            mod_args if type(mod_args) in (tuple, list) else ())]
    for name, x in named:
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(
                f"tilepy.{op}: {name} requires grad, but gradients are computed in q, k and v "
                f"only; pass it detached (.detach())")


def flash_attention_backward_mods(dout, q, k, v, out, lse, **kwargs):
    """``tilepy.flash_attention_backward`` with user functions or ALiBi on PyTorch tensors:
    eager, not itself differentiable."""
    _no_grad_for("flash_attention_backward", "it has no backward of its own (double "
                 "backward)", dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    _no_hook_arg_grads("flash_attention_backward", kwargs.get("alibi_slopes"),
                       kwargs.get("mod_args"))
    grads = {n: kwargs[n] for n in ("dq", "dk", "dv")}
    res = _eager_only()(_attention_backward.flash_attention_backward, dout, q, k, v, out, lse,
                        **kwargs)
    for g in grads.values():
        _written(None, g)
    return res


def _float_arg(op: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__} {value!r}")
    return float(value)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, wl, wr, softcap, _, layout, *rest = inputs
    out, lse = output
    ctx.causal, ctx.scale, ctx.layout = causal, scale, layout
    ctx.variant = (wl, wr, softcap)
    ctx.n_inputs = len(inputs)
    ctx.has_lse = lse.dim() == 3   # the no-LSE placeholder is 1-D
    ctx.save_for_backward(q, k, v, out, lse, rest[0] if rest else None)
    ctx.set_materialize_grads(False)


def _attention_grad(ctx, dout, dlse):
    q, k, v, out, lse, alibi = ctx.saved_tensors
    if not ctx.has_lse:
        raise RuntimeError("tilepy.flash_attention: the forward ran without its LSE, which "
                           "the backward needs (a gradient was not wanted when it ran)")
    if dout is None and dlse is None:
        return (None,) * ctx.n_inputs
    _no_double_backward("flash_attention", q=q, k=k, v=v, dout=dout, dlse=dlse)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _attention_backward_op(dout, q, k, v, out, lse, dlse, ctx.causal, ctx.scale,
                                        *ctx.variant, ctx.layout, False, alibi)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


torch.library.register_autograd("tilepy::flash_attention", _attention_grad,
                                setup_context=_attention_setup, lib=_lib)


# ---- flash_attention_backward ---------------------------------------------------------------

def _attention_backward_impl(dout, q, k, v, out, lse, dlse, causal, scale, wl, wr, softcap,
                             layout, deterministic, alibi_slopes=None):
    return _attention_backward.flash_attention_backward(
        dout, q, k, v, out, lse, causal=causal, scale=scale, window=(wl, wr), softcap=softcap,
        alibi_slopes=alibi_slopes, layout=layout, deterministic=deterministic, dlse=dlse)


def _attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, scale, wl, wr, softcap,
                             layout, deterministic, alibi_slopes=None):
    shapes = _attention_backward.output_spec(dout, q, k, v, out, lse, causal=causal,
                                             scale=scale, window=(wl, wr), softcap=softcap,
                                             alibi_slopes=alibi_slopes, layout=layout,
                                             deterministic=deterministic)
    return tuple(x.new_empty(shape) for x, shape in zip((q, k, v), shapes[:3]))


def _attention_backward_out_impl(dout, q, k, v, out, lse, causal, scale, wl, wr, softcap,
                                 layout, deterministic, dq, dk, dv, alibi_slopes=None):
    _attention_backward.flash_attention_backward(
        dout, q, k, v, out, lse, causal=causal, scale=scale, window=(wl, wr), softcap=softcap,
        alibi_slopes=alibi_slopes, layout=layout, deterministic=deterministic, dq=dq, dk=dk,
        dv=dv)


def _attention_backward_out_fake(dout, q, k, v, out, lse, causal, scale, wl, wr, softcap,
                                 layout, deterministic, dq, dk, dv, alibi_slopes=None):
    _attention_backward.output_spec(dout, q, k, v, out, lse, causal=causal, scale=scale,
                                    window=(wl, wr), softcap=softcap,
                                    alibi_slopes=alibi_slopes, layout=layout,
                                    deterministic=deterministic)


_attention_backward_op = _register("flash_attention_backward", _attention_backward_impl,
                                   _attention_backward_fake)
_attention_backward_out_op = _register("flash_attention_backward_out",
                                       _attention_backward_out_impl,
                                       _attention_backward_out_fake)


def flash_attention_backward(dout, q, k, v, out, lse, causal, scale, window, softcap, layout,
                             deterministic, dq, dk, dv, config, alibi_slopes=None):
    """``tilepy.flash_attention_backward`` on PyTorch tensors. It is not itself
    differentiable (no double backward): a gradient wanted through it is a ``TypeError``."""
    tensors = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    _no_grad_for("flash_attention_backward", "it has no backward of its own (double "
                 "backward is not supported)", **tensors)
    _no_hook_arg_grads("flash_attention_backward", alibi_slopes, ())
    kwargs = dict(causal=causal, scale=scale, window=window, softcap=softcap,
                  alibi_slopes=alibi_slopes, layout=layout, deterministic=deterministic)
    if config is not None:
        return _eager_only()(_attention_backward.flash_attention_backward, **tensors,
                             config=config, **kwargs)
    if _direct(dout, q, k, v, out, lse, dq, dk, dv):
        res = _attention_backward.flash_attention_backward(dout, q, k, v, out, lse, dq=dq,
                                                           dk=dk, dv=dv, **kwargs)
        for given in (dq, dk, dv):
            _written(None, given)
        return res
    wl, wr, cap = _variant_args(causal, window, softcap)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} "
                        f"{deterministic!r}")
    if scale is not None:
        scale = _float_arg("flash_attention_backward", "scale", scale)
    if dq is None and dk is None and dv is None:
        return _attention_backward_op(dout, q, k, v, out, lse, None, causal, scale, wl, wr,
                                      cap, layout, deterministic, alibi_slopes)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    _attention_backward_out_op(dout, q, k, v, out, lse, causal, scale, wl, wr, cap, layout,
                               deterministic, dq, dk, dv, alibi_slopes)
    return dq, dk, dv


api._front = __import__(__name__, fromlist=["_"])   # the fronts' shortcut to this module

# ---- flash_attention_varlen -----------------------------------------------------------------

def _varlen_impl(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap,
                 return_lse, check_seqlens, alibi_slopes=None):
    res = _varlen.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                         scale=scale, window=(wl, wr), softcap=softcap,
                                         alibi_slopes=alibi_slopes, return_lse=return_lse,
                                         check_seqlens=check_seqlens)
    return res if return_lse else (res, _no_lse(q))


def _varlen_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap,
                 return_lse, check_seqlens, alibi_slopes=None):
    shape, lse_shape = _varlen.output_spec(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                           scale=scale, window=(wl, wr), softcap=softcap,
                                           alibi_slopes=alibi_slopes)
    return q.new_empty(shape), (q.new_empty(lse_shape, dtype=torch.float32) if return_lse
                                else _no_lse(q))


def _varlen_backward_impl(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                          wl, wr, softcap, check_seqlens, alibi_slopes=None, dlse=None):
    return _varlen.flash_attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale,
        window=(wl, wr), softcap=softcap, alibi_slopes=alibi_slopes,
        check_seqlens=check_seqlens, dlse=dlse)


def _varlen_backward_fake(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                          wl, wr, softcap, check_seqlens, alibi_slopes=None, dlse=None):
    _varlen.output_spec(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale,
                        window=(wl, wr), softcap=softcap, alibi_slopes=alibi_slopes,
                        any_device=True)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_varlen_op = _register("flash_attention_varlen", _varlen_impl, _varlen_fake)
_varlen_backward_op = _register("flash_attention_varlen_backward", _varlen_backward_impl,
                                _varlen_backward_fake)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal, scale, window, softcap, alibi_slopes, mods, return_lse,
                           out, check_seqlens, config):
    """``tilepy.flash_attention_varlen`` on PyTorch tensors: the ``tilepy::
    flash_attention_varlen`` operator (autograd through ``flash_attention_varlen_backward``,
    fake tensors, ``torch.compile`` without a graph break); with ``out=``, a ``config``, or
    user functions (``mods``: ``(score_mod, mask_mod, mod_args)``) an eager call that does not
    differentiate (a ``TypeError`` / ``NotImplementedError`` when a gradient is wanted)."""
    _no_hook_arg_grads("flash_attention_varlen", alibi_slopes, mods[2])
    score_mod, mask_mod, mod_args = mods
    user = score_mod is not None or mask_mod is not None or (
        mod_args is not None and (type(mod_args) not in (tuple, list) or len(mod_args)))
    kwargs = dict(causal=causal, scale=scale, window=window, softcap=softcap,
                  alibi_slopes=alibi_slopes, score_mod=score_mod, mask_mod=mask_mod,
                  mod_args=mod_args, return_lse=return_lse, out=out,
                  check_seqlens=check_seqlens, config=config)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if user:
        if _wants_grad(q, k, v):
            raise NotImplementedError(
                "tilepy.flash_attention_varlen: no autograd with score_mod / mask_mod yet; "
                "call tilepy.ops.attention_varlen.flash_attention_varlen_backward, or run "
                "under torch.no_grad()")
        return _eager_only()(_varlen.flash_attention_varlen, *args, **kwargs)
    if config is not None:
        return _configured("flash_attention_varlen", _varlen.flash_attention_varlen,
                           dict(q=q, k=k, v=v), *args[3:], **kwargs)
    if _direct(q, k, v, out, alibi_slopes, cu_seqlens_q, cu_seqlens_k):
        return _written(_varlen.flash_attention_varlen(*args, **kwargs), out)
    wl, wr, cap = _variant_args(causal, window, softcap)
    if scale is not None:
        scale = _float_arg("flash_attention_varlen", "scale", scale)
    if out is not None:
        _no_out_grad("flash_attention_varlen", out, q=q, k=k, v=v)
        res = _eager_only()(_varlen.flash_attention_varlen, *args, **kwargs)
        return _written(res, out)
    res, lse = _varlen_op(*args, causal, scale, wl, wr, cap,
                          True if _wants_grad(q, k, v) else return_lse, bool(check_seqlens),
                          alibi_slopes)
    return (res, lse) if return_lse else res


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, _, check, *rest = inputs
    out, lse = output
    ctx.args = (max_q, max_k, causal, scale, wl, wr, softcap, check)
    ctx.n_inputs = len(inputs)
    ctx.has_lse = lse.dim() == 2   # the no-LSE placeholder is 1-D
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rest[0] if rest else None)
    ctx.set_materialize_grads(False)


def _varlen_grad(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, alibi = ctx.saved_tensors
    if not ctx.has_lse:
        raise RuntimeError("tilepy.flash_attention_varlen: the forward ran without its LSE, "
                           "which the backward needs (a gradient was not wanted when it ran)")
    if dout is None and dlse is None:
        return (None,) * ctx.n_inputs
    _no_double_backward("flash_attention_varlen", q=q, k=k, v=v, dout=dout, dlse=dlse)
    if dout is None:
        dout = torch.zeros_like(out)
    max_q, max_k, causal, scale, wl, wr, softcap, check = ctx.args
    dq, dk, dv = _varlen_backward_op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                     causal, scale, wl, wr, softcap, check, alibi, dlse)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


torch.library.register_autograd("tilepy::flash_attention_varlen", _varlen_grad,
                                setup_context=_varlen_setup, lib=_lib)


# ---- flash_attention_with_kvcache -----------------------------------------------------------

def _kvcache_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, scale, wl, wr,
                  softcap, return_lse, check_seqlens, num_splits=None):
    res = _kvcache.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table, causal=causal,
        scale=scale, window=(wl, wr), softcap=softcap, return_lse=return_lse,
        check_seqlens=check_seqlens, num_splits=num_splits)
    return res if return_lse else (res, _no_lse(q))


def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, scale, wl, wr,
                  softcap, return_lse, check_seqlens, num_splits=None):
    _kvcache.check_num_splits(num_splits)
    shape, lse_shape = _kvcache.output_spec(q, k_cache, v_cache, cache_seqlens,
                                            block_table=block_table, return_lse=return_lse)
    return q.new_empty(shape), (q.new_empty(lse_shape, dtype=torch.float32) if return_lse
                                else _no_lse(q))


_kvcache_op = _register("flash_attention_with_kvcache", _kvcache_impl, _kvcache_fake)


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal,
                                 scale, window, softcap, num_splits, return_lse, out,
                                 check_seqlens, config):
    """``tilepy.flash_attention_with_kvcache`` on PyTorch tensors: the ``tilepy::
    flash_attention_with_kvcache`` operator (it writes the caches; fake tensors and
    ``torch.compile`` without a graph break); with ``out=`` or a ``config`` an eager call. An inference op: no gradient (``TypeError`` for inputs that require
    one)."""
    op = "flash_attention_with_kvcache"
    _no_grad_for(op, "it has no backward (an inference op)", q=q, k_cache=k_cache,
                 v_cache=v_cache, k=k, v=v)
    kwargs = dict(k=k, v=v, block_table=block_table, causal=causal, scale=scale,
                  window=window, softcap=softcap, num_splits=num_splits,
                  return_lse=return_lse, out=out, check_seqlens=check_seqlens, config=config)
    args = (q, k_cache, v_cache, cache_seqlens)
    if _direct(q, k_cache, v_cache, cache_seqlens, k, v, block_table, out):
        return _kvcache.flash_attention_with_kvcache(*args, **kwargs)
    if out is not None or config is not None:
        return _eager_only()(_kvcache.flash_attention_with_kvcache, *args, **kwargs)
    wl, wr, cap = _variant_args(causal, window, softcap)
    if scale is not None:
        scale = _float_arg(op, "scale", scale)
    res, lse = _kvcache_op(*args, k, v, block_table, causal, scale, wl, wr, cap,
                           bool(return_lse), bool(check_seqlens),
                           _kvcache.check_num_splits(num_splits))
    return (res, lse) if return_lse else res


__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_varlen",
           "flash_attention_with_kvcache", "gemm",
           "gemm_softmax", "grouped_gemm", "quantize_fp8", "softmax", "softmax_backward"]
