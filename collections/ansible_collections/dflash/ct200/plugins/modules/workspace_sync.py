#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Write a set of files into a directory in one module run, only those whose content or mode differs."""

from __future__ import annotations

DOCUMENTATION = r"""
module: workspace_sync
short_description: Bring a set of files in a directory to the given content and modes
description:
  - Writes each of O(files) below O(dest) whose content or mode differs (atomically, through a temporary
    file, then a rename), creates missing directories, and removes files below the O(prune)
    directories that are not in O(files) (byte-code caches excepted).
  - It compares the real content on the target (SHA-256), so it is idempotent and notices drift.
  - One module run for the whole tree, where C(ansible.builtin.copy) costs one module run per file,
    about half a second each on a small host, which is most of a launch's time budget. Like copy
    it needs nothing but Python on the target, so it works over any connection, including
    C(community.proxmox.proxmox_pct_remote); rsync-based C(synchronize) does not.
options:
  dest:
    description: The directory the relative paths are below.
    type: path
    required: true
  files:
    description:
      - The files, each with C(path) (relative to O(dest), no C(..), no empty or absolute parts),
        C(content_b64) (the content, base64) and C(mode) (octal string, default C(0640)).
      - A path that is not plain and relative fails the module before anything is written.
    type: list
    elements: dict
    required: true
  prune:
    description: Relative directories in which files not listed in O(files) are removed.
    type: list
    elements: str
    default: []
  dir_mode:
    description: Mode of directories this module creates.
    type: str
    default: "0750"
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Sync the trainer and the run files
  dflash.ct200.workspace_sync:
    dest: /workspace
    files:
      - path: run.sh
        content_b64: "{{ lookup('ansible.builtin.template', 'run.sh.j2') | b64encode }}"
        mode: "0750"
    prune:
      - trainer
"""

RETURN = r"""
written:
  description: Relative paths written (new or changed); on a failure, those written before it.
  type: list
  elements: str
  returned: always
removed:
  description: Relative paths removed by O(prune).
  type: list
  elements: str
  returned: always
"""

import base64
import hashlib
import os
import stat
import tempfile

from ansible.module_utils.basic import AnsibleModule

SKIPPED_DIRS = {"__pycache__"}


def safe_relative(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "" not in parts


def current_state(path: str) -> tuple[str, int] | None:
    try:
        with open(path, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        return digest, stat.S_IMODE(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def write_atomic(path: str, data: bytes, mode: int, dir_mode: int) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=dir_mode, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".sync-")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "dest": {"type": "path", "required": True},
            "files": {"type": "list", "elements": "dict", "required": True},
            "prune": {"type": "list", "elements": "str", "default": []},
            "dir_mode": {"type": "str", "default": "0750"},
        },
        supports_check_mode=True,
    )
    dest = module.params["dest"]
    dir_mode = int(module.params["dir_mode"], 8)
    wanted = {}
    for entry in module.params["files"]:
        path = str(entry.get("path", ""))
        if not safe_relative(path):
            module.fail_json(msg=f"workspace_sync: {path!r} is not a plain relative path below {dest}")
        data = base64.b64decode(entry.get("content_b64", ""))
        wanted[path] = (data, int(str(entry.get("mode", "0640")), 8))
    for prune_dir in module.params["prune"]:
        if not safe_relative(prune_dir):
            module.fail_json(msg=f"workspace_sync: prune entry {prune_dir!r} is not a plain relative path")

    written, removed = [], []
    path = ""
    try:
        for path, (data, mode) in sorted(wanted.items()):
            full = os.path.join(dest, path)
            if current_state(full) != (hashlib.sha256(data).hexdigest(), mode):
                if not module.check_mode:
                    write_atomic(full, data, mode, dir_mode)
                written.append(path)
        for prune_dir in module.params["prune"]:
            for current, subdirs, names in os.walk(os.path.join(dest, prune_dir)):
                subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS]
                for name in names:
                    path = os.path.relpath(os.path.join(current, name), dest)
                    if path not in wanted:
                        if not module.check_mode:
                            os.unlink(os.path.join(current, name))
                        removed.append(path)
    except OSError as error:
        # A full disk, a read-only workspace, a file where a directory must go: name the file and
        # what was already done, rather than a traceback.
        module.fail_json(
            msg=f"workspace_sync: cannot write or remove {path} below {dest}: {error.strerror or error}",
            changed=bool(written or removed),
            written=written,
            removed=sorted(removed),
        )
    module.exit_json(changed=bool(written or removed), written=written, removed=sorted(removed))


if __name__ == "__main__":
    main()
