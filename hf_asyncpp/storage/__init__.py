"""The disk: every file a run writes goes through here.

=================  ======================================================================================
``write``          the one write path (hashing as it writes) and errors that say what happened; the output folder
``names``          every file name of a run folder and of a checkpoint, spelled once
``checkpoint_io``  atomic, verified checkpoints: tensors and state in and out, the manifest, commit, verify
``staging``        an asynchronous save's two halves: the one copy of the state (torch's stager), the writer thread
``shipped``        files shipped with the package (model card templates, accelerate configs)
=================  ======================================================================================
"""
