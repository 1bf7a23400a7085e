"""Starting the processes of a run, checking what can be checked first, and ending them with one line.

=============  ==========================================================================================
``spawn``      the stage processes started when no launcher did (torchrun's launcher); SLURM's variables
``preflight``  every check that needs no process group, before the processes start
``failures``   one ``error:`` line per run, whichever process meets the error, and its exit code
=============  ==========================================================================================
"""
