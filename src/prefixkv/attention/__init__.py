"""The attention layer: how a forward reads the K/V its rows hold in the pool.

The seam (``reads.AttentionBackend``: ``plan`` once per forward, ``attend`` per layer), the ``"blocks"`` backend's
read planner (``reads``), the kernels, the registration with transformers' ``AttentionInterface`` and the
``"blocks"`` and ``"gather"`` backends with their registry (``backends``), and the ``"flex"`` backend (``flex``).
It imports nothing of the block layer, the transformers glue or the store (docs/how-it-works.md, "The house").
"""
