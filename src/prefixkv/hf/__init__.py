"""The transformers glue: the ``Cache`` that ``generate`` calls, and the hooks that tell it about each forward.

The proof of what may be published (``proof``), the rows a cache holds (``rows``), the first step of a
``generate`` call (``call``), the cache itself (``cache``), the model hooks (``hooks``), the model runner that
prefills for the store (``runner``), the store's parts as its hooks and caches see them (``parts``) and the checks
of what a model must be (``support``). It sits on the block and attention layers and never imports the store
(docs/how-it-works.md, "The house").
"""
