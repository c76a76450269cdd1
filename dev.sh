#!/bin/sh
# One entry point for people and CI. Creates .venv from requirements-dev.txt when it is missing or
# the requirements changed, then runs the command.
#
#   ./dev.sh launch [RUN] [OPTIONS]  launch a run (default RUN: nographs); OPTIONS go to
#                                    ansible-playbook: -e resume=true, -e fresh=true, -i inventory/pair
#   ./dev.sh regen [RUN] [OPTIONS]   prepare the run's data (regenerate it), no training
#   ./dev.sh status [OPTIONS]        report the run on the target
#   ./dev.sh stop [OPTIONS]          stop it (SIGTERM, checkpoint, exit)
#   ./dev.sh runs|logs|report|export [OPTIONS]   history, the log (-e follow=true), a PNG of
#                                    curves (-e runs=a,b), the drafter in the DFlash format
#   ./dev.sh fast           ruff, ansible-lint (production), the unit tests (pytest -m unit)
#   ./dev.sh sanity         ansible-test sanity for the collection dflash.ct200
#   ./dev.sh test           everything: ruff, ansible-lint, sanity, pytest, molecule (default, proxmox)
#   ./dev.sh molecule       only the molecule scenarios default and proxmox
#   ./dev.sh bench          launch/status/stop timings next to a bare nohup start
#   ./dev.sh setup          only create or update .venv
set -eu

cd "$(dirname "$0")"
ROOT=$(pwd)
VENV="$ROOT/.venv"
# Not the first python3 on PATH: on these machines that can be a broken pyenv shim.
PYTHON=${PYTHON:-/usr/bin/python3}

setup() {
    stamp=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" = "$stamp" ]; then
        return 0
    fi
    if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
        echo "error: $PYTHON cannot create a venv; install python3-venv (apt-get install -y python3-venv)" >&2
        exit 2
    fi
    echo "setting up $VENV from requirements-dev.txt (a few minutes the first time)" >&2
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # Bytecode compiled on every core afterwards: pip compiles one file after another (the install took
    # 122 s on the 2-core machine that way, 37 + 48 s this way, the same .pyc files). A file that does
    # not compile on this Python (torch ships one in newer syntax) is skipped as pip skips it.
    "$VENV/bin/python" -m pip install --quiet --no-compile -r requirements-dev.txt
    # Not ansible_collections (15,000 of the 28,000 files): Ansible compiles a collection's Python from
    # its source every time and never reads a .pyc of it.
    "$VENV/bin/python" -m compileall -q -j 0 -x '/ansible_collections/' "$VENV/lib" >/dev/null 2>&1 || true
    echo "$stamp" > "$VENV/.requirements.sha256"
}

run_fast() {
    ruff check .
    ansible-lint --profile production
    # Two processes (pytest-xdist): on the 2-core machine 50 s against 81 s one after the other.
    python -m pytest -q -m unit -n 2
}

# Two commands side by side, each in a process group of its own (setsid: its PID is the group's), which
# an interrupt ends whole: a script's background jobs ignore Ctrl-C, and the children of ansible-test or
# molecule would outlive it. Their output is shown after both end, one after the other.
#   side_by_side NAME_A "COMMAND A" NAME_B "COMMAND B"
side_by_side() {
    logs=$(mktemp -d)
    setsid sh -c "$2" >"$logs/a" 2>&1 &
    first=$!
    setsid sh -c "$4" >"$logs/b" 2>&1 &
    second=$!
    # An interrupt also stops the test nodes a molecule scenario leaves up (none for the others).
    trap 'kill -TERM "-$first" "-$second" 2>/dev/null || true; rm -rf "$logs"; stop_test_nodes; exit 130' INT TERM
    first_rc=0
    wait "$first" || first_rc=$?
    second_rc=0
    wait "$second" || second_rc=$?
    trap - INT TERM
    cat "$logs/a" "$logs/b"
    rm -rf "$logs"
    if [ "$first_rc" -ne 0 ] || [ "$second_rc" -ne 0 ]; then
        echo "error: $1 exited $first_rc, $3 $second_rc" >&2
        return 1
    fi
}

# ansible-lint and the collection's sanity run side by side (each mostly one core: 36 and 38 s on the
# 2-core machine one after the other).
run_lint_and_sanity() {
    side_by_side ansible-lint "ansible-lint --profile production" \
        "the collection's sanity run" scripts/collection_sanity.sh
}

# The molecule scenarios default (this machine plays CT 200) and proxmox (the real-host path on a test
# node of its own, tests/testnode: root, LXC, debootstrap and sshd, which .ci/run installs), side by
# side, nothing shared between them. The proxmox scenario is one chain of playbooks that keeps one core
# busy: run alone after pytest it left the 2-core machine 44 % idle for four minutes (docs/PERFORMANCE.md,
# Test lanes). The scenario default, then MORE (a command, if given), fill the other core.
#   run_molecule [MORE]
run_molecule() {
    more=${1:-}
    reason=$(python -c 'import sys; sys.path.insert(0, "tests/proxmox"); from realhost import missing_requirements as m; print(m() or "")')
    if [ -n "$reason" ] && [ -n "${DFLASH_REQUIRE_TESTNODE:-}" ]; then
        echo "error: molecule scenario proxmox cannot run: $reason" >&2
        exit 1
    fi
    others="molecule test -s default${more:+ && $more}"
    if [ -z "$reason" ]; then
        side_by_side "molecule test -s proxmox" tests/proxmox/run-molecule.sh \
            "molecule test -s default${more:+, then $more}" "$others"
    else
        sh -c "$others"
        echo "molecule scenario proxmox skipped: $reason" >&2
    fi
}

# The test nodes an interrupted ./dev.sh test may leave up: the one of tests/proxmox (its conftest),
# whose teardown an interrupt of pytest's workers skips, and the proxmox scenario's (TESTNODE_STATE
# in molecule/proxmox/molecule.yml), killed before its destroy step.
TESTNODE_STATES="${TESTNODE_STATE_PYTEST:-/run/dflash-testnode-pytest} /run/dflash-testnode-molecule"

# After an interrupt: every test node still up (its API, sshd and container) is stopped. A node caught
# creating a container stays until its unpacking ends: asked again a few seconds later, it goes.
stop_test_nodes() {
    for state in $TESTNODE_STATES; do
        for attempt in 1 2 3 4; do
            [ -d "$state" ] || break
            python tests/testnode/testnode.py --state-dir "$state" stop >/dev/null 2>&1 && break
            if [ "$attempt" -lt 4 ]; then sleep 5; fi
        done
        if [ -d "$state" ]; then
            echo "warning: the test node in $state is still up; stop it: .venv/bin/python tests/testnode/testnode.py --state-dir $state stop" >&2
        fi
    done
}

# Each step's start, with the time (UTC), so that a run's log says where its time went.
step() {
    echo "== $1 ($(date -u +%H:%M:%S))" >&2
}

run_tests() {
    step "ruff"
    ruff check .
    step "ansible-lint and the collection's sanity run"
    run_lint_and_sanity
    trap 'stop_test_nodes; exit 130' INT TERM
    # Parallel pytest processes (pytest-xdist), a test file each at a time: its tests in order in one
    # worker, the real-host file (one test node) included. Files in collection order (the real-host
    # file first), not xdist's most-tests-first. docs/TESTING.md, Parallel runs.
    step "pytest, all but the unit tests"
    rc=0
    python -m pytest -q --durations=25 -n "${DFLASH_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
        -m "not unit" || rc=$?
    if [ "$rc" -ne 0 ]; then
        exit "$rc"
    fi
    # The unit tests (about 80 CPU seconds in one process) on the core the proxmox scenario leaves idle.
    step "molecule scenarios default and proxmox, the unit tests beside them"
    run_molecule "python -m pytest -q -m unit"
    trap - INT TERM
    step "done"
}

command=${1:-}
[ $# -gt 0 ] && shift
setup
PATH="$VENV/bin:$PATH"
export PATH
case "$command" in
    setup) ;;
    launch)
        run=nographs
        if [ $# -gt 0 ] && [ -z "$1" ]; then
            # An empty word would reach ansible-playbook as a playbook path and print its usage.
            echo "error: the run name is empty; pass one, e.g. ./dev.sh launch nographs (or none: nographs)" >&2
            exit 2
        fi
        case "${1:-}" in
            "" | -*) ;;
            *) run=$1; shift ;;
        esac
        exec ansible-playbook playbooks/launch.yml -e "run=$run" "$@" ;;
    regen)
        run=nographs
        case "${1:-}" in
            "" | -*) ;;
            *) run=$1; shift ;;
        esac
        exec ansible-playbook playbooks/regen.yml -e "run=$run" "$@" ;;
    status) exec ansible-playbook playbooks/status.yml "$@" ;;
    stop) exec ansible-playbook playbooks/stop.yml "$@" ;;
    runs | logs | report | export) exec ansible-playbook "playbooks/$command.yml" "$@" ;;
    fast) run_fast ;;
    sanity) exec scripts/collection_sanity.sh "$@" ;;
    test) run_tests ;;
    molecule) run_molecule ;;
    bench) exec python scripts/bench_launch.py "$@" ;;
    *)
        sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
        exit 2
        ;;
esac
