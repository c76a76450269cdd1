#!/usr/bin/env bash
# End to end on a GPU machine that plays CT 200 (inventory/gpu: local connection, GPUs required,
# the real nvidia-smi), with ansible-playbook on PATH and a CUDA build of torch in python3:
#   1. a process we start holds the memory of GPU $BUSY_GPU (default: the last GPU): launch.yml must
#      refuse, naming that GPU;
#   2. for a threaded RUN, CUDA graphs turned on (compile.mode=reduce-overhead) must be refused on
#      the controller before any GPU work, with the explanation;
#   3. launch.yml -e run=RUN starts the trainer on every GPU (its log shows the compile lines and
#      progress), status.yml reports it and every GPU busy with it, stop.yml leaves a checkpoint;
#   4. launch.yml -e run=RUN -e resume=true resumes from that checkpoint; stop again.
# Usage: scripts/gpu_e2e.sh [RUN] (default nographs). Logs go to $OUT (default /tmp/gpu_e2e).
# Controller state and the workspace go to $STATE (default: a new folder under /tmp per call), so a
# repeat never meets an earlier run's checkpoints (the trainer would rightly refuse to start over).
# SKIP_BUSY=1 leaves out steps 1 and 2 (e.g. for a second run name on the same machine).
# Every process it starts is ended by PID, also on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-nographs}
OUT=${OUT:-/tmp/gpu_e2e}
STATE=${STATE:-$(mktemp -d /tmp/gpu_e2e_state.XXXXXX)}
mkdir -p "$OUT" "$STATE"
export ANSIBLE_CONFIG="$PWD/ansible.cfg" PYTHONUNBUFFERED=1
# The fact cache (the recorded PID) next to the ledger and the workspace, in $STATE.
export ANSIBLE_CACHE_PLUGIN_CONNECTION="$STATE/facts"
INVENTORY=inventory/gpu
busy_pid=""
cleanup() {
    if [ -n "$busy_pid" ] && kill -0 "$busy_pid" 2>/dev/null; then kill "$busy_pid"; fi
    ansible-playbook -i "$INVENTORY" -e "dflash_state_dir=$STATE" playbooks/stop.yml >/dev/null 2>&1 || true
}
trap cleanup EXIT

playbook() {  # playbook NAME LOG [ansible-playbook args...]
    local name=$1 log=$2
    shift 2
    local started=$SECONDS
    local rc=0
    ansible-playbook -i "$INVENTORY" -e "dflash_state_dir=$STATE" "playbooks/$name.yml" "$@" >"$OUT/$log" 2>&1 || rc=$?
    echo "   $name.yml rc=$rc in $((SECONDS - started)) s (log: $log)"
    return $rc
}

GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
BUSY_GPU=${BUSY_GPU:-$((GPUS - 1))}
gpu_memory_used() { nvidia-smi -i "$BUSY_GPU" --query-gpu=memory.used --format=csv,noheader,nounits | tr -d ' '; }
compute_apps() { nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader; }

echo "== GPUs (state in $STATE)"
nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv,noheader

if [ -z "${SKIP_BUSY:-}" ]; then
echo "== 1. another process holds GPU $BUSY_GPU: the preflight must refuse"
BUSY_GPU=$BUSY_GPU python3 -c '
import os, time, torch
device = "cuda:" + os.environ["BUSY_GPU"]
held = torch.empty(20 * 2**30, dtype=torch.uint8, device=device)
a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
end = time.time() + 180
while time.time() < end:
    a @ a
' &
busy_pid=$!
for _ in $(seq 60); do [ "$(gpu_memory_used)" -gt 10000 ] && break; sleep 1; done
echo "   holder pid $busy_pid, GPU $BUSY_GPU memory used $(gpu_memory_used) MiB"
if playbook launch launch_busy.log -e "run=$RUN"; then
    echo "FAIL: the launch went ahead on a busy GPU"
    exit 1
fi
if ! grep -q "GPU $BUSY_GPU is busy" "$OUT/launch_busy.log"; then
    echo "FAIL: the refusal does not name GPU $BUSY_GPU"
    exit 1
fi
grep -m3 -E "GPU $BUSY_GPU|busy" "$OUT/launch_busy.log" | sed 's/^/   /'
kill "$busy_pid"
wait "$busy_pid" 2>/dev/null || true
busy_pid=""
for _ in $(seq 60); do [ "$(gpu_memory_used)" -lt 1024 ] && break; sleep 1; done
echo "   holder ended, GPU $BUSY_GPU memory used $(gpu_memory_used) MiB"

if grep -q "topology: threaded" "trainer/runs/$RUN.yml"; then
    echo "== 2. CUDA graphs in the threaded topology: refused before any GPU work"
    graphs_on='{"workspace_trainer_set": ["compile.mode=reduce-overhead"]}'
    if playbook launch launch_guard.log -e "run=$RUN" -e "$graphs_on"; then
        echo "FAIL: the launch went ahead with CUDA graphs in the threaded topology"
        exit 1
    fi
    grep -m2 -E "thread|graph" "$OUT/launch_guard.log" | cut -c1-400 | sed 's/^/   /'
    if [ -n "$(compute_apps)" ]; then
        echo "FAIL: a process holds a GPU after the refused launch: $(compute_apps)"
        exit 1
    fi
    echo "   no process on any GPU; workspace runs: $(ls "$STATE/workspace/runs" 2>/dev/null | tr '\n' ' ')"
fi
fi

echo "== 3. launch, status, stop ($GPUS GPU(s))"
playbook launch "launch_$RUN.log" -e "run=$RUN"
tail -n 12 "$OUT/launch_$RUN.log" | sed 's/^/   /'
# The run's log, as launch.yml reported it (nographs -> train_compile_nographs.log, else train_RUN.log).
log=$(sed -n 's/^ *log  *//p' "$OUT/launch_$RUN.log" | head -1)
echo "   log: $log"
grep -E "compiling forward|compiled and warmed up" "$log" | head -4 | sed 's/^/   /'
sleep 20
playbook status "status_$RUN.log"
grep -E "state|progress|tau|GPU" "$OUT/status_$RUN.log" | head -14 | sed 's/^/   /'
echo "   compute apps: $(compute_apps | tr '\n' ';')"
playbook stop "stop_$RUN.log"
grep -E "checkpoint|stopped|SIGKILL" "$OUT/stop_$RUN.log" | head -5 | sed 's/^/   /'
ls "$STATE/workspace/runs/$RUN/checkpoints" | sed 's/^/   checkpoint: /'

echo "== 4. resume from that checkpoint"
playbook launch "resume_$RUN.log" -e "run=$RUN" -e resume=true
sleep 10
grep -m1 "resumed from" "$log" | sed 's/^/   /'
playbook stop "stop_resume_$RUN.log"
cp "$log" "$OUT/"
grep -E "drafter on|^step|^eval|checkpoint saved|resumed|stopped" "$log" | tail -n 20 | sed 's/^/   /'
echo "== done"
