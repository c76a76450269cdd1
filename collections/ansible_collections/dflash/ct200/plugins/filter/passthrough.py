# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters of the pve_passthrough role: the NVIDIA device nodes of a GPU list, their numbers as
`stat` reports them, the container's device and mount entries wanted, and the `pct set` that makes
the container's config match them. The role reads and writes; these compute."""

from __future__ import annotations

import re

# Device nodes every GPU container needs besides one /dev/nvidiaN per GPU.
NVIDIA_CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
# The entries this role owns in `pct config`: device passthrough (devN) and mount points (mpN).
PASSTHROUGH_KEY_RE = re.compile(r"^(dev|mp)[0-9]+$")


def nvidia_devices(gpus: list) -> list[str]:
    """/dev/nvidiaN for each GPU index, then the control devices; none for no GPUs (a CPU container)."""
    gpus = list(gpus or [])
    if not gpus:
        return []
    return [f"/dev/nvidia{int(index)}" for index in gpus] + list(NVIDIA_CONTROL_DEVICES)


def device_numbers(stat_lines: list[str]) -> dict:
    """{path: {major, minor}} of the character devices among `stat -c '%n %F %t %T'` lines (the
    numbers in hex, as stat prints them); other lines (a missing path, a regular file) are left out."""
    found = {}
    for line in stat_lines or []:
        if "character special file" not in line:
            continue
        parts = line.split(" ")
        found[parts[0]] = {"major": int(parts[-2], 16), "minor": int(parts[-1], 16)}
    return found


def passthrough_mounts(mounts: list) -> list[dict]:
    """The mounts with their documented defaults filled in: readonly and create false."""
    return [{"readonly": False, "create": False, **mount} for mount in mounts or []]


def passthrough_entries(gpus: list, mounts: list, device_mode: str = "0666") -> dict:
    """The devN and mpN entries the container's config should hold, in order: one per device node
    (nvidia_devices) with the mode inside the container, one per host folder mount."""
    wanted = {}
    for index, path in enumerate(nvidia_devices(gpus)):
        wanted[f"dev{index}"] = f"{path},mode={device_mode}"
    for index, mount in enumerate(mounts or []):
        readonly = ",ro=1" if mount.get("readonly") else ""
        wanted[f"mp{index}"] = f"{mount['host']},mp={mount['path']}{readonly}"
    return wanted


def pct_entries(config_lines: list[str]) -> dict:
    """{key: value} of the devN and mpN lines of `pct config` output."""
    entries = {}
    for line in config_lines or []:
        key, sep, value = line.partition(": ")
        if sep and PASSTHROUGH_KEY_RE.match(key):
            entries[key] = value
    return entries


def pct_changes(config_lines: list[str], wanted: dict, vmid) -> dict:
    """What `pct set` must change for the config (`pct config` lines) to hold exactly the wanted
    devN/mpN entries: {"set": {key: value}, "delete": [keys], "argv": the command, or [] when
    nothing differs}."""
    current = pct_entries(config_lines)
    to_set = {key: value for key, value in wanted.items() if current.get(key) != value}
    to_delete = sorted(set(current) - set(wanted))
    argv = []
    if to_set or to_delete:
        argv = ["pct", "set", str(vmid)]
        for key, value in to_set.items():
            argv += [f"--{key}", value]
        if to_delete:
            argv += ["--delete", ",".join(to_delete)]
    return {"set": to_set, "delete": to_delete, "argv": argv}


class FilterModule:
    def filters(self):
        return {
            "nvidia_devices": nvidia_devices,
            "device_numbers": device_numbers,
            "passthrough_mounts": passthrough_mounts,
            "passthrough_entries": passthrough_entries,
            "pct_changes": pct_changes,
        }
