"""The tools: the command line (``python -m prefixkv``), the demo and the family census."""
