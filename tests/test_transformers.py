"""tilepy as a Hugging Face transformers attention implementation, in the simulator: a small
random-weight Llama with grouped-query attention, its logits against SDPA's, a
``torch.compile``d forward, and the SDPA fallback (with one warning) for a padding mask. The
GPU version runs at a larger size (tests/test_torch_gpu.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tilepy.integrations.transformers as tilepy_transformers
import tilepy.ops.attention as attention_op

pytestmark = pytest.mark.sim


def small_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, initializer_range=0.3)
    return LlamaForCausalLM(cfg).to(torch.float16).eval()


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    assert not torch.isnan(got).any()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_llama_logits_match_sdpa_eager_and_compiled(monkeypatch):
    name = tilepy_transformers.register()
    model = small_llama()
    ids = torch.randint(0, 64, (2, 13))
    calls = []
    real = attention_op.flash_attention
    monkeypatch.setattr(attention_op, "flash_attention",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids, use_cache=False).logits
        model.set_attn_implementation(name)
        got = model(ids, use_cache=False).logits
        assert calls == [(2, 4, 13, 32)] * 2   # both layers, K/V not repeated (GQA 4/2)
        assert rel_err(got, ref) < 2e-2
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        assert rel_err(compiled(ids, use_cache=False).logits, ref) < 2e-2


def test_padding_mask_falls_back_to_sdpa_with_one_warning():
    name = tilepy_transformers.register()
    model = small_llama()
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    tilepy_transformers._WARNED.clear()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation(name)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = model(ids, attention_mask=mask, use_cache=False).logits
    messages = [str(w.message) for w in seen if "tilepy attention" in str(w.message)]
    assert len(messages) == 1 and "padding" in messages[0]
    assert rel_err(got[1], ref[1]) < 2e-2 and rel_err(got[0, 3:], ref[0, 3:]) < 2e-2


def test_static_cache_prefill_and_decoding_match_sdpa(monkeypatch):
    """A StaticCache's keys hold unwritten slots past the sequence: the calls with cached keys
    run flash_attention_with_kvcache over the first position_ids[:, -1] + 1 of them (the
    plain kernel over every slot gave logits 1.4x off). Prefill of 5 tokens and 3 decoding
    steps, logits against SDPA's with the same cache."""
    from transformers import StaticCache

    import tilepy.ops.attention_kvcache as kvcache_op

    name = tilepy_transformers.register()
    model = small_llama()
    ids = torch.randint(0, 64, (2, 5))
    calls = []
    real = kvcache_op.flash_attention_with_kvcache
    monkeypatch.setattr(kvcache_op, "flash_attention_with_kvcache",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))

    def generate(impl):
        model.set_attn_implementation(impl)
        cache = StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            out = model(ids, past_key_values=cache, use_cache=True)
            logits, tok = [out.logits], out.logits[:, -1:].argmax(-1)
            for step in range(3):
                out = model(tok, past_key_values=cache, use_cache=True,
                            position_ids=torch.tensor([[5 + step]]))
                logits.append(out.logits)
                tok = out.logits[:, -1:].argmax(-1)
        return torch.cat(logits, 1)

    ref = generate("sdpa")
    got = generate(name)
    assert calls == [(2, 5, 4, 32)] * 2 + [(2, 1, 4, 32)] * 6
    assert rel_err(got, ref) < 2e-2


def test_cached_keys_without_2d_positions_or_with_a_gradient_run_sdpa():
    """Keys longer than the queries (a cache) with no usable position_ids, or with inputs that
    require grad, fall back to SDPA with a warning instead of reading unwritten slots or
    failing."""
    module = small_llama().model.layers[0].self_attn
    q, k, v = (torch.randn(1, h, s, 32, dtype=torch.float16) for h, s in
               ((4, 1), (2, 6), (2, 6)))
    tilepy_transformers._WARNED.clear()
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tilepy_transformers.attention_forward(module, q, k, v, None, scaling=0.2)
    assert any("2-D position_ids" in str(w.message) for w in seen)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tilepy_transformers.attention_forward(module, q.requires_grad_(), k, v, None,
                                              scaling=0.2, position_ids=torch.tensor([[5]]))
    assert any("gradient through keys from a cache" in str(w.message) for w in seen)
