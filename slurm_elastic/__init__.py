"""slurm_elastic: elastic, preemption-tolerant PyTorch training on Slurm.

One agent per node (torch's elastic agent) meets its peers through a rendezvous on the
shared filesystem, starts the node's workers, and survives preemption, requeue and node
loss; checkpoints on the parallel filesystem make every resume exact, whatever the new
world size.

Importing this package is cheap and silent: it imports neither torch nor submitit and
configures no logging (only :mod:`slurm_elastic.cli` does).
"""

from slurm_elastic.errors import SlurmElasticError

__all__ = ["SlurmElasticError", "__version__"]

__version__ = "0.1.0"
