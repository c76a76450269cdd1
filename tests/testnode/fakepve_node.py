"""fakepve as the test node's Proxmox API: container tasks act on real LXC containers.

Run by testnode.py inside the node's mount namespace (so the API and the `pct` shim see the same
/dev and /usr/sbin/pct). Serves https on loopback and a control socket (JSON lines, root only) that
the `pct` shim and the tests use: read and change a CT config as root@pam would, power actions,
and fault injection (node offline, CT locked, a task that ends in an error).

The API token secret and the password come from the environment, never from a file or argv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from fakepve import FakePve
from fakepve.certs import make_cert
from fakepve.model import TaskError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lxcnode import LxcNode, NodeError

NODE = "pve1"
ROOT = "root@pam"
TASK_WAIT_STEPS = 600


class NodePve(FakePve):
    """A FakePve whose container create/start/stop/destroy tasks also do it to a real LXC container."""

    def __init__(self, lxc: LxcNode, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lxc = lxc
        self._ostemplates: dict[int, str] = {}
        # Task type -> message: the next task of that type ends with TASK ERROR (fault injection).
        self.failing_tasks: dict[str, str] = {}

    async def _lxc_create(self, user, v):
        self._ostemplates[int(v["vmid"])] = str(v.get("ostemplate", ""))
        return await super()._lxc_create(user, v)

    async def task(self, node, ttype, tid, user, body, vm=None, lock=True, log=()):
        async def real_body():
            try:
                if ttype in self.failing_tasks:
                    raise TaskError(self.failing_tasks.pop(ttype))
                note = await body()
                try:
                    await asyncio.to_thread(self._apply_to_lxc, ttype, int(tid))
                except NodeError as exc:
                    raise TaskError(f"test node: {exc}") from exc
            except TaskError:
                if ttype in ("vzcreate", "vzrestore"):
                    # As PVE: a failed create leaves no config behind (and here no LXC container).
                    await asyncio.to_thread(self._undo_create, int(tid))
                raise
            return note

        return await super().task(node, ttype, tid, user, real_body, vm=vm, lock=lock, log=log)

    def _undo_create(self, vmid: int) -> None:
        ct = self.ct(vmid)
        if ct is not None:
            self._drop(ct)
        self.lxc.destroy(vmid)

    def _apply_to_lxc(self, ttype: str, vmid: int) -> None:
        ct = self.ct(vmid)
        if ttype in ("vzcreate", "vzrestore") and ct is not None:
            self.lxc.create(vmid, self._ostemplates.pop(vmid, ""), dict(ct.config))
            if ct.status == "running":
                self.lxc.start(vmid, dict(ct.config))
        elif ttype == "vzstart" and ct is not None:
            try:
                self.lxc.start(vmid, dict(ct.config))
            except NodeError:
                ct.status, ct.pid = "stopped", None
                raise
        elif ttype in ("vzstop", "vzshutdown", "vzsuspend"):
            self.lxc.stop(vmid)
        elif ttype == "vzreboot" and ct is not None:
            self.lxc.stop(vmid)
            self.lxc.start(vmid, dict(ct.config))
        elif ttype == "vzdestroy":
            self.lxc.destroy(vmid)

    # ------------------------------------------------------------- control

    async def control(self, request: dict[str, Any]) -> Any:
        op = request.get("op")
        vmid = int(request.get("vmid", 0) or 0)
        values = {"node": NODE, "vmid": vmid}
        if op == "config":
            return await self._lxc_config_get(ROOT, dict(values, current=request.get("current")))
        if op == "set":
            await self._lxc_config_put(ROOT, dict(values, **request.get("values", {})))
            ct = self.ct(vmid)
            # The LXC config follows the current config; pending entries wait for the next start.
            await asyncio.to_thread(self.lxc.write_config, vmid, dict(ct.config))
            return None
        if op == "power":
            action = request["action"]
            handler = {
                "start": self._lxc_start,
                "stop": self._lxc_stop,
                "shutdown": self._lxc_shutdown,
                "reboot": self._lxc_reboot,
            }[action]
            upid = await handler(ROOT, values)
            return await self._wait_task(upid)
        if op == "state":
            return {
                "nodes": self.nodes,
                "tasks": [{k: t.get(k) for k in ("type", "id", "user", "exitstatus")} for t in self.tasklog],
                "cts": {
                    ct.vmid: {"status": ct.status, "config": ct.config, "pending": ct.pending}
                    for ct in self.cts
                },
            }
        if op == "node_offline":
            self.set_node_offline(request.get("node", NODE), bool(request.get("offline", True)))
            return None
        if op == "lock":
            ct = self.ct(vmid)
            if request.get("lock"):
                ct.lock = request["lock"]
            else:
                ct.lock = None
            return None
        if op == "fail_task":
            self.failing_tasks[request["type"]] = request["message"]
            return None
        if op == "clear_faults":
            self.failing_tasks.clear()
            self.failures.clear()
            for name in self.nodes:
                self.set_node_offline(name, False)
            return None
        raise ValueError(f"unknown control op {op!r}")

    async def _wait_task(self, upid: str) -> str:
        task = self.tasks[upid]
        for _ in range(TASK_WAIT_STEPS):
            if task["status"] == "stopped":
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"task {upid} still running after {TASK_WAIT_STEPS / 10:.0f}s")
        if task["exitstatus"] != "OK":
            raise RuntimeError(task["exitstatus"])
        return upid


async def serve_control(pve: NodePve, path: Path) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            try:
                answer = {"ok": True, "data": await pve.control(json.loads(line))}
            except Exception as exc:  # every failure goes back to the caller as text
                message = getattr(exc, "message", None) or str(exc)
                answer = {"ok": False, "error": message.strip()}
            writer.write(json.dumps(answer, default=sorted).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    if path.exists():
        path.unlink()
    server = await asyncio.start_unix_server(handle, path=str(path))
    path.chmod(0o600)
    return server


async def main_async(args: argparse.Namespace) -> None:
    state = Path(args.state_dir)
    lxc = LxcNode(
        lxcpath=state / "lxc",
        templates=Path(args.templates),
        gpu_state_dir=state / "gpu",
        nvidia_smi=Path(__file__).resolve().parent / "nvidia-smi",
        extra_binds=tuple(tuple(b.split(":", 1)) for b in args.bind),
    )
    password = os.environ["TESTNODE_PVE_PASSWORD"]
    pve = NodePve(lxc, user=ROOT, password=password, host=args.host, port=args.port)
    # Tasks run in the background as on PVE (the request returns the UPID at once; LXC work takes
    # seconds); PVE's own waits (lock timeouts, shutdowns) shrink a thousandfold.
    pve.time_scale = 0.001
    token_id, token_secret = os.environ.get("TESTNODE_TOKEN_ID"), os.environ.get("TESTNODE_TOKEN_SECRET")
    if token_id and token_secret:
        pve.apitokens[token_id] = token_secret
    for template in sorted(Path(args.templates).glob("*.tar.gz")):
        pve.store_file("local", template.name, template.stat().st_size, content="vztmpl")
    certfile, keyfile, _ = make_cert(str(state), hosts=(args.host,))
    await pve.start(certfile, keyfile)
    await serve_control(pve, state / "control.sock")
    print(f"fakepve listening on https://{args.host}:{pve.port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--templates", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bind", action="append", default=[], help="HOST:INSIDE read-only bind for every CT")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
