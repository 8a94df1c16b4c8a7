"""The block layer: K/V blocks as ints and tensors, and the files they are kept in.

Block ids, refcounts and the radix tree of cached prefixes (``allocator``, ``trie``) and the order it evicts in
(``eviction``); the tensors that hold the blocks (``pool``, ``quantization``); the offload tier and the saved
files (``tier``, ``persist``, ``prefix_file``, ``fingerprint``); the namespaces that key them besides the tokens
(``namespace``); and the block manager that holds them together under one lock (``blocks``), with its room and pins
(``room``) and its books: counters, snapshots, the recount of holders (``ledger``).
Nothing here imports the attention, the transformers glue or the store (docs/how-it-works.md, "The house").
"""
