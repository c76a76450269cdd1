#!/bin/sh
# ansible-test sanity for the collection dflash.ct200, as ./dev.sh test and ./dev.sh sanity run it.
#
# ansible-test wants to run at the root of a collection, inside ansible_collections/NAMESPACE/NAME
# and not inside another project's git tree, so the collection is copied to a temporary
# ansible_collections/dflash/ct200 first (byte-code caches left out) and checked there.
# Each sanity test runs in a virtual environment of its own under ~/.ansible/test/venv, made
# once with ansible-test's pinned requirements (from the package index pip uses) and reused
# after that. ansible-test puts pip into those environments with a get-pip.py script it
# downloads from ci-files.testing.ansible.com; where that host cannot be reached the script
# scripts/get_pip_offline.py stands in for it (pip from Python's own ensurepip).
#
# Every plugin is checked, with no ignore file (tests/sanity/ignore-*.txt): ansible-lint's production
# profile refuses ignore entries for validate-modules' errors, and the documentation must match each
# argument spec exactly. trainer_start's detached start (setsid, stdin /dev/null, output to the log)
# cannot use run_command, which waits for the program: its Popen lives in
# plugins/module_utils/detached.py, which says why.
#
# Extra arguments go to ansible-test (for example --test validate-modules, or -v).
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
SOURCE="$ROOT/collections/ansible_collections/dflash/ct200"
PIP_VERSION=24.2
BOOTSTRAP="$HOME/.ansible/test/cache/get_pip_$(echo "$PIP_VERSION" | tr . _).py"

if [ ! -s "$BOOTSTRAP" ]; then
    mkdir -p "$(dirname "$BOOTSTRAP")"
    cp "$ROOT/scripts/get_pip_offline.py" "$BOOTSTRAP"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dflash-sanity.XXXXXX")
trap 'rm -rf "$WORK"' EXIT INT TERM
mkdir -p "$WORK/ansible_collections/dflash"
cp -R "$SOURCE" "$WORK/ansible_collections/dflash/ct200"
find "$WORK" -name __pycache__ -type d -prune -exec rm -rf {} +
cd "$WORK/ansible_collections/dflash/ct200"
ansible-test sanity --python 3.11 --local --color no "$@"
