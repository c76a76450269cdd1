# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Lookup: the trainer's source files and their content hash, read on the controller."""

from __future__ import annotations

DOCUMENTATION = r"""
name: trainer_tree
short_description: List a source tree and hash its content
description:
  - Walks the given directory on the controller, skipping byte-code caches (C(__pycache__),
    C(*.pyc), C(*.pyo)) and hidden entries, and returns one dict with C(hash), C(files) and C(dirs).
  - C(hash) is C(sha256:) over every file's relative path and SHA-256 digest, directory by
    directory with names sorted, so it names the content only, not timestamps; an unchanged tree
    keeps its hash.
  - C(files) lists C(path) (O(prefix) and the relative path), C(mode) (C(0755) for an executable
    file, else C(0644)) and C(content_b64); C(dirs) lists the relative directories.
options:
  _terms:
    description: The directory to walk (C(~) is expanded); one result per directory given.
    type: list
    elements: path
    required: true
  prefix:
    description: Prepended to every relative path in C(files) (for example C(trainer/)).
    type: str
    default: ""
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Hash the trainer
  ansible.builtin.set_fact:
    tree: "{{ lookup('dflash.ct200.trainer_tree', playbook_dir ~ '/../trainer') }}"
"""

RETURN = r"""
_raw:
  description: One dict with hash, files and dirs.
  type: list
  elements: dict
"""

import base64
import hashlib
import os

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

SKIPPED_DIRS = {"__pycache__"}
SKIPPED_SUFFIXES = (".pyc", ".pyo")


def walk(root: str, prefix: str = "") -> dict:
    if not os.path.isdir(root):
        raise AnsibleLookupError(f"trainer source {root} is not a directory")
    files, dirs = [], []
    overall = hashlib.sha256()
    for current, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
        rel_dir = os.path.relpath(current, root)
        if rel_dir != ".":
            dirs.append(rel_dir)
        for name in sorted(names):
            if name.startswith(".") or name.endswith(SKIPPED_SUFFIXES):
                continue
            src = os.path.join(current, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            with open(src, "rb") as handle:
                data = handle.read()
            digest = hashlib.sha256(data).hexdigest()
            overall.update(f"{rel}\0{digest}\n".encode())
            mode = "0755" if os.access(src, os.X_OK) else "0644"
            files.append({"path": prefix + rel, "mode": mode, "content_b64": base64.b64encode(data).decode()})
    files.sort(key=lambda item: item["path"])
    return {"hash": "sha256:" + overall.hexdigest(), "files": files, "dirs": sorted(dirs)}


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        prefix = self.get_option("prefix") or ""
        return [walk(os.path.abspath(os.path.expanduser(str(term))), prefix) for term in terms]
