"""The attention layer: how a forward reads the K/V its rows hold in the pool.

In reading order: the seam (``reads``: ``AttentionBackend``, ``plan`` once per forward, ``attend`` per layer, and the
per-forward ``ForwardReads``, which a backend subclasses for what only it keeps), compiled decode steps (``static``),
the kernels and log-sum-exp primitives (``kernels``), the registration with transformers' ``AttentionInterface``
(``interface``), one module per backend (``blocks`` with its read planner ``planner``, ``gather``, and ``flex`` with
its kernel ``flex_kernel``), the backends by name (``registry``) and the per-cache ``Reader`` (``reader``). It
imports nothing of the block layer, the transformers glue or the store (docs/how-it-works.md, "The house").
"""
