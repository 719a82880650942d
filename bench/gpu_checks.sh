#!/usr/bin/env bash
# Every GPU check of the project in one run (~5 minutes on one H200, 8 at most), for a GPU machine:
#
#   bench/gpu_checks.sh [OUT_DIR]        # logs and JSON lines under OUT_DIR (default gpu-out)
#
# 1. bench/gpu_reform_check.py: NCCL re-init, gloo-on-CUDA peer loss, NCCL abort;
# 2. bench/gpu_copy_check.py: what a copy of the state costs a CUDA loop (pinned, side stream);
# 3. bench/overhead.py --device cuda: the session against plain DDP and plain FSDP2 in the
#    same processes, a host-bound small MLP and a GPU-bound wide one. Launched with torch's
#    own launcher (a GPU machine's torch may be older than the agent accepts; the session
#    runs its restart-path mode there: the same step boundary and vote).
# A step that fails or times out is reported and the next one runs; the exit status is 1
# if any failed.
set -u
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
failed=0

step() {  # step NAME SECONDS COMMAND...: run it, log to $out/NAME.txt, note its status
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.txt"
    echo "=== $name: exit $rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed=1
}

step env 30 bash -c "nvidia-smi -L; git rev-parse HEAD 2>/dev/null; $py -c \
'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), \
torch.cuda.device_count(), torch.cuda.get_device_name(0))'"
step reform 110 "$py" bench/gpu_reform_check.py
step copy 110 "$py" bench/gpu_copy_check.py --steps 10
step overhead_small 110 "$py" bench/overhead.py --device cuda --launcher torchrun \
    --models ddp,fsdp --ab-only --ab-steps 200 --warmup 20 --limit 50
step overhead_wide 120 "$py" bench/overhead.py --device cuda --launcher torchrun \
    --models ddp,fsdp --ab-only --ab-steps 60 --warmup 10 --width 8192 --global-batch 2048 \
    --limit 50
grep -h '^{"bench"' "$out"/*.txt >"$out/results.jsonl" 2>/dev/null
echo "=== done: failed=$failed"
exit "$failed"
