"""dflashctl: launch, inspect and stop DFlash training runs through the Ansible playbooks.

A thin Python face on ``playbooks/launch.yml``, ``status.yml`` and ``stop.yml``, run with
ansible-runner. Results are read from the runner's events (``runner_on_ok`` →
``res.ansible_facts`` and the ``set_stats`` data of ``playbook_on_stats``), never from
``Runner.get_fact_cache()``, which returns ``{}`` with ansible-core 2.19.

    from dflashctl import Controller
    ctl = Controller()                    # the checkout's inventory/local and .state/
    record = ctl.launch("nographs")       # the run record, with the trainer's PID
    ctl.status()["state"]                 # 'running', 'exited', 'not_ours' or 'none'
    ctl.stop()                            # SIGTERM, checkpoint, exit (SIGKILL after a timeout)

Failures raise :class:`PlaybookFailed` with the playbook's own messages (which GPU is busy, the
log tail of a trainer that died, the known runs for a bad name).
"""

from dflashctl.api import Controller, PlaybookFailed, PlaybookResult, Settings

__all__ = ["Controller", "PlaybookFailed", "PlaybookResult", "Settings"]
