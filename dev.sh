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

# ansible-lint and the collection's sanity run side by side (each mostly one core: 36 and 38 s on the
# 2-core machine one after the other), their output shown after both end, one after the other.
run_lint_and_sanity() {
    logs=$(mktemp -d)
    trap 'rm -rf "$logs"' EXIT
    # Each in a process group of its own (setsid: its PID is the group's), which an interrupt ends
    # whole: a script's background jobs ignore Ctrl-C, and ansible-test's children would outlive it.
    setsid ansible-lint --profile production >"$logs/lint" 2>&1 &
    lint=$!
    setsid scripts/collection_sanity.sh >"$logs/sanity" 2>&1 &
    sanity=$!
    trap 'kill -TERM "-$lint" "-$sanity" 2>/dev/null || true; exit 130' INT TERM
    lint_rc=0
    wait "$lint" || lint_rc=$?
    sanity_rc=0
    wait "$sanity" || sanity_rc=$?
    trap - INT TERM
    cat "$logs/lint" "$logs/sanity"
    if [ "$lint_rc" -ne 0 ] || [ "$sanity_rc" -ne 0 ]; then
        echo "error: ansible-lint exited $lint_rc, the collection's sanity run $sanity_rc" >&2
        exit 1
    fi
}

# The molecule scenarios, one after the other: default (this machine plays CT 200), then proxmox (the
# real-host path on a test node of its own, tests/testnode: root, LXC, debootstrap and sshd, which
# .ci/run installs).
run_molecule() {
    molecule test -s default
    reason=$(python -c 'import sys; sys.path.insert(0, "tests/proxmox"); from realhost import missing_requirements as m; print(m() or "")')
    if [ -z "$reason" ]; then
        tests/proxmox/run-molecule.sh
    elif [ -n "${DFLASH_REQUIRE_TESTNODE:-}" ]; then
        echo "error: molecule scenario proxmox cannot run: $reason" >&2
        exit 1
    else
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
    # file first, the unit tests last), not xdist's most-tests-first. docs/TESTING.md, Parallel runs.
    # The molecule scenarios follow: beside pytest they gained nothing (the two cores are busy
    # throughout; docs/PERFORMANCE.md, Test lanes).
    step "pytest"
    rc=0
    python -m pytest -q --durations=25 -n "${DFLASH_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder || rc=$?
    if [ "$rc" -ne 0 ]; then
        exit "$rc"
    fi
    step "molecule scenarios default and proxmox"
    run_molecule
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
