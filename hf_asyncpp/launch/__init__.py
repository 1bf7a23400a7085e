"""Starting the processes of a run and ending them with one line.

=============  ==========================================================================================
``spawn``      the stage processes started when no launcher did (torchrun's launcher); SLURM's variables; the
               topology check
``failures``   one ``error:`` line per run, whichever process meets the error, and its exit code
=============  ==========================================================================================
"""
