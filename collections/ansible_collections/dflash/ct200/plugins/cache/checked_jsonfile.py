# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fact cache as a cache only: ansible-core's jsonfile, except that content which is not a valid
record never blocks a command. A host file that is not JSON, JSON of the wrong shape (say
``trainer_run: "garbage"``, which made every module that takes the record fail its argument
check), a directory, or a file in place of the cache directory is moved aside (never deleted) with
one warning line, and the host reads as having no cached facts: status, launch and stop then
rebuild the record from the target, which holds the truth (docs/ARCHITECTURE.md)."""

from __future__ import annotations

DOCUMENTATION = """
    name: checked_jsonfile
    short_description: JSON files per host, any content that is not a valid record set aside.
    description:
      - ansible-core's jsonfile cache (one JSON file per host, C(<prefix><schema>_<host>) since
        ansible-core 2.19, e.g. C(facts/s1_ct200)), except that a host file which cannot be read as
        a record of this project - not JSON, the wrong shape or types, a directory - is moved aside
        to C(<file>.set-aside-<UTC time>) with one warning, and the host reads as uncached.
      - A file where the cache directory should be is moved aside the same way, and the directory made.
    options:
      _uri:
        required: True
        description: Path in which the cache plugin will save the JSON files.
        env:
          - name: ANSIBLE_CACHE_PLUGIN_CONNECTION
        ini:
          - key: fact_caching_connection
            section: defaults
        type: path
      _prefix:
        description: User defined prefix to use when creating the JSON files.
        env:
          - name: ANSIBLE_CACHE_PLUGIN_PREFIX
        ini:
          - key: fact_caching_prefix
            section: defaults
      _timeout:
        default: 86400
        description: Expiration timeout for the cache plugin data.
        env:
          - name: ANSIBLE_CACHE_PLUGIN_TIMEOUT
        ini:
          - key: fact_caching_timeout
            section: defaults
        type: integer
"""

import json
import os
import time

from ansible.plugins.cache.jsonfile import CacheModule as JsonFileCache
from ansible.utils.display import Display

display = Display()

# ansible-core 2.19 wraps a host's facts as {"__payload__": "<the facts as a JSON string>"}.
PAYLOAD_KEY = "__payload__"
# The record's fields and the types every module that takes it checks (module_utils/trainer_record.py).
RECORD_TYPES = {
    "run_id": str,
    "run": str,
    "pid": int,
    "start_time": int,
    "boot_id": str,
    "log": str,
    "out": str,
    "state": str,
    "started_at": str,
}


def record_problem(facts: object) -> str | None:
    """What makes a host's cached facts unusable as this project's record, or None where they are fine."""
    if not isinstance(facts, dict):
        return f"its facts are {type(facts).__name__}, not a mapping"
    record = facts.get("trainer_run")
    if record is not None:
        if not isinstance(record, dict):
            return f"trainer_run is {type(record).__name__}, not a record"
        for field, kind in RECORD_TYPES.items():
            value = record.get(field)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                return f"trainer_run.{field} is {type(value).__name__}, not {kind.__name__}"
    pid = facts.get("trainer_pid")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool)):
        return f"trainer_pid is {type(pid).__name__}, not int"
    return None


def stored_problem(stored: object) -> str | None:
    """The same for a host file's whole content (the payload wrapper, then the facts in it)."""
    if isinstance(stored, dict) and isinstance(stored.get(PAYLOAD_KEY), str):
        try:
            return record_problem(json.loads(stored[PAYLOAD_KEY]))
        except ValueError:
            return "its payload is not JSON"
    if isinstance(stored, dict) and PAYLOAD_KEY not in stored:
        return record_problem(stored)  # a cache written without the wrapper
    return "it is not a cache file of this Ansible version"


def set_aside(path: str) -> str:
    """Move path out of the way (never delete): <path>.set-aside-<UTC time>[-N]. Returns the new
    name; raises OSError where it cannot be moved."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = f"{path}.set-aside-{stamp}"
    for attempt in range(1, 100):
        if not os.path.lexists(target):
            break
        target = f"{path}.set-aside-{stamp}-{attempt}"
    os.rename(path, target)
    return target


def say_set_aside(path: str, why: str) -> None:
    try:
        where = f"moved aside to {set_aside(path)}"
    except OSError as exc:
        where = f"and could not be moved aside ({exc.strerror}); it is ignored"
    display.warning(
        f"The controller's fact cache {path} {why}: {where}. It is only a cache: the run's record is "
        "rebuilt from the target."
    )


class CacheModule(JsonFileCache):
    def validate_cache_connection(self):
        directory = self._cache_dir
        if directory and os.path.lexists(directory) and not os.path.isdir(directory):
            say_set_aside(directory, "is not a directory")
        super().validate_cache_connection()

    def _load(self, filepath: str) -> object:
        try:
            stored = super()._load(filepath)
        except FileNotFoundError:
            raise
        except IsADirectoryError:
            why = "is a directory, not a file"
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            why = f"cannot be read as JSON ({type(exc).__name__})"
        else:
            problem = stored_problem(stored)
            if problem is None:
                return stored
            why = f"is not a valid record: {problem}"
        say_set_aside(filepath, why)
        raise FileNotFoundError(filepath)  # read as uncached: the target is asked instead
