"""Planning: what a recipe will cost before anything runs. Nothing here trains; the runtime (``pipeline/``) never
imports it.

=============  ==========================================================================================
``costs``      per-layer and per-stage forward, backward and optimizer-step times measured on a device
``memory``     will it fit: per-stage memory of a recipe, term by term, without allocating it
``search``     how fast: the schedules compared on the same costs, and the search over layouts for a GPU count
``autosplit``  ``layers_per_stage: auto``: the split from costs measured at start, cached
``profile``    a run's measured per-stage times and the timeline they imply
``vocab``      ``pipeline.vocab_parallel``: whether the vocabulary layers are shared by every stage (``auto``'s decision)
=============  ==========================================================================================
"""
