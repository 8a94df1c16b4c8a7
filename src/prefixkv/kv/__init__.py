"""The block layer: K/V blocks as ints and tensors, and the files they are kept in.

Block ids, refcounts and the radix tree of cached prefixes (``allocator``, ``nodes``, ``trie``) and the order it
evicts in (``eviction``); the tensors that hold the blocks (``pool``, ``quantization``); the saved file's format
(``prefix_file``) and what model wrote it (``fingerprint``); the key spaces that key K/V besides the tokens
(``key_space``); the offload tier (``tier``); and the block manager that holds them together under one lock
(``manager``), over its holdings (``holdings``), with its room and pins (``room``), the export and merge of saved
prefixes (``persist``) and its books: counters, snapshots, the recount of holders (``ledger``).
Nothing here imports the attention, the transformers glue or the store (docs/how-it-works.md, "The house").
"""
