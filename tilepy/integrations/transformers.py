"""tilepy attention inside Hugging Face transformers.

``register()`` adds ``"tilepy"`` to transformers' ``AttentionInterface`` (and a mask function
of the same name to ``AttentionMaskInterface``); then::

    import tilepy.integrations.transformers as tt
    tt.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tilepy")
    # or model.set_attn_implementation("tilepy")

Every attention call that tilepy can express runs ``tilepy.flash_attention``: causal (the
decoder's self-attention, prefill and decoding: tilepy's causal mask is aligned to the
bottom-right corner, as decoding with a KV cache needs) or not (``module.is_causal`` False),
or, when the keys come from a cache (more keys than queries) and the model passes
2-D ``position_ids``, ``tilepy.flash_attention_with_kvcache`` over the first
``position_ids[:, -1] + 1`` keys — a ``StaticCache`` holds unwritten slots past them, which no
call may read — with those lengths computed on the device (a CUDA graph of a decoding step
replays for every position); cached keys without such positions, or with a gradient, run
SDPA;
float16 / bfloat16, a head dim tilepy takes, grouped-query attention with K/V read once per
key head (never repeated), and no mask beyond causality. The masks are built as for
FlashAttention-2: none at all when there is no padding (so none under ``torch.compile``
either, where the SDPA masks would always be materialised).

Anything else — a padding mask, sliding windows, softcapping, attention sinks, dropout,
float32, an unsupported head dim, ``output_attentions`` — runs transformers' SDPA
implementation instead, with one warning per reason and process (none while compiling).
"""

from __future__ import annotations

import warnings

import torch

import tilepy

from ..ops.attention_mma_sync import HEAD_DIMS

NAME = "tilepy"
_WARNED: set = set()


def register(name: str = NAME) -> str:
    """Register tilepy's attention (and its mask function) with transformers under
    ``name``; returns the name to pass as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _unsupported(query, key, value, attention_mask, dropout, kwargs) -> str | None:
    """Why tilepy cannot run this call (None: it can)."""
    if attention_mask is not None:
        return "an attention mask beyond causality (padding)"
    if dropout:
        return "attention dropout"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {query.dtype}"
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]) or \
            query.shape[-1] not in HEAD_DIMS:
        return f"head_dim {query.shape[-1]} (value {value.shape[-1]})"
    for arg in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(arg) is not None:
            return f"{arg}"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    return None


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention-function contract: ``query`` (batch, heads, seq_q, head_dim),
    ``key`` / ``value`` (batch, heads_kv, seq_k, head_dim); returns ``(output (batch, seq_q,
    heads, head_dim), None)``."""
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    reason = _unsupported(query, key, value, attention_mask, dropout, kwargs)
    if reason is None and key.shape[2] != query.shape[2]:
        # keys from a cache: a static cache holds unwritten slots past the sequence, so the
        # keys seen are the first (last position + 1), read on the device
        reason = _cache_unsupported(query, key, value, kwargs.get("position_ids"))
    if reason is None and key.shape[2] != query.shape[2]:
        seqlens = _cache_seqlens(kwargs["position_ids"], query.shape[0])
        out = tilepy.flash_attention_with_kvcache(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), seqlens,
            causal=causal, scale=scaling, check_seqlens=False)
        return out, None
    if reason is None:
        out = tilepy.flash_attention(query, key, value, causal=causal, scale=scaling)
        return out.transpose(1, 2), None
    if not torch.compiler.is_compiling() and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"tilepy attention does not take {reason}; this call and others like "
                      "it run transformers' SDPA attention instead", stacklevel=2)
    return _sdpa(module, query, key, value, attention_mask, dropout, scaling, causal, kwargs)


def _cache_unsupported(query, key, value, positions) -> str | None:
    """Why a call whose keys come from a cache cannot run the KV-cache op (None: it can):
    its lengths come from ``position_ids`` (batch or 1, seq_q), and it has no gradient."""
    if positions is None or positions.dim() != 2 or positions.shape[-1] != query.shape[2] \
            or positions.shape[0] not in (1, query.shape[0]):
        return "keys from a cache without 2-D position_ids (batch or 1, seq_q)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return "a gradient through keys from a cache"
    return None


def _cache_seqlens(positions, batch: int):
    """The keys each sequence has in the cache, ``position_ids[:, -1] + 1`` as int32 (batch,),
    computed on the device (no synchronisation: capturable)."""
    return (positions[:, -1] + 1).to(torch.int32).expand(batch).contiguous()


def _sdpa(module, query, key, value, attention_mask, dropout, scaling, causal, kwargs):
    """transformers' SDPA attention, given the 4-D boolean mask it expects: the padding mask
    (batch, seq_k) of the FlashAttention-style mask function combined with the causal one
    (bottom-right aligned, as tilepy's)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.dim() == 2:
        sq, sk = query.shape[2], key.shape[2]
        keep = attention_mask.bool()[:, None, None, :]
        if causal:
            rows = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
            keep = keep & (torch.arange(sk, device=query.device)[None, :] <= rows)
        attention_mask = keep
        causal = False
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=causal, **kwargs)


__all__ = ["NAME", "attention_forward", "register"]
