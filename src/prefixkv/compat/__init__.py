"""The release shims: the two modules that know transformers' and torch's releases (``releases``, and
``generation`` for a generate call's first step), and ``patching``, the record of every change prefixkv makes to
an object of theirs."""
