# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Lookup: check a run on the controller with the trainer's own config loader (trainer/config.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: run_config
short_description: Validate a run profile, machine config and overrides with the trainer's own loader
description:
  - Loads C(config.py) of the trainer source on the controller (no torch, no import of the trainer
    package) and resolves the run exactly as the trainer will (profile, machine config, C(--set)
    overrides). The trainer owns the rules; nothing here repeats them.
  - Returns one dict with C(ok), C(problems) (every problem, one line each, naming the file or
    variable and the key), C(runs) (known run names and descriptions, also when a profile is not
    valid YAML), C(profile) (the profile's path) and, when valid, C(config) (the resolved sections),
    C(log_name), C(topology) and C(steps).
  - "It never fails itself: the role decides and words the error."
author:
  - DFlash CT 200 team (!UNKNOWN)
options:
  _terms:
    description: The run name.
    required: true
  source:
    description: The trainer package directory on the controller (holds config.py and runs/).
    type: path
    required: true
  machine:
    description: The machine config sections (the inventory's C(dflash_machine)).
    type: dict
    default: {}
  machine_label:
    description: How problems of the machine config name it.
    type: str
    default: inventory variable dflash_machine
  sets:
    description: C(section.key=value) overrides (C(--set)).
    type: list
    elements: str
    default: []
"""

RETURN = r"""
_raw:
  description: ok, problems, runs, profile, config, log_name, topology, steps.
  type: list
  elements: dict
"""

import importlib.util
import json
import os
import sys
import tempfile

import yaml
from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

MODULE_NAME = "dflash_trainer_config"


def load_config_module(source: str):
    """trainer/config.py as a module of its own (the trainer package's __init__ stays unimported)."""
    path = os.path.join(source, "config.py")
    if not os.path.isfile(path):
        raise AnsibleLookupError(f"{path} does not exist: dflash_trainer_source must be the trainer package")
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        run = terms[0] if terms else ""
        config = load_config_module(self.get_option("source"))
        result = {
            "ok": False,
            "problems": [],
            "runs": config.known_runs(),
            "profile": str(config.RUNS_DIR / f"{run}.yml"),
        }
        if not isinstance(run, str) or not config.RUN_NAME_RE.match(run) or run not in result["runs"]:
            result["problems"] = [f"unknown run {run!r}"]
            return [result]
        label = self.get_option("machine_label")
        with tempfile.TemporaryDirectory(prefix="dflash-check-") as scratch:
            machine_file = os.path.join(scratch, "machine.yml")
            with open(machine_file, "w", encoding="utf-8") as handle:
                # Plain types first: Ansible's own (tagged) strings and dicts are not YAML-representable.
                machine = json.loads(json.dumps(self.get_option("machine") or {}, default=str))
                yaml.safe_dump(machine, handle)
            try:
                cfg = config.load_config(run, machine_file, [str(item) for item in self.get_option("sets")])
            except config.ConfigError as exc:
                result["problems"] = [problem.replace(machine_file, label) for problem in exc.problems]
                return [result]
        result.update(
            ok=True,
            config=cfg.to_dict(),
            log_name=cfg.log_name,
            topology=cfg.run.topology,
            steps=cfg.train.steps,
        )
        return [result]
