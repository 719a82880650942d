#!/usr/bin/env bash
# The project's one test command (README and CI call it):
#   scripts/test.sh [pytest args...]        e.g. scripts/test.sh -m "not slow"
# 1. creates .venv if missing; installs torch==2.13.0 first (a pinned CPU build is
#    available locally; a bare requirement could download GBs), then -e '.[dev,plot]';
# 2. as root: installs Slurm + munge (Debian) and starts the local cluster with
#    scripts/slurm-cluster (netns mode if 'ip netns' works, else loopback;
#    SLURM_ELASTIC_CLUSTER_MODE=loopback|netns chooses; SLURM_ELASTIC_CLUSTER=0 skips);
# 3. runs pytest with the given arguments (without any, and with a cluster: the Slurm
#    tests in a second pytest beside the others, see "lanes"), stops the cluster it
#    started (unless KEEP_CLUSTER=1) and exits with pytest's status.
# With CI=true a cluster that fails to start is a failure (rc 3); elsewhere the Slurm
# tests are then skipped with the reason.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
VENV=$ROOT/.venv
PY=$VENV/bin/python
CLUSTER_DIR=${SLURM_ELASTIC_CLUSTER_DIR:-/var/tmp/slurm-elastic-cluster}
export SLURM_ELASTIC_CLUSTER_DIR=$CLUSTER_DIR
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

say() { printf 'test.sh: %s\n' "$*" >&2; }
is_ci() { [[ ${CI:-} == true || ${CI:-} == 1 ]]; }

# ---------------------------------------------------------------- venv
# shellcheck source=scripts/setup-venv.sh
source "$ROOT/scripts/setup-venv.sh"

# ---------------------------------------------------------------- cluster
started_cluster=0
stop_cluster() {
    if [[ $started_cluster -eq 1 && ${KEEP_CLUSTER:-0} != 1 ]]; then
        say "stopping the local Slurm cluster (KEEP_CLUSTER=1 keeps it)"
        "$ROOT/scripts/slurm-cluster" down || true
    fi
}
trap stop_cluster EXIT

cluster_failed() {
    if is_ci; then
        say "error: the local Slurm cluster did not start (CI=true makes that a failure)"
        exit 3
    fi
    say "warning: no local Slurm cluster; the Slurm tests will be skipped"
}

netns_works() { command -v ip >/dev/null && ip netns list >/dev/null 2>&1; }

if [[ ${SLURM_ELASTIC_CLUSTER:-1} != 0 ]]; then
    if "$ROOT/scripts/slurm-cluster" status >/dev/null 2>&1; then
        running=$(sed -n 's/^mode=//p' "$CLUSTER_DIR/state" 2>/dev/null || true)
        say "using the running local Slurm cluster ($CLUSTER_DIR, mode=${running:-unknown})"
        if [[ $running != netns && ${SLURM_ELASTIC_CLUSTER_MODE:-} != loopback ]] && netns_works; then
            say "warning: it runs in ${running:-an unknown} mode: the netns tests will be skipped" \
                "('scripts/slurm-cluster down' first runs them in a netns cluster)"
        fi
    elif [[ $(id -u) -eq 0 ]]; then
        mode=${SLURM_ELASTIC_CLUSTER_MODE:-auto} # auto: netns where it works (slurm-cluster)
        say "starting the local Slurm cluster (mode=$mode)"
        if "$ROOT/scripts/slurm-cluster" up --mode "$mode"; then
            started_cluster=1
        else
            started_cluster=1 # partial start: clean up on exit
            cluster_failed
        fi
    else
        cluster_failed
    fi
    if [[ -f $CLUSTER_DIR/env ]]; then
        # shellcheck disable=SC1091
        source "$CLUSTER_DIR/env"
    fi
fi

# ---------------------------------------------------------------- etcd
# torch's etcd-v2 rendezvous backend is tested against Debian's etcd (v2 API enabled).
if [[ $(id -u) -eq 0 ]] && ! command -v etcd >/dev/null; then
    say "installing etcd-server (Debian)"
    SLURM_ELASTIC_CLUSTER_EXTRA_PACKAGES=etcd-server "$ROOT/scripts/slurm-cluster" install ||
        say "warning: etcd-server not installed; the etcd-v2 test will fail in CI"
fi

# ---------------------------------------------------------------- tests
# Read, then removed from the environment: the agents the tests start refuse an unknown
# SLURM_ELASTIC_* variable (a typo in a config key must not pass silently).
second=${SLURM_ELASTIC_SECOND_TORCH:-}
unset SLURM_ELASTIC_SECOND_TORCH

# ---------------------------------------------------------------- the other torch
# The supported range is torch 2.13 and 2.14 (pyproject.toml, README, the runtime check).
# The whole suite runs on 2.13.0 first; the torch-facing layers (rendezvous with the
# torchrun plug-in, agent, live with in-place joins/leaves on local agents, checkpoint:
# their fast tests and one of each slow kind) then run again on 2.14.1 in .venv-torch2.14
# (a CUDA build that runs on the CPU: ~4 min and 5.5 GB to install once; the download
# and install run in the background during the first suite, at the lowest CPU and I/O
# priority, so the tests keep the machine). It runs when no pytest arguments were given
# (the CI path); SLURM_ELASTIC_SECOND_TORCH=0 skips it, =1 runs it whatever the arguments.
if [[ -z $second ]]; then
    if [[ $# -eq 0 ]]; then second=1; else second=0; fi
fi
VENV2=$ROOT/.venv-torch2.14
PY2=$VENV2/bin/python
torch2_pid=
if [[ $second == 1 ]]; then
    [[ -x $PY2 ]] || python3 -m venv "$VENV2"
    if ! "$PY2" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.14.1") else 1)' 2>/dev/null; then
        say "installing torch==2.14.1 into $VENV2 in the background (the second supported torch)"
        low=(nice -n 19)
        command -v ionice >/dev/null && low+=(ionice -c 3)
        "${low[@]}" "$PY2" -m pip install -q torch==2.14.1 >"$VENV2/pip-torch.log" 2>&1 &
        torch2_pid=$!
        # an interrupted run does not leave the install running behind it
        trap 'kill "$torch2_pid" 2>/dev/null || true; stop_cluster' EXIT
    fi
fi

# ---------------------------------------------------------------- lanes
# Without pytest arguments and with a cluster (the CI path): two lanes at once. The tests
# on the real Slurm (marker `slurm`) spend most of their time on Slurm's timers (time
# limits checked every 30 s, the requeue hold, GraceTime: about one core busy of two);
# the local multi-process tests keep both cores busy. The Slurm lane runs in the
# background (its output is printed after the local lane's). Measured 2026-12-07 on 2
# cores: 29:12-39:44 for the suite (four clean runs) against 50:55-55:58 for one pytest;
# the load (4-7) it brings found two tests whose timing bounds were too tight (since made
# robust). SLURM_ELASTIC_TEST_LANES=0 runs one pytest.
lanes=${SLURM_ELASTIC_TEST_LANES:-1}
unset SLURM_ELASTIC_TEST_LANES
if [[ $lanes != 0 && $lanes != 1 ]]; then
    say "error: SLURM_ELASTIC_TEST_LANES=$lanes: use 1 (two lanes, the default) or 0 (one pytest)"
    exit 2
fi
if [[ $lanes == 1 && ( $# -ne 0 || -z ${SLURM_CONF:-} ) ]]; then
    lanes=0 # pytest arguments or no cluster: one pytest
fi

rc=0
if [[ $lanes == 1 ]]; then
    lane_log=$(mktemp "${TMPDIR:-/tmp}/slurm-elastic-slurm-lane.XXXXXX")
    say "two lanes: the Slurm tests in the background (output: $lane_log, printed at the end)"
    PATH=$VENV/bin:$PATH "$PY" -m pytest -p no:cacheprovider --durations=25 -m slurm \
        >"$lane_log" 2>&1 &
    lane_pid=$!
    # an interrupted run does not leave the Slurm lane running behind it
    trap 'kill "$lane_pid" ${torch2_pid:+"$torch2_pid"} 2>/dev/null || true; stop_cluster' EXIT
    PATH=$VENV/bin:$PATH "$PY" -m pytest --durations=40 -m "not slurm" || rc=$?
    lane_rc=0
    wait "$lane_pid" || lane_rc=$?
    say "the Slurm lane (exit $lane_rc):"
    cat "$lane_log"
    rm -f "$lane_log"
    [[ $lane_rc -eq 0 ]] || rc=$lane_rc
else
    PATH=$VENV/bin:$PATH "$PY" -m pytest --durations=40 "$@" || rc=$?
fi

if [[ $second == 1 ]]; then
    if [[ -n $torch2_pid ]]; then
        say "waiting for the torch==2.14.1 install"
        wait "$torch2_pid" || {
            cat "$VENV2/pip-torch.log" >&2
            say "error: installing torch==2.14.1 failed"
            exit 1
        }
    fi
    stamp2=$VENV2/.slurm-elastic-pyproject.sha256
    want2=$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)
    if [[ $(cat "$stamp2" 2>/dev/null) != "$want2" ]] || ! "$PY2" -c 'import slurm_elastic, pytest_timeout, etcd' 2>/dev/null; then
        "$PY2" -m pip install -q -e "$ROOT[dev]" >"$VENV2/pip-install.log" 2>&1 || {
            cat "$VENV2/pip-install.log" >&2
            exit 1
        }
        echo "$want2" >"$stamp2"
    fi
    say "the torch-facing layers on torch $("$PY2" -c 'import torch; print(torch.__version__)')"
    # Fast tests of those layers, plus one of each slow kind that starts real agents:
    # the torchrun plug-in, an in-place join and a hard loss in place (own loop; the
    # graceful leave's switch is the join's, and its notice path is torch-free).
    # The other slow ones (the fault variants) ran above on 2.13.
    # Left out: tests of our own file handling under damage and hostile input (checkpoint
    # files, private and node directories; the torch calls they reach, tensors to and
    # from checkpoint files and an agent's start, are the format, manager and agent
    # tests'), three of the four refused exchanges (the same torch calls as the one kept),
    # and the partition in network namespaces (its torch calls are every process test's).
    PATH=$VENV2/bin:$PATH "$PY2" -m pytest --durations=15 -m "not slurm and not slow" \
        -k "not (refused_before_anything_is_replaced and (float64 or qint8_header or huge))" \
        --ignore=tests/checkpoint/test_hostile.py --ignore=tests/checkpoint/test_faults.py \
        --ignore=tests/agent/test_private_dirs.py --ignore=tests/agent/test_node_dirs.py \
        --ignore=tests/rendezvous/test_partition.py \
        tests/rendezvous tests/agent tests/live tests/checkpoint tests/training || rc=$?
    PATH=$VENV2/bin:$PATH "$PY2" -m pytest --durations=10 \
        tests/rendezvous/test_torchrun.py \
        tests/live/test_in_place.py::test_join_in_place_keeps_workers_and_loses_no_step \
        tests/live/test_own_loop.py::test_own_loop_hard_loss_in_place || rc=$?
fi
exit "$rc"
