#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Render the curves of one or more runs into one PNG (on the controller, with matplotlib)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: run_report
short_description: Render DFlash runs' loss, tau and tokens/s against step into one PNG
description:
  - Draws three panels (training loss, acceptance length tau, tokens per second, each against the
    step) with every run of O(runs) overlaid, and writes them to O(dest) as a PNG (written to a
    temporary file first, then renamed, so a reader never sees half a file).
  - Runs on the controller (delegate_to localhost) with the Python that has matplotlib.
  - In check mode, writes nothing.
options:
  runs:
    description: The runs, each C({label, series{train [[step, loss, tokens/s]], eval [[step, tau]]}}),
      as dflash.ct200.run_history returns them with a label added.
    type: list
    elements: dict
    required: true
  dest:
    description: The PNG to write.
    type: path
    required: true
  title:
    description: The figure's title.
    type: str
    default: DFlash runs
requirements:
  - matplotlib (pinned in requirements.txt)
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Render the report
  dflash.ct200.run_report:
    runs: "{{ runs }}"
    dest: "{{ playbook_dir }}/../.state/reports/report.png"
  delegate_to: localhost
"""

RETURN = r"""
path:
  description: The PNG written.
  type: str
  returned: always
size:
  description: Its size in bytes (0 in check mode).
  type: int
  returned: always
"""

import os
import tempfile

from ansible.module_utils.basic import AnsibleModule


def render(runs: list[dict], dest: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_ax, tau_ax, speed_ax) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for run in runs:
        train = [row for row in run["series"].get("train") or [] if row[1] is not None]
        evals = run["series"].get("eval") or []
        label = run["label"]
        if train:
            loss_ax.plot([r[0] for r in train], [r[1] for r in train], label=label, linewidth=1)
            speed = [r for r in train if r[2] is not None]
            speed_ax.plot([r[0] for r in speed], [r[2] for r in speed], label=label, linewidth=1)
        if evals:
            tau_ax.plot([r[0] for r in evals], [r[1] for r in evals], marker="o", markersize=3, label=label)
    loss_ax.set_ylabel("training loss")
    tau_ax.set_ylabel("acceptance length τ")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    for axis in (loss_ax, tau_ax, speed_ax):
        axis.grid(True, alpha=0.3)
        axis.legend(loc="best", fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    directory = os.path.dirname(dest)
    handle, temporary = tempfile.mkstemp(prefix=".report-", suffix=".png", dir=directory)
    os.close(handle)
    try:
        figure.savefig(temporary, format="png", dpi=100)
        os.chmod(temporary, 0o644)
        os.replace(temporary, dest)
    finally:
        plt.close(figure)
        if os.path.exists(temporary):
            os.unlink(temporary)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "runs": {"type": "list", "elements": "dict", "required": True},
            "dest": {"type": "path", "required": True},
            "title": {"type": "str", "default": "DFlash runs"},
        },
        supports_check_mode=True,
    )
    runs, dest = module.params["runs"], module.params["dest"]
    if not runs or any("label" not in run or not isinstance(run.get("series"), dict) for run in runs):
        module.fail_json(msg="run_report: runs must be a non-empty list of {label, series} entries")
    if not dest.endswith(".png"):
        module.fail_json(msg=f"run_report: dest {dest} must end in .png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        module.fail_json(
            msg="matplotlib is missing from the controller's Python: pip install -r requirements.txt "
            "(it pins matplotlib) into the venv that runs ansible-playbook"
        )
    if module.check_mode:
        module.exit_json(changed=True, path=dest, size=0)
    try:
        os.makedirs(os.path.dirname(dest), mode=0o750, exist_ok=True)
        render(runs, dest, module.params["title"])
    except OSError as exc:
        module.fail_json(msg=f"cannot write the report {dest}: {exc.strerror}")
    module.exit_json(changed=True, path=dest, size=os.path.getsize(dest))


if __name__ == "__main__":
    main()
