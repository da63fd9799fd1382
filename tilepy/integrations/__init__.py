"""tilepy inside other frameworks.

* :mod:`tilepy.integrations.pytorch` — the ``torch.ops.tilepy.*`` operators (fake
  implementations, autograd), loaded by :mod:`tilepy.api` the first time a PyTorch tensor
  arrives; importing it yourself registers them ahead of time.
* :mod:`tilepy.integrations.transformers` — ``register()`` makes ``"tilepy"`` an attention
  implementation of Hugging Face transformers.
"""
