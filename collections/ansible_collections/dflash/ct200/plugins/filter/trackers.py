# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters of the workspace role for the experiment trackers of `log.report_to`: the pip packages
the trackers a run reports to need, and the shell lines of <workspace>/tracker_env (mode 0600)
that run.sh sources to hand their credentials to the trainer. The role writes; these compute."""

from __future__ import annotations

import re
import shlex

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def report_to(log) -> list[str]:
    """The trackers a run reports to, from its resolved `log` section (run_profile_data.log, the
    trainer's own loader's result): log.report_to, and tensorboard where log.tensorboard is true."""
    log = log if isinstance(log, dict) else {}
    names = [str(name) for name in log.get("report_to") or []]
    if log.get("tensorboard") is True:
        names.append("tensorboard")
    return list(dict.fromkeys(names))


def tracker_requirements(names, packages, already=None) -> list[str]:
    """The pinned packages of these trackers (packages: tracker -> list of requirements), once
    each, leaving out those already in the list `already`."""
    out: list[str] = list(already or [])
    for name in names or []:
        out.extend(requirement for requirement in (packages or {}).get(name, []) if requirement not in out)
    return out[len(already or []) :]


def tracker_env_file(env) -> str:
    """`export NAME='value'` lines for the credentials that are set (empty ones are left out); ''
    where none is. Values are quoted for the shell, so any character is kept as it is."""
    lines = []
    for name, value in sorted((env or {}).items()):
        if not NAME_RE.match(str(name)):
            raise ValueError(f"tracker credentials: {name!r} is not a shell variable name")
        if value is None or str(value) == "":
            continue
        lines.append(f"export {name}={shlex.quote(str(value))}")
    if not lines:
        return ""
    return (
        "# The experiment trackers' credentials (log.report_to), sourced by run.sh.\n"
        + "\n".join(lines)
        + "\n"
    )


class FilterModule:
    def filters(self):
        return {
            "report_to": report_to,
            "tracker_requirements": tracker_requirements,
            "tracker_env_file": tracker_env_file,
        }
