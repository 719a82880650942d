# Sourced by scripts/test.sh and scripts/demo.sh (expects ROOT): make $ROOT/.venv hold
# torch 2.13.0 (installed FIRST: a CPU build of it lies on these machines, while a bare
# torch requirement would download a multi-GB CUDA build) and this package with its
# dev/plot extras. Sets VENV and PY.
VENV=$ROOT/.venv
PY=$VENV/bin/python
if [[ ! -x $PY ]]; then
    printf 'setup: creating %s\n' "$VENV" >&2
    python3 -m venv "$VENV"
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
    printf 'setup: installing torch==2.13.0\n' >&2
    "$PY" -m pip install -q torch==2.13.0
fi
# Reinstall when pyproject.toml changed since the last install (new dependencies).
stamp=$VENV/.slurm-elastic-pyproject.sha256
want=$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)
if [[ $(cat "$stamp" 2>/dev/null) != "$want" ]] ||
    ! "$PY" -c 'import slurm_elastic, pytest, pytest_timeout, submitit, matplotlib, etcd' 2>/dev/null; then
    printf 'setup: installing the package and its dev/plot extras\n' >&2
    if ! "$PY" -m pip install -q -e "$ROOT[dev,plot]" >"$VENV/pip-install.log" 2>&1; then
        cat "$VENV/pip-install.log" >&2
        exit 1
    fi
    echo "$want" >"$stamp"
fi
