#!/usr/bin/env bash
# The project's demo (README's first command):  scripts/demo.sh
# Sets up .venv (like scripts/test.sh), starts the local Slurm cluster when run as root
# (scripts/slurm-cluster; stopped again at the end unless KEEP_CLUSTER=1), then runs
# scripts/demo.py: an elastic array job of examples/train_ddp.py on 1..4 nodes, one node
# preempted mid-run and requeued, the world shrinking and growing back, the run finishing.
# Without root (no cluster) the same training runs as local node agents instead. Both end
# with `slurm-elastic status` of the run and the path of its timeline PNG. A cluster that
# was already running (e.g. the test suite's) is used and never stopped here.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# shellcheck source=scripts/setup-venv.sh
source "$ROOT/scripts/setup-venv.sh"

CLUSTER_DIR=${SLURM_ELASTIC_CLUSTER_DIR:-/var/tmp/slurm-elastic-cluster}
started=0
cleanup() {
    if [[ $started -eq 1 && ${KEEP_CLUSTER:-0} != 1 ]]; then
        "$ROOT/scripts/slurm-cluster" down >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT
cluster=local
if "$ROOT/scripts/slurm-cluster" status >/dev/null 2>&1; then
    cluster=slurm
elif [[ $(id -u) -eq 0 ]]; then
    echo "demo: starting the local Slurm cluster (4 nodes)..." >&2
    started=1
    "$ROOT/scripts/slurm-cluster" up >&2 && cluster=slurm
fi
if [[ $cluster == slurm ]]; then
    # shellcheck disable=SC1091
    source "$CLUSTER_DIR/env"
fi
exec "$PY" "$ROOT/scripts/demo.py" --cluster "$cluster" "$@"
