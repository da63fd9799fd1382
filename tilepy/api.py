"""The public ops, one front for every array kind.

PyTorch tensors go through the operators registered in the ``tilepy`` namespace
(:mod:`tilepy.integrations.pytorch`: ``torch.ops.tilepy.*``, with fake implementations and
autograd formulas), so ``torch.compile`` traces them and ``loss.backward()`` differentiates
them; CuPy arrays, Numba device arrays (and NumPy arrays in the simulator) go straight to
the ops in :mod:`tilepy.ops`. Nothing here imports PyTorch: the PyTorch side is loaded the
first time a tensor arrives (or by ``import tilepy`` when PyTorch is already imported), so
``import tilepy`` never imports PyTorch itself.

The kind is read from the first array argument's type (``torch.Tensor`` and its subclasses
live in modules named ``torch…``); mixing kinds is an error raised by the op.
"""

from __future__ import annotations

from .ops import attention as _attention
from .ops import attention_backward as _attention_backward
from .ops import attention_block_mask as _attention_block_mask
from .ops import attention_fp8 as _attention_fp8
from .ops import attention_kvcache as _attention_kvcache
from .ops import attention_varlen as _attention_varlen
from .ops import gemm as _gemm
from .ops import gemm_fp8 as _gemm_fp8
from .ops import gemm_softmax as _gemm_softmax
from .ops import grouped_gemm as _grouped_gemm
from .ops import quantize as _quantize
from .ops import softmax as _softmax
from .ops import softmax_backward as _softmax_backward


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


#: tilepy.integrations.pytorch once it is loaded (it sets this itself)
_front = None


def _pytorch():
    from .integrations import pytorch

    return pytorch


def gemm(a, b, *, bias=None, activation=None, alpha=1.0, beta=0.0, c=None, out=None,
         out_dtype=None, config=None, allow_tf32=False, scale_a=None, scale_b=None):
    if scale_a is not None or scale_b is not None or _gemm_fp8.is_fp8(a):
        return _fp8(a, b, bias, activation, alpha, beta, c, out, out_dtype, config, scale_a,
                    scale_b)
    if _is_torch(a):
        return (_front or _pytorch()).gemm(a, b, bias, activation, alpha, beta, c, out,
                                           out_dtype, config, allow_tf32)
    return _gemm.gemm(a, b, bias=bias, activation=activation, alpha=alpha, beta=beta, c=c,
                      out=out, out_dtype=out_dtype, config=config, allow_tf32=allow_tf32)


def grouped_gemm(a, b, offsets, *, out=None, check_offsets=True, config=None):
    if _is_torch(a):
        return (_front or _pytorch()).grouped_gemm(a, b, offsets, out, check_offsets, config)
    return _grouped_gemm.grouped_gemm(a, b, offsets, out=out, check_offsets=check_offsets,
                                      config=config)


def quantize_fp8(x, *, granularity="tensor", dtype="e4m3"):
    if _is_torch(x):
        return (_front or _pytorch()).quantize_fp8(x, granularity, dtype)
    return _quantize.quantize_fp8(x, granularity=granularity, dtype=dtype)


def _fp8(a, b, bias, activation, alpha, beta, c, out, out_dtype, config, scale_a, scale_b):
    """gemm on float8 inputs (on PyTorch tensors the ``tilepy::gemm_fp8`` operator; no
    gradient)."""
    if alpha != 1.0 or beta != 0 or c is not None:
        raise NotImplementedError("gemm on float8 inputs: alpha, beta and c are not built yet "
                                  "(scale_a / scale_b carry the scaling)")
    if _is_torch(a):
        return (_front or _pytorch()).gemm_fp8(a, b, scale_a, scale_b, out_dtype, out, config,
                                               bias, activation)
    return _gemm_fp8.gemm_fp8(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                              out=out, bias=bias, activation=activation, config=config)


def softmax(x, axis=-1, *, out=None, config=None):
    if _is_torch(x):
        return (_front or _pytorch()).softmax(x, axis, out, config, log=False)
    return _softmax.softmax(x, axis, out=out, config=config)


def log_softmax(x, axis=-1, *, out=None, config=None):
    if _is_torch(x):
        return (_front or _pytorch()).softmax(x, axis, out, config, log=True)
    return _softmax.log_softmax(x, axis, out=out, config=config)


def softmax_backward(dy, y, axis=-1, *, out=None, config=None):
    if _is_torch(dy):
        return (_front or _pytorch()).softmax_backward(dy, y, axis, out, config, log=False)
    return _softmax_backward.softmax_backward(dy, y, axis, out=out, config=config)


def log_softmax_backward(dy, y, axis=-1, *, out=None, config=None):
    if _is_torch(dy):
        return (_front or _pytorch()).softmax_backward(dy, y, axis, out, config, log=True)
    return _softmax_backward.log_softmax_backward(dy, y, axis, out=out, config=config)


def gemm_softmax(a, b, *, scale=1.0, out=None, config=None):
    if _is_torch(a):
        return (_front or _pytorch()).gemm_softmax(a, b, scale, out, config)
    return _gemm_softmax.gemm_softmax(a, b, scale=scale, out=out, config=config)


def flash_attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                    alibi_slopes=None, score_mod=None, score_mod_grad=None, mask_mod=None,
                    mod_args=(), block_mask=None, return_lse=False, out=None, layout="bhsd",
                    config=None, descale_q=None, descale_k=None, descale_v=None):
    if _gemm_fp8.is_fp8(q):
        if alibi_slopes is not None or score_mod is not None or mask_mod is not None or \
                score_mod_grad is not None or block_mask is not None or (
                    mod_args is not None and (type(mod_args) not in (tuple, list)
                                              or len(mod_args))):
            raise NotImplementedError("flash_attention on float8 inputs: alibi_slopes, "
                                      "score_mod, mask_mod, mod_args and block_mask are not "
                                      "built yet")
        if _is_torch(q):
            return (_front or _pytorch()).flash_attention_fp8(
                q, k, v, causal, scale, window, softcap, (descale_q, descale_k, descale_v),
                return_lse, out, layout, config)
        return _attention_fp8.flash_attention_fp8(
            q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
            descale_q=descale_q, descale_k=descale_k, descale_v=descale_v,
            return_lse=return_lse, out=out, layout=layout, config=config)
    if descale_q is not None or descale_k is not None or descale_v is not None:
        raise TypeError("flash_attention: descale_q / descale_k / descale_v are for float8 "
                        "inputs (float8_e4m3fn q, k and v)")
    if _is_torch(q):
        if score_mod is not None or mask_mod is not None or score_mod_grad is not None \
                or block_mask is not None or (mod_args is not None and (
                    type(mod_args) not in (tuple, list) or len(mod_args))):
            return (_front or _pytorch()).flash_attention_mods(
                q, k, v, causal, scale, window, softcap,
                (score_mod, score_mod_grad, mask_mod, alibi_slopes, mod_args, block_mask),
                return_lse, out, layout, config)
        return (_front or _pytorch()).flash_attention(q, k, v, causal, scale, window, softcap,
                                                      return_lse, out, layout, config,
                                                      alibi_slopes)
    return _attention.flash_attention(q, k, v, causal=causal, scale=scale, window=window,
                                      softcap=softcap, alibi_slopes=alibi_slopes,
                                      score_mod=score_mod, score_mod_grad=score_mod_grad,
                                      mask_mod=mask_mod, mod_args=mod_args,
                                      block_mask=block_mask, return_lse=return_lse, out=out,
                                      layout=layout, config=config)


def flash_attention_backward(dout, q, k, v, out, lse, *, causal=False, scale=None,
                             window=None, softcap=0.0, alibi_slopes=None, score_mod=None,
                             score_mod_grad=None, mask_mod=None, mod_args=(), block_mask=None,
                             layout="bhsd", deterministic=False, dq=None, dk=None, dv=None,
                             config=None):
    mods = dict(score_mod=score_mod, score_mod_grad=score_mod_grad, mask_mod=mask_mod,
                alibi_slopes=alibi_slopes, mod_args=mod_args, block_mask=block_mask)
    if _is_torch(q):
        if any(mods[n] is not None
               for n in ("score_mod", "score_mod_grad", "mask_mod", "block_mask")) \
                or (mod_args is not None and (type(mod_args) not in (tuple, list)
                                              or len(mod_args))):
            return (_front or _pytorch()).flash_attention_backward_mods(
                dout, q, k, v, out, lse, causal=causal, scale=scale, window=window,
                softcap=softcap, layout=layout, deterministic=deterministic, dq=dq, dk=dk,
                dv=dv, config=config, **mods)
        return (_front or _pytorch()).flash_attention_backward(
            dout, q, k, v, out, lse, causal, scale, window, softcap, layout, deterministic,
            dq, dk, dv, config, alibi_slopes)
    return _attention_backward.flash_attention_backward(
        dout, q, k, v, out, lse, causal=causal, scale=scale, window=window, softcap=softcap,
        layout=layout, deterministic=deterministic, dq=dq, dk=dk, dv=dv, config=config, **mods)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=False, scale=None, window=None, softcap=0.0,
                           alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(),
                           return_lse=False, out=None, check_seqlens=True, config=None):
    if _is_torch(q):
        return (_front or _pytorch()).flash_attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
            window, softcap, alibi_slopes, (score_mod, mask_mod, mod_args), return_lse, out,
            check_seqlens, config)
    return _attention_varlen.flash_attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args, return_lse=return_lse,
        out=out, check_seqlens=check_seqlens, config=config)


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None,
                                 block_table=None, causal=True, scale=None, window=None,
                                 softcap=0.0, num_splits=None, return_lse=False, out=None,
                                 check_seqlens=True, config=None):
    if _is_torch(q):
        return (_front or _pytorch()).flash_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, scale, window,
            softcap, num_splits, return_lse, out, check_seqlens, config)
    return _attention_kvcache.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table, causal=causal,
        scale=scale, window=window, softcap=softcap, num_splits=num_splits,
        return_lse=return_lse, out=out, check_seqlens=check_seqlens, config=config)


for _api, _op in ((gemm, _gemm.gemm), (grouped_gemm, _grouped_gemm.grouped_gemm),
                  (quantize_fp8, _quantize.quantize_fp8),
                  (softmax, _softmax.softmax),
                  (log_softmax, _softmax.log_softmax),
                  (softmax_backward, _softmax_backward.softmax_backward),
                  (log_softmax_backward, _softmax_backward.log_softmax_backward),
                  (gemm_softmax, _gemm_softmax.gemm_softmax),
                  (flash_attention, _attention.flash_attention),
                  (flash_attention_varlen, _attention_varlen.flash_attention_varlen),
                  (flash_attention_with_kvcache, _attention_kvcache.flash_attention_with_kvcache),
                  (flash_attention_backward, _attention_backward.flash_attention_backward)):
    _api.__doc__ = _op.__doc__
del _api, _op

__all__ = ["BlockMask", "create_block_mask", "flash_attention", "flash_attention_backward",
           "flash_attention_varlen",
           "flash_attention_with_kvcache", "gemm", "gemm_softmax", "grouped_gemm",
           "log_softmax", "log_softmax_backward", "quantize_fp8", "softmax",
           "softmax_backward"]


def create_block_mask(mask_mod, batch, heads, seq_q, seq_k, *, like=None, mod_args=(),
                      block_size=_attention_block_mask.BLOCK_SIZE, partial_bits=None):
    return _attention_block_mask.create_block_mask(mask_mod, batch, heads, seq_q, seq_k,
                                                   like=like, mod_args=mod_args,
                                                   block_size=block_size,
                                                   partial_bits=partial_bits)


create_block_mask.__doc__ = _attention_block_mask.create_block_mask.__doc__
BlockMask = _attention_block_mask.BlockMask
