"""Slurm facts and the one command seam; nothing here knows the config or torch.

Modules: :mod:`.env` (``SlurmEnv``: the ``SLURM_*`` environment as a value object),
:mod:`.hostlist` (hostlist expansion), :mod:`.jobstate` (Slurm's job states, one enum),
:mod:`.parse` (pure parsers of recorded command output), :mod:`.site` (the installed
version, ``scontrol show config``/``partition``), :mod:`.window` (the preemption window:
does a checkpoint save fit the notice a task gets; pure), :mod:`.control` (the
``SlurmControl`` Protocol: submit, query, requeue, cancel) and :mod:`.commands`
(``SlurmClient``, its implementation behind one subprocess seam).

The sbatch templates are rendered by :mod:`slurm_elastic.submit.render` (rendering a job
script is part of submitting it, and it validates values with the config).
"""
