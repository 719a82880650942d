"""The ``slurm-elastic`` command line; the only place that configures logging.

Contract: :func:`slurm_elastic.cli.main.main` takes ``argv`` and returns an exit status;
errors of the :class:`~slurm_elastic.errors.SlurmElasticError` tree print one line and
exit 2, agent runs exit with an :class:`~slurm_elastic.agent.ExitCode`.
"""
