#!/usr/bin/env bash
# The real recipe end to end on a GPU machine that plays CT 200 (inventory/gpu: local connection,
# GPUs required, the real nvidia-smi), through the playbooks, on a Qwen3-8B-shaped target with random
# weights (python -m trainer.data.embedded) and a synthetic long-tailed chat set:
#   data:  build the target and the chat set; regen.yml -e run=qwen3-8b (the product's regeneration
#          stage), status.yml while it regenerates and after; the regenerated shards as one archive
#          in $OUT (regenerated.tgz), for a second machine.
#   train: launch.yml -e run=qwen3-8b (the rest of the regeneration, the token store, packed rows of
#          3,072 tokens, training), status.yml, stop.yml (a checkpoint), launch.yml -e resume=true,
#          the run to its last step, status.yml; WARM_LAUNCH=true: then a launch over the warm
#          compile cache (-e fresh=true) to its first progress, and stop.yml.
#   export: export.yml, and the export loaded by the reference dflash package
#          (scripts/dflash_reference_check.py: greedy decoding lossless, its acceptance length).
#   compare: the product's regeneration against bench/regen_bench.py on the same prompts and target:
#          regen.yml (its compile cache filled where it was not), the shards removed and regen.yml
#          again over the warm cache, then regen_bench --chat in a fresh process over that cache
#          (one call, the product's shards and turns as the stage makes them; the file's prompts in
#          one call). COMPARE_CONVERSATIONS (default 256) in shards of COMPARE_SHARD (default the
#          product's, 1024); COMPARE_ROWS the bench's rows (default shards,static; shards alone skips
#          the one-call row's compiles; paged: the product's default engine, every prompt at once);
#          COMPARE_WARM_PASS=false skips the second regen.yml; COMPARE_SECOND_SET=true ends with a
#          second set of as many other conversations through regen.yml over the warm cache;
#          COMPARE_FIRST_EXCHANGE=true cuts every conversation to its first exchange (one turn: the
#          bench's every-prompt-at-once is then the stage's own work, no turn waiting for the answer
#          its prompt holds); settings the regeneration is given in
#          EXTRA_SET (data.regen_*) go to the bench too, in COMPARE_BENCH_ARGS (e.g. --decode-scope
#          layers).
#   warm-compare: compare without its first pass, over the data stage's chat set and compile cache
#          (after data, train and export: it regenerates the set again, the run's shards replaced by
#          the same ones).
#   bench: regen_bench alone on the data stage's chat set and target (its rows and arguments as in
#          warm-compare), over the compile cache the machine holds: on a machine that did not run
#          the data stage it compiles from nothing, the figure to set beside the data stage's cold
#          regeneration.
#   lengths: regen_bench's static engine on the data stage's chat set and target (built here if
#          missing), each answer ending where the file's does (--answer-lengths file: the random
#          target never ends on its own), at the caps LENGTHS_CAPS (default 256,1024,2048) in one
#          process over a compile cache of its own under the machine's (answer-lengths/: its steps
#          carry the forced ending): per cap, useful tok/s (answer tokens only), the
#          share of row-steps that decode an answer token, and peak memory. LENGTHS_CONVERSATIONS
#          (default 48: 61 prompts of up to 1,111 tokens, one batch of width 2,048 at each cap, so
#          three shapes compile cold and the stage fits a call); LENGTHS_PASSES (default 2: the
#          first compiles what is new, the second is the steady figure).
#   first-start: launch.yml -e run=qwen3-8b -e fresh=true into an empty compile cache (the data
#          stage's shards, if any, kept) to its first progress, its startup breakdown, nvidia-smi
#          and the training's peak GPU memory in its step rows, then stop.yml: whether a bare
#          machine's first start fits the card (EXTRA_SET=train.batch_size=N).
#   writes: two fresh runs of STEPS steps on the same rows, without periodic checkpoints and every
#          CHECKPOINT_EVERY steps, their progress windows' tok/s side by side: what a write in the
#          background costs the step (docs/PERFORMANCE.md).
# Usage: scripts/gpu_recipe.sh STAGE... (data, train, export, compare, warm-compare, bench, lengths, first-start, writes, all), in order;
# e.g. `data`, then `train`, then `export warm-compare`: the recipe from an empty state and the
# product's regeneration against its bench, in three calls.
# Each stage fits a device call of ten minutes. On one H200 (2026-12-05, docs/PERFORMANCE.md) with
# CONVERSATIONS=512: data 4.9 min from an empty state (the cold compile most of it), train 5.5 min
# with STEPS=24 (the target built again on a bare machine included), export 1.3 min, bench 5.5 min
# cold. On one H100 (2026-12-05): data 7.5 min, warm-compare 6.9 min. `all` is data, train and
# export in one go.
# A stage finds what the one before left in $RECIPE_DIR (default
# /tmp/dflash-recipe: a machine that stayed warm between calls, as one does when the next call
# starts within its 30 s); train and data otherwise rebuild the target (the same weights: a fixed
# seed and a fixed file time, so the regeneration's key is the same) and train unpacks $REGENERATED
# (default .e2e/regenerated.tgz, carried from the data stage's $OUT). Export needs the train stage's
# checkpoint: the same machine, still warm. Use STEPS well above the first step (the first progress
# line launch.yml waits for), or the run ends before stop.yml reaches it (24 on one H200).
# On an 80 GB H100 give EXTRA_SET=train.batch_size=6: a first start into an empty compile cache,
# regenerating first, fitted there (2026-12-07).
# Every figure it prints comes from the product's own lines (the log, status, the run record).
# A venv without bytecode (the lent GPU machines' one) is byte-compiled first, as pip leaves CT 200's.
# Every process it starts is ended by PID, also on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?usage: scripts/gpu_recipe.sh STAGE... (data, train, export, compare, warm-compare, bench, lengths, first-start, writes, all)}
OUT=${OUT:-/tmp/gpu_recipe}
# compare builds its own, smaller chat set: a directory of its own, so data and train find theirs.
RECIPE_DIR=${RECIPE_DIR:-/tmp/dflash-$([ "$STAGE" = compare ] && echo compare || echo recipe)}
STATE=$RECIPE_DIR/state
MODEL=$RECIPE_DIR/model
CONVERSATIONS=${CONVERSATIONS:-2048}
NEW_TOKENS=${NEW_TOKENS:-256}
# The product's default compiles the regeneration's decode step: a cold compile of each prompt width
# of a long-tailed set takes minutes (docs/PERFORMANCE.md), more than a short data set's decoding;
# REGEN_COMPILE=false decodes eagerly, for an end to end within a ten-minute call.
REGEN_COMPILE=${REGEN_COMPILE:-true}
STEPS=${STEPS:-24}
# A periodic checkpoint every CHECKPOINT_EVERY steps besides the stop's and the end's: one written in
# the background while training goes on (0: none).
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-8}
# WARM_LAUNCH=true: after the resumed run's end, the train stage launches the run once more from its
# start (-e fresh=true) over the warm compile cache, to its first progress, and stops it.
WARM_LAUNCH=${WARM_LAUNCH:-false}
# How long the data stage may regenerate before it stops the run (the finished shards are kept, and
# the train stage's launch regenerates the rest): a device call has ten minutes.
REGEN_BUDGET_S=${REGEN_BUDGET_S:-420}
REGENERATED=${REGENERATED:-.e2e/regenerated.tgz}
# A rehearsal on a machine without a GPU: SHAPE=qwen3-tiny BUILD_DEVICE=cpu INVENTORY=inventory/local,
# and for the train stage shorter rows, e.g. EXTRA_SET=train.seq_len=512,drafter.num_anchors=16
# (comma-separated trainer settings, added to the run's).
EXTRA_SET=${EXTRA_SET:-}
SHAPE=${SHAPE:-qwen3-8b}
BUILD_DEVICE=${BUILD_DEVICE:-cuda}
INVENTORY=${INVENTORY:-inventory/gpu}
mkdir -p "$OUT" "$STATE"
export ANSIBLE_CONFIG="$PWD/ansible.cfg" PYTHONUNBUFFERED=1
export ANSIBLE_CACHE_PLUGIN_CONNECTION="$STATE/facts"
VARS=$RECIPE_DIR/vars.json
stage_started=$SECONDS

cleanup() {
    ansible-playbook -i "$INVENTORY" -e "dflash_state_dir=$STATE" -e "@$VARS" playbooks/stop.yml >/dev/null 2>&1 || true
}
trap cleanup EXIT

say() { echo "[$(date -u +%H:%M:%S) +$((SECONDS - stage_started))s] $*"; }

playbook() {  # playbook NAME LOG [ansible-playbook args...]
    local name=$1 log=$2
    shift 2
    local started=$SECONDS rc=0
    ansible-playbook -i "$INVENTORY" -e "dflash_state_dir=$STATE" -e "@$VARS" "playbooks/$name.yml" "$@" \
        >"$OUT/$log" 2>&1 || rc=$?
    say "$name.yml $* rc=$rc in $((SECONDS - started)) s (log: $log)"
    return $rc
}

# The machine config (the model and data keys the recipe needs) and the run's lengths for a short
# end to end: STEPS steps, checkpoints at the stop, every CHECKPOINT_EVERY steps and at the end (one
# kept, and the best tau's), tau on 4 prompts.
write_vars() {
    python3 - "$VARS" "$MODEL" "$NEW_TOKENS" "$REGEN_COMPILE" "$EXTRA_SET" "$CHECKPOINT_EVERY" <<'EOF'
import json, sys
path, model, new_tokens, regen_compile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "true"
extra = [item for item in sys.argv[5].split(",") if item]
checkpoint_every = int(sys.argv[6])
json.dump({
    "dflash_machine": {
        "model": {"target_path": f"{model}/target", "dtype": "bfloat16"},
        "data": {
            "train_file": f"{model}/chat.jsonl", "regen_max_new_tokens": new_tokens, "regen_compile": regen_compile,
        },
        "parallel": {"devices": "auto"},
    },
    "workspace_trainer_set": [
        "train.log_every=4", "train.eval_every=0", "train.eval_prompts=4", "train.eval_max_new_tokens=64",
        f"train.checkpoint_every={checkpoint_every}", "train.checkpoint_every_s=0", "train.keep_checkpoints=1",
    ] + extra,
}, open(path, "w"), indent=1)
EOF
}

build_model() {
    say "target and data: python -m trainer.data.embedded --shape $SHAPE (random weights, on $BUILD_DEVICE)"
    python3 -m trainer.data.embedded --shape "$SHAPE" --out "$MODEL" --conversations "$CONVERSATIONS" \
        --device "$BUILD_DEVICE" \
        2>&1 | grep -v "Writing model shards" | tee "$OUT/build_model.log"
    # A fixed time on the weights: the regeneration's key fingerprints large files by name, size and
    # time, so a machine that rebuilds the same weights finds the shards the data stage made.
    touch -d @1764720000 "$MODEL"/target/*
    du -sh "$MODEL/target" "$MODEL/chat.jsonl" | sed 's/^/   /'
}

gpus() { nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv,noheader 2>/dev/null || echo none; }

status_lines() {  # status_lines LOG: the report's lines that say where the run is
    grep -E "ct200: |progress|regen|ckpt|tau|GPU [0-9]|stage" "$OUT/$1" | grep -v "TASK\|PLAY" | head -12 | sed 's/^/   /'
}

recorded_state() {  # the run record's state on the target (the truth status reads)
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r.get("state"), r.get("exit_reason", ""))' \
        "$STATE/workspace/runs/qwen3-8b/run.json" 2>/dev/null || echo "none"
}

startup_breakdown() {  # startup_breakdown WHAT: the run record's startup (where the time to the first step went)
    local record=$STATE/workspace/runs/qwen3-8b/run.json
    for _ in 1 2 3 4 5 6 7 8 9 10; do  # the record is written just after the line launch.yml waits for
        python3 - "$record" "$1" <<'EOF' && return 0
import json, sys
from trainer.run.startup import ORDER
startup = json.load(open(sys.argv[1])).get("startup")
if not startup:
    sys.exit(1)
seconds = startup["seconds"]
what = "resume" if startup["resumed"] else "launch"
print(f"   {sys.argv[2]}: {what} breakdown from the run record, {seconds['total']:.1f} s from the trainer's start "
      "to its first step:")
for name in [*ORDER, "other"]:
    if name in seconds:
        print(f"      {name:<26} {seconds[name]:7.1f} s")
EOF
        sleep 1
    done
    say "no startup breakdown in $record"
}

checkpoint_lines() {  # checkpoint_lines LOG: every checkpoint's pause and write, the newest last
    { grep -E "^checkpoint step [0-9]+: training paused|^checkpoint step [0-9]+ not saved|written without a host copy|^error: cannot save the checkpoint" "$1" \
        || echo "none"; } | sed 's/^/   /'
}

wait_for_idle_gpus() {  # wait_for_idle_gpus SECONDS: until no process holds a GPU (none: at once)
    local deadline=$((SECONDS + $1))
    while [ $SECONDS -lt $deadline ] && [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ]; do
        sleep 2
    done
}

wait_for_end() {  # wait_for_end SECONDS: until the run record leaves `running`; 1 if it did not
    local deadline=$((SECONDS + $1))
    while [ $SECONDS -lt $deadline ]; do
        case "$(recorded_state)" in running*|starting*) sleep 5 ;; *) return 0 ;; esac
    done
    say "still $(recorded_state) after $1 s"
    return 1
}

stage_data() {
    build_model
    say "regen.yml -e run=qwen3-8b: $CONVERSATIONS conversations, up to $NEW_TOKENS new tokens an answer"
    local began=$SECONDS
    playbook regen regen.log -e run=qwen3-8b
    sleep 45
    playbook status status_regen.log
    status_lines status_regen.log
    gpus | sed 's/^/   GPU /'
    if ! wait_for_end $((REGEN_BUDGET_S - (SECONDS - began))); then
        playbook stop stop_regen.log || true
        say "stopped for the call's time; the finished shards are kept for the train stage"
    fi
    say "run record: $(recorded_state)"
    playbook status status_regen_done.log
    status_lines status_regen_done.log
    log=$STATE/workspace/train_qwen3-8b.log
    grep -E "^regen|^data|compil|GPU memory" "$log" | tail -n 12 | sed 's/^/   /'
    cp "$log" "$OUT/regen_train_qwen3-8b.log"
    tar czf "$OUT/regenerated.tgz" -C "$STATE/workspace/cache" regenerated
    say "regenerated shards: $(du -sh "$OUT/regenerated.tgz" | cut -f1) in regenerated.tgz"
}

stage_train() {
    if [ ! -d "$STATE/workspace/cache/regenerated" ] && [ -f "$REGENERATED" ]; then
        mkdir -p "$STATE/workspace/cache"
        tar xzf "$REGENERATED" -C "$STATE/workspace/cache"
        say "regenerated shards unpacked from $REGENERATED"
    fi
    build_model
    log=$STATE/workspace/train_qwen3-8b.log
    playbook launch launch.log -e run=qwen3-8b -e "steps=$STEPS"
    grep -E "PID|first progress" "$OUT/launch.log" | head -3 | sed 's/^/   /'
    grep -E "^data|^drafter|compiled and warmed|^step|regen" "$log" | head -16 | sed 's/^/   /'
    startup_breakdown launch
    playbook status status_train.log
    status_lines status_train.log
    gpus | sed 's/^/   GPU /'
    playbook stop stop.log
    grep -E "stopped|checkpoint" "$OUT/stop.log" | head -4 | sed 's/^/   /'
    { grep -E "^checkpoint|^error: " "$log" || echo "no checkpoint line"; } | tail -n 3 | sed 's/^/   /'
    say "checkpoints of the launched process (the stop's last):"
    checkpoint_lines "$log"
    cp "$log" "$OUT/launch_train_qwen3-8b.log"  # the next launch starts the log anew (the old one renamed)
    ls -la "$STATE/workspace/runs/qwen3-8b/checkpoints" | sed 's/^/   /'
    playbook launch resume.log -e run=qwen3-8b -e resume=true
    grep -E "PID|first progress" "$OUT/resume.log" | head -3 | sed 's/^/   /'
    grep -m1 "resumed from" "$log" | sed 's/^/   /'
    startup_breakdown resume
    wait_for_end 300 || true
    say "run record: $(recorded_state)"
    case "$(recorded_state)" in finished*) ;; *) say "FAIL: the resumed run did not finish"; exit 1 ;; esac
    playbook status status_done.log
    status_lines status_done.log
    grep -E "^step|^eval|^checkpoint|^done" "$log" | tail -n 14 | sed 's/^/   /'
    say "checkpoints of the resumed process (every CHECKPOINT_EVERY=$CHECKPOINT_EVERY steps, the end's last):"
    checkpoint_lines "$log"
    say "startup lines of the logs (launch, then resume):"
    { grep -h -E "^startup: " "$OUT/launch_train_qwen3-8b.log" "$log" || echo "none"; } | sed 's/^/   /'
    ls -la "$STATE/workspace/runs/qwen3-8b/checkpoints" | sed 's/^/   /'
    cp "$log" "$OUT/train_qwen3-8b.log"
    [ "$WARM_LAUNCH" = true ] || return 0
    # A launch's start over the compile cache the first one filled (a bare machine's first launch
    # compiles from nothing): the run started over (-e fresh=true), stopped at its first progress.
    # The finished trainer may still hold its GPU while it exits: the preflight refuses a busy GPU.
    wait_for_idle_gpus 120
    playbook launch warm_launch.log -e run=qwen3-8b -e "steps=$STEPS" -e fresh=true \
        || grep -E "FAILED|msg" "$OUT/warm_launch.log" | head -6 | sed 's/^/   /'
    grep -E "PID|first progress" "$OUT/warm_launch.log" | head -3 | sed 's/^/   /'
    startup_breakdown "warm launch"
    playbook stop stop_warm.log
    say "checkpoints of the warm launch's process:"
    checkpoint_lines "$log"
    cp "$log" "$OUT/warm_launch_train_qwen3-8b.log"
}

stage_export() {
    local exports=$RECIPE_DIR/exports
    playbook export export.log -e run=qwen3-8b -e "dest=$exports"
    grep -E "export|drafter|step" "$OUT/export.log" | grep -v TASK | head -4 | sed 's/^/   /'
    local exported
    exported=$(find "$exports" -name config.json -printf '%h\n' | head -1)
    say "reference check of $exported (float32: see the check's own help)"
    python3 scripts/dflash_reference_check.py "$exported" "$MODEL/target" "$MODEL/chat.jsonl" --prompts 4 \
        --device "$BUILD_DEVICE" \
        2>&1 | grep -v "^Loading" | tee "$OUT/reference_check.log" | tail -n 8 | sed 's/^/   /'
}

stage_first_start() {  # a launch into an empty compile cache to its first progress, then stopped
    build_model
    rm -rf "$STATE/workspace/cache/compile"
    playbook launch first_start.log -e run=qwen3-8b -e "steps=$STEPS" -e fresh=true \
        || grep -E "FAILED|msg" "$OUT/first_start.log" | head -6 | sed 's/^/   /'
    grep -E "PID|first progress" "$OUT/first_start.log" | head -3 | sed 's/^/   /'
    startup_breakdown "first start"
    sleep 10  # a few steps: the training's peak memory in their rows
    gpus | sed 's/^/   GPU /'
    playbook stop stop_first.log || true
    local log=$STATE/workspace/train_qwen3-8b.log
    grep -E "^startup|^step|memory|^checkpoint|rror" "$log" | head -12 | sed 's/^/   /'
    python3 - "$STATE/workspace/runs/qwen3-8b/metrics.jsonl" <<'PY' || true
import json, sys
peaks = [row["gpu_peak_gib"] for row in map(json.loads, open(sys.argv[1])) if "gpu_peak_gib" in row]
print(f"   the training's peak GPU memory (max_memory_allocated) in its step rows: {max(peaks) if peaks else 'none'} GiB")
PY
    cp "$log" "$OUT/first_start_train_qwen3-8b.log"
}

stage_writes() {  # the step's rate with and without background checkpoints, on the same rows
    # Two fresh runs of STEPS steps, the same seed and so the same rows at each step: one without
    # periodic checkpoints, then one every CHECKPOINT_EVERY steps (the first also fills the compile
    # cache the second starts from). Each progress window's tok/s side by side: a window that
    # differs only by a write in flight beside it says what the write costs the step.
    build_model
    local log=$STATE/workspace/train_qwen3-8b.log every=$CHECKPOINT_EVERY period
    for period in 0 "$every"; do
        CHECKPOINT_EVERY=$period write_vars
        wait_for_idle_gpus 120
        playbook launch "writes_$period.log" -e run=qwen3-8b -e "steps=$STEPS" -e fresh=true \
            || grep -E "FAILED|msg" "$OUT/writes_$period.log" | head -6 | sed 's/^/   /'
        wait_for_end 400 || say "the run every $period steps did not end in time"
        cp "$log" "$OUT/writes_${period}_train_qwen3-8b.log"
        checkpoint_lines "$log"
    done
    CHECKPOINT_EVERY=$every write_vars
    python3 - "$OUT/writes_0_train_qwen3-8b.log" "$OUT/writes_${every}_train_qwen3-8b.log" "$every" <<'PY'
import re, sys
rate = re.compile(r"^step (\d+)/\d+ .* tok/s (\d+)")
def windows(path):
    return {int(m[1]): int(m[2]) for m in map(rate.match, open(path)) if m}
alone, beside = windows(sys.argv[1]), windows(sys.argv[2])
print(f"   window ending at step: tok/s without periodic checkpoints | every {sys.argv[3]} steps | ratio")
for step in sorted(set(alone) & set(beside)):
    print(f"   {step:>5}: {alone[step]:>7,} | {beside[step]:>7,} | {beside[step] / alone[step]:.3f}")
PY
}

regen_pass() {  # regen_pass NAME: regen.yml over no regenerated data, to its end or REGEN_BUDGET_S
    local log=$STATE/workspace/train_qwen3-8b.log
    rm -rf "$STATE/workspace/cache/regenerated"
    say "regen.yml ($1): $(wc -l <"$MODEL/chat.jsonl") conversations, $NEW_TOKENS new tokens"
    playbook regen "regen_$1.log" -e run=qwen3-8b
    wait_for_end "$REGEN_BUDGET_S" || { playbook stop "stop_$1.log" || true; say "stopped for the call's time"; }
    grep -E "compile cache|regenerated [0-9]+ conversations" "$log" | tail -n 3 | sed 's/^/   /'
    decode_rate "$log"
}

decode_rate() {  # decode_rate LOG: the last regeneration's tokens over its worker's time outside torch.compile
    python3 - "$1" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
spent = re.findall(r"compile cache: ([0-9.]+) s of ([0-9.]+) s in torch.compile", text)
done = re.findall(r"regenerated [0-9,]+ conversations, ([0-9,]+) tokens", text)
if spent and done:
    compiling, total = map(float, spent[-1])
    tokens = int(done[-1].replace(",", ""))
    print(f"   decoding: {tokens:,} tokens in {total - compiling:.1f} s outside torch.compile, CUDA graph recording in it "
          f"({tokens / max(total - compiling, 1e-9):,.0f} tok/s; compiling {compiling:.1f} s of {total:.1f} s): "
          "the figure to set beside the bench's steady pass")
EOF
}

stage_warm_compare() {  # the data stage's set again over the warm compile cache, then regen_bench on it
    regen_pass warm
    stage_bench
}

stage_bench() {  # regen_bench on the data stage's set, over the compile cache this machine holds
    # The run's train.seq_len (the recipe's 3,072 unless EXTRA_SET sets it): turns past it are left out.
    local seq_len
    seq_len=$(echo ",$EXTRA_SET," | sed -n 's/.*,train\.seq_len=\([0-9]*\),.*/\1/p')
    say "regen_bench: the same file and target, a fresh process over the product's compile cache ($(
        find "$STATE/workspace/cache/compile" -type f 2>/dev/null | wc -l) files in it)"
    # shellcheck disable=SC2086 # COMPARE_BENCH_ARGS is a list of arguments
    python3 bench/regen_bench.py --rows "${COMPARE_ROWS:-shards,static}" --chat "$MODEL/chat.jsonl" \
        --target "$MODEL/target" --new-tokens "$NEW_TOKENS" --shard-size "$SHARD" --seq-len "${seq_len:-3072}" ${COMPARE_BENCH_ARGS:-} \
        --compile-cache "$STATE/workspace/cache/compile" 2>&1 | grep -v -i "warn" | tee "$OUT/regen_bench.log" \
        | grep -E "pass|calls|prompts,|compile cache|Dynamo|phases" | sed 's/^/   /'
}

stage_lengths() {  # regen_bench with the chat set's own answer lengths, at several caps, one process
    build_model
    local caps=${LENGTHS_CAPS:-256,1024,2048}
    say "regen_bench --answer-lengths file: the first ${LENGTHS_CONVERSATIONS:-48} conversations at caps $caps"
    # shellcheck disable=SC2086 # LENGTHS_BENCH_ARGS is a list of arguments
    python3 bench/regen_bench.py --rows static --chat "$MODEL/chat.jsonl" --target "$MODEL/target" \
        --answer-lengths file --new-tokens "$caps" --prompts "${LENGTHS_CONVERSATIONS:-48}" \
        --passes "${LENGTHS_PASSES:-2}" --seq-len 3072 ${LENGTHS_BENCH_ARGS:-} \
        --compile-cache "$STATE/workspace/cache/compile" 2>&1 | grep -v -i "warn" | tee "$OUT/regen_lengths.log" \
        | grep -E "pass|== cap|prompts,|answer lengths|row-steps|answers|compile cache|width" | sed 's/^/   /'
}

first_exchanges() {  # first_exchanges FILE: each conversation cut to its first user turn and answer
    [ "${COMPARE_FIRST_EXCHANGE:-false}" = true ] || return 0
    python3 - "$1" <<'EOF'
import json, os, sys
path = sys.argv[1]
lines = [json.loads(line) for line in open(path)]
with open(path + ".part", "w") as out:
    for row in lines:
        out.write(json.dumps({**row, "messages": row["messages"][:2]}) + "\n")
os.replace(path + ".part", path)
print(f"   {path}: {len(lines)} conversations cut to their first exchange")
EOF
}

stage_compare() {
    CONVERSATIONS=${COMPARE_CONVERSATIONS:-256} build_model
    first_exchanges "$MODEL/chat.jsonl"
    regen_pass first
    # COMPARE_WARM_PASS=false: the bench straight after the first pass (its own first pass is then
    # the warm start of a fresh process over the product's cache), for a call that has no time for both
    if [ "${COMPARE_WARM_PASS:-true}" = true ]; then regen_pass warm; fi
    stage_bench
    if [ "${COMPARE_SECOND_SET:-false}" = true ]; then second_set; fi
}

second_set() {  # other conversations of the same shape (another seed) through regen.yml, over the warm cache
    local chat=$MODEL/chat.jsonl
    mv "$chat" "$MODEL/chat.first.jsonl"
    python3 -c "import sys; from pathlib import Path; from trainer.data.embedded import TARGET_SHAPES, write_chat; \
write_chat(Path(sys.argv[1]), int(sys.argv[2]), TARGET_SHAPES[sys.argv[3]]['vocab_size'], seed=1)" \
        "$chat" "${COMPARE_CONVERSATIONS:-256}" "$SHAPE"
    first_exchanges "$chat"
    regen_pass second
    mv "$MODEL/chat.first.jsonl" "$chat"
}

# compare's regeneration in shards of COMPARE_SHARD, which the bench is given too; the product's
# default (data.regen_shard_size) otherwise.
SHARD=${COMPARE_SHARD:-1024}
if [ -n "${COMPARE_SHARD:-}" ]; then EXTRA_SET="data.regen_shard_size=$SHARD${EXTRA_SET:+,$EXTRA_SET}"; fi
byte_compile_venv() {  # once: the bytecode pip leaves in every venv it installs into (CT 200's)
    local packages
    packages=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [ -d "$packages/torch/__pycache__" ] && return 0
    local began=$SECONDS
    python3 -m compileall -q -j 0 "$packages" >/dev/null 2>&1 || true
    say "byte-compiled $packages in $((SECONDS - began)) s (a venv without bytecode compiles ~1,700 modules at every start)"
}

write_vars
byte_compile_venv
say "GPUs: $(gpus | tr '\n' ';') disk: $(df -h /tmp | tail -1)"
for stage in "${@}"; do
    case "$stage" in
        data) stage_data ;;
        train) stage_train ;;
        export) stage_export ;;
        compare) stage_compare ;;
        warm-compare) stage_warm_compare ;;
        bench) stage_bench ;;
        lengths) stage_lengths ;;
        first-start) stage_first_start ;;
        writes) stage_writes ;;
        all) stage_data; stage_train; stage_export ;;
        *) echo "usage: scripts/gpu_recipe.sh STAGE... (data, train, export, compare, warm-compare, bench, lengths, first-start, writes, all)" >&2; exit 2 ;;
    esac
    say "== $stage done"
done
