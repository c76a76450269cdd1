"""The dflash test node: a stand-in Proxmox VE node on loopback, for the real-host path's tests.

    testnode.py start    fakepve (the API) + sshd (with a private `pct`) in the node's own mount
                         namespace, LXC containers for its CTs, an nvidia-smi stand-in inside them
    testnode.py status   what runs, as JSON
    testnode.py stop     stop everything it started (by PID), destroy its containers, remove its state
    testnode.py gpus     write the GPU state the stand-in reports (idle, or some GPUs busy)
    testnode.py fault    inject a fault into the API (node offline, CT locked, a failing task), or clear
    testnode.py env      the environment (no secret) and inventory values for using the node by hand

The API token (PROXMOX_USER, PROXMOX_TOKEN_ID, PROXMOX_TOKEN_SECRET) and password (PROXMOX_PASSWORD) the
node accepts come from the environment of `start`; they are never written to a file. See README.md.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lxcnode import LxcNode, NodeError  # noqa: E402

CACHE = Path(os.environ.get("TESTNODE_CACHE", "/var/cache/dflash-testnode"))
DEFAULT_STATE = Path(os.environ.get("TESTNODE_STATE", "/run/dflash-testnode"))
SUITE = "bookworm"
MIRROR = os.environ.get("TESTNODE_MIRROR", "http://deb.debian.org/debian")
TEMPLATE = "debian-12-dflash_12.0-1_amd64.tar.gz"
# python3-dev, gcc and g++: torch.compile builds its kernels with them (as on a real CT).
ROOTFS_PACKAGES = "python3,python3-venv,python3-packaging,python3-dev,gcc,g++,procps,tini,ca-certificates"
LOOPBACK = "127.0.0.1"
TOKEN_USER_DEFAULT = "root@pam"
# Binds every test container gets read-only: the host's wheel folder (pip's find-links here).
WHEELS = "/opt/wheels"
NVIDIA_MAJOR = 195
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 15
PR_SET_CHILD_SUBREAPER = 36
# Tools a CT's commands use and the node never does: on the node they are tripwires.
NODE_TRIPWIRES = ("apt", "apt-get", "apt-cache", "apt-key", "dpkg", "dpkg-query", "pip", "pip3")
NODE_COMMANDS_LOG = "commands-on-node.log"


# ------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def wait_port(port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=1):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def end_process(pid: int, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM one process by PID, SIGKILL it if it is still there after timeout."""
    if not alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def lxc_node(state: Path) -> LxcNode:
    return LxcNode(
        lxcpath=state / "lxc", templates=CACHE, gpu_state_dir=state / "gpu", nvidia_smi=HERE / "nvidia-smi"
    )


def control(state: Path, request: dict[str, Any]) -> Any:
    """One request to the node's API control socket (see fakepve_node.py)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(str(state / "control.sock"))
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data)
    if not answer["ok"]:
        raise NodeError(answer["error"])
    return answer["data"]


# ----------------------------------------------------------------- template


def ensure_template() -> Path:
    """The container template: a debootstrap Debian 12 with python3, built once into the cache.

    Two nodes may start at once (two test runs on one machine, each with its own state): the first
    builds under the cache's lock, the second waits for it and takes its tarball.
    """
    tarball = CACHE / TEMPLATE
    packed_with = CACHE / (TEMPLATE + ".packages")
    if tarball.is_file() and packed_with.exists() and packed_with.read_text() == ROOTFS_PACKAGES:
        return tarball
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tarball.is_file() and packed_with.exists() and packed_with.read_text() == ROOTFS_PACKAGES:
            return tarball  # built by the node that held the lock before us
        return build_template(tarball, packed_with)


def build_template(tarball: Path, packed_with: Path) -> Path:
    """The cached rootfs (debootstrap the first time) packed into the template; under the lock."""
    rootfs = CACHE / f"rootfs-{SUITE}"
    marker = rootfs / ".testnode-packages"
    if rootfs.exists() and (not marker.exists() or marker.read_text() != ROOTFS_PACKAGES):
        # An older cached rootfs: add what the package list gained, without a new debootstrap.
        subprocess.run(["chroot", str(rootfs), "apt-get", "update", "-qq"], check=True)
        packages = ROOTFS_PACKAGES.split(",")
        subprocess.run(
            ["chroot", str(rootfs), "apt-get", "install", "-y", "-qq", *packages],
            check=True,
            stdout=subprocess.DEVNULL,
            env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
        )
        subprocess.run(["chroot", str(rootfs), "apt-get", "clean"], check=True)
        marker.write_text(ROOTFS_PACKAGES)
    if not (rootfs / "usr/bin/python3").exists():
        building = CACHE / f"rootfs-{SUITE}.partial"
        shutil.rmtree(building, ignore_errors=True)
        print(f"testnode: debootstrap {SUITE} into {building} (first run only)", file=sys.stderr)
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={ROOTFS_PACKAGES}",
                SUITE,
                str(building),
                MIRROR,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (building / ".testnode-packages").write_text(ROOTFS_PACKAGES)
        building.rename(rootfs)
    partial = tarball.with_suffix(".partial")
    subprocess.run(
        ["tar", "-C", str(rootfs), "--numeric-owner", "-I", "gzip -1", "-cf", str(partial), "."], check=True
    )
    partial.rename(tarball)
    packed_with.write_text(ROOTFS_PACKAGES)
    return tarball


# --------------------------------------------------------------- node init


def make_node_dev(state: Path, uvm_major: int, gpu_count: int) -> None:
    """A private /dev for the node namespace: the host's nodes plus NVIDIA ones (no driver behind them).

    The GPU passthrough step reads device majors on the node and `pct set --devN` needs the paths to
    exist; only this namespace sees them.
    """
    newdev = state / "dev"
    newdev.mkdir(exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "mode=0755,nosuid", "testnode-dev", str(newdev)], check=True
    )
    for entry in os.scandir("/dev"):
        target = newdev / entry.name
        if entry.is_symlink():
            target.symlink_to(os.readlink(entry.path))
        elif entry.is_dir(follow_symlinks=False):
            target.mkdir()
            subprocess.run(["mount", "--rbind", entry.path, str(target)], check=True)
        else:
            st = entry.stat(follow_symlinks=False)
            if st.st_mode & 0o170000 in (0o020000, 0o060000):
                os.mknod(target, st.st_mode, st.st_rdev)
    for index in range(gpu_count):
        os.mknod(newdev / f"nvidia{index}", 0o020666, os.makedev(NVIDIA_MAJOR, index))
    os.mknod(newdev / "nvidiactl", 0o020666, os.makedev(NVIDIA_MAJOR, 255))
    os.mknod(newdev / "nvidia-uvm", 0o020666, os.makedev(uvm_major, 0))
    os.mknod(newdev / "nvidia-uvm-tools", 0o020666, os.makedev(uvm_major, 1))
    subprocess.run(["mount", "--move", str(newdev), "/dev"], check=True)


def reap_orphans(exclude: set[int]) -> None:
    """Collect exited orphans (LXC monitors) without touching the children we wait for ourselves."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            os.waitpid(int(entry.name), os.WNOHANG)


def node_init(args: argparse.Namespace) -> int:
    """PID 1 of the node: runs inside `unshare --mount`, sets the mounts up, runs the API and sshd."""
    state = Path(args.state_dir)
    info = json.loads((state / "testnode.json").read_text())
    # Containers' LXC monitors daemonize; as subreaper this process reaps them instead of leaving
    # zombies with the host's init.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    subprocess.run(
        [
            "mount",
            "-t",
            "overlay",
            "testnode-sbin",
            "-o",
            f"lowerdir={state / 'sbin'}:/usr/sbin",
            "/usr/sbin",
        ],
        check=True,
    )
    subprocess.run(
        [
            "mount",
            "-t",
            "overlay",
            "testnode-bin",
            "-o",
            f"lowerdir={state / 'bin'}:/usr/bin",
            "/usr/bin",
        ],
        check=True,
    )
    make_node_dev(state, info["uvm_major"], info["gpu_count"])
    log = open(state / "node.log", "ab")  # noqa: SIM115 - open for the children's whole life
    api = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "fakepve_node.py"),
            "--state-dir",
            str(state),
            "--templates",
            str(CACHE),
            "--host",
            LOOPBACK,
            "--port",
            str(info["api_port"]),
            "--bind",
            f"{WHEELS}:{WHEELS}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    sshd = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e", "-f", str(state / "sshd_config")],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    (state / "children.json").write_text(json.dumps({"api": api.pid, "sshd": sshd.pid}))
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    while not stopping and api.poll() is None and sshd.poll() is None:
        reap_orphans(exclude={api.pid, sshd.pid})
        time.sleep(0.2)
    for child in (sshd, api):
        end_process(child.pid)
        child.wait(timeout=STOP_TIMEOUT_S)
    return 0


# ------------------------------------------------------------------ commands


def new_key(path: Path, comment: str) -> None:
    """A passphrase-less ed25519 key pair made for this node only."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True
    )


def write_sshd(state: Path, port: int) -> None:
    new_key(state / "ssh_host_ed25519_key", "testnode-host")
    new_key(state / "id_ed25519", "testnode-client")
    shutil.copyfile(state / "id_ed25519.pub", state / "authorized_keys")
    host_key = (state / "ssh_host_ed25519_key.pub").read_text().split()[:2]
    (state / "known_hosts").write_text(f"[{LOOPBACK}]:{port} {' '.join(host_key)}\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    (state / "sshd_config").write_text(
        f"Port {port}\nListenAddress {LOOPBACK}\nHostKey {state / 'ssh_host_ed25519_key'}\n"
        f"AuthorizedKeysFile {state / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        f"PidFile {state / 'sshd.pid'}\nMaxSessions 50\nMaxStartups 50\nLogLevel ERROR\n"
        "Subsystem sftp internal-sftp\n"
    )


def write_node_tripwires(state: Path) -> None:
    """Package tools that fail and leave a line in <state>/commands-on-node.log when run on the node.

    A command meant for a CT that reaches the node's shell instead (an unquoted script through
    `pct exec`) must fail a test on every machine, also on one whose host has every package the
    command looks for. The node itself never needs these tools; the CTs have their own /usr/bin.
    """
    bin_dir = state / "bin"
    bin_dir.mkdir()
    log = state / NODE_COMMANDS_LOG
    log.touch()
    for name in NODE_TRIPWIRES:
        tripwire = bin_dir / name
        tripwire.write_text(
            "#!/bin/sh\n"
            f"printf '%s\\n' \"{name} $*\" >> {log}\n"
            f"echo \"test node: '{name} $*' ran on the Proxmox node itself, not in a container:"
            ' a command meant for a CT must reach it whole through pct exec" >&2\n'
            "exit 97\n"
        )
        tripwire.chmod(0o755)


def commands_on_node(state: Path) -> list[str]:
    """What the node's tripwires caught (see write_node_tripwires), oldest first."""
    log = state / NODE_COMMANDS_LOG
    return log.read_text().splitlines() if log.exists() else []


def write_pct_wrapper(state: Path) -> None:
    sbin = state / "sbin"
    sbin.mkdir()
    wrapper = sbin / "pct"
    wrapper.write_text(
        f'#!/bin/sh\nTESTNODE_HOME={HERE} TESTNODE_STATE={state} exec /usr/bin/python3 {HERE / "pct"} "$@"\n'
    )
    wrapper.chmod(0o755)


def write_gpus(state: Path, count: int, busy: list[int]) -> None:
    gpus, apps = [], []
    for index in range(count):
        uuid = f"GPU-7590547c-d9a8-b760-1c4e-93ce4dbbb{index:03x}"
        gpu: dict[str, Any] = {
            "index": index,
            "uuid": uuid,
            "name": "NVIDIA H200",
            "memory_total_mib": 143771,
            "memory_used_mib": 0,
            "utilization_gpu": 0,
        }
        if index in busy:
            # The reference capture: one python3 process holding ~21 GB and running matmuls.
            gpu.update(memory_used_mib=21363, utilization_gpu=100)
            apps.append(
                {"pid": 425 + index, "gpu_uuid": uuid, "process_name": "python3", "used_memory_mib": 21354}
            )
        gpus.append(gpu)
    target = state / "gpu" / "state.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps({"gpus": gpus, "apps": apps}, indent=1))
    partial.rename(target)


def cmd_start(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if (state / "testnode.json").exists():
        print(f"testnode: already started ({state}); run `testnode.py stop` first", file=sys.stderr)
        return 2
    ensure_template()
    password = os.environ.get("PROXMOX_PASSWORD") or secrets.token_urlsafe(24)
    user = os.environ.get("PROXMOX_USER", TOKEN_USER_DEFAULT)
    token_id = os.environ.get("PROXMOX_TOKEN_ID")
    env = dict(os.environ, TESTNODE_PVE_PASSWORD=password)
    if token_id and os.environ.get("PROXMOX_TOKEN_SECRET"):
        env.update(
            TESTNODE_TOKEN_ID=f"{user}!{token_id}", TESTNODE_TOKEN_SECRET=os.environ["PROXMOX_TOKEN_SECRET"]
        )
    state.mkdir(parents=True, mode=0o700)
    try:
        (state / "lxc").mkdir()
        (state / "gpu").mkdir()
        # Host folders for the CT's mount points: a dataset folder (must exist) and room for the workspace.
        (state / "host" / "datasets").mkdir(parents=True)
        write_gpus(state, args.gpus, [])
        info = {
            "state_dir": str(state),
            "api_host": LOOPBACK,
            "api_port": free_port(),
            "ssh_host": LOOPBACK,
            "ssh_port": free_port(),
            "ssh_user": "root",
            "ssh_key": str(state / "id_ed25519"),
            "cafile": str(state / "fakepve.crt"),
            "node": "pve1",
            "storage": "local",
            "template": f"local:vztmpl/{TEMPLATE}",
            "gpu_count": args.gpus,
            "uvm_major": args.uvm_major,
        }
        write_sshd(state, info["ssh_port"])
        write_pct_wrapper(state)
        write_node_tripwires(state)
        (state / "testnode.json").write_text(json.dumps(info, indent=1))
        with open(state / "node.log", "ab") as log:
            init = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "--",
                    sys.executable,
                    str(HERE / "testnode.py"),
                    "_node",
                    "--state-dir",
                    str(state),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        info["init_pid"] = init.pid
        (state / "testnode.json").write_text(json.dumps(info, indent=1))
        deadline = time.monotonic() + START_TIMEOUT_S
        if not (wait_port(info["api_port"], deadline) and wait_port(info["ssh_port"], deadline)):
            raise NodeError(
                "the API or sshd did not come up; see "
                + str(state / "node.log")
                + ":\n"
                + (state / "node.log").read_text()[-2000:]
            )
    except BaseException:
        cmd_stop(args)
        raise
    print(json.dumps(info, indent=1))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if not state.exists():
        return 0
    info_file = state / "testnode.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    problems = []
    # Containers first, while the node init is still there to reap their LXC monitors.
    lxc = lxc_node(state)
    if (state / "lxc").exists():
        for ct in sorted((state / "lxc").iterdir()):
            try:
                lxc.destroy(int(ct.name))
            except Exception as exc:  # keep going: the processes below must end whatever happens here
                problems.append(f"{ct}: {exc}")
    if info.get("init_pid"):
        end_process(info["init_pid"])
    children = state / "children.json"
    if children.exists():
        for pid in json.loads(children.read_text()).values():
            end_process(pid)
    if problems:
        print("testnode: left behind:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    shutil.rmtree(state)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    if not (state / "testnode.json").exists():
        print(json.dumps({"running": False}))
        return 3
    info = json.loads((state / "testnode.json").read_text())
    children = json.loads((state / "children.json").read_text()) if (state / "children.json").exists() else {}
    info["processes"] = {
        name: {"pid": pid, "alive": alive(pid)}
        for name, pid in dict(children, init=info.get("init_pid")).items()
        if pid
    }
    lxc = lxc_node(state)
    info["containers"] = {
        ct.name: lxc.state(int(ct.name))
        for ct in sorted((state / "lxc").iterdir())
        if lxc.exists(int(ct.name))
    }
    info["running"] = all(p["alive"] for p in info["processes"].values())
    info["commands_on_node"] = commands_on_node(state)
    print(json.dumps(info, indent=1))
    return 0 if info["running"] else 1


def cmd_gpus(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    info = json.loads((state / "testnode.json").read_text())
    write_gpus(state, info["gpu_count"], args.busy)
    return 0


def cmd_fault(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    requests = {
        "node-offline": {"op": "node_offline", "offline": True},
        "node-online": {"op": "node_offline", "offline": False},
        "lock": {"op": "lock", "vmid": args.vmid, "lock": args.value or "backup"},
        "unlock": {"op": "lock", "vmid": args.vmid, "lock": None},
        "fail-task": {
            "op": "fail_task",
            "type": args.value or "vzcreate",
            "message": args.message or "unable to create CT - rbd error: connection timed out",
        },
        "clear": {"op": "clear_faults"},
    }
    control(state, requests[args.fault])
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    info = json.loads((Path(args.state_dir) / "testnode.json").read_text())
    print(f"export PROXMOX_HOST={info['api_host']}:{info['api_port']}")
    print(f"export REQUESTS_CA_BUNDLE={info['cafile']}")
    print(
        f"# inventory: ansible_host={info['ssh_host']} ansible_port={info['ssh_port']} "
        f"ansible_user={info['ssh_user']} ansible_ssh_private_key_file={info['ssh_key']}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", default=str(DEFAULT_STATE))
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start")
    start.add_argument("--gpus", type=int, default=8, help="GPUs the node (and nvidia-smi) has (default 8)")
    start.add_argument("--uvm-major", type=int, default=509, help="nvidia-uvm's major on this node")
    sub.add_parser("stop")
    sub.add_parser("status")
    sub.add_parser("env")
    gpus = sub.add_parser("gpus")
    gpus.add_argument("--busy", type=int, nargs="*", default=[], help="indices of busy GPUs (none: all idle)")
    fault = sub.add_parser("fault")
    fault.add_argument(
        "fault", choices=["node-offline", "node-online", "lock", "unlock", "fail-task", "clear"]
    )
    fault.add_argument("--vmid", type=int, default=200)
    fault.add_argument("--value", help="lock name, or task type for fail-task (default vzcreate)")
    fault.add_argument("--message", help="the TASK ERROR text for fail-task")
    node = sub.add_parser("_node")
    node.add_argument("--state-dir", required=True)
    args = parser.parse_args()
    commands = {
        "start": cmd_start,
        "stop": cmd_stop,
        "status": cmd_status,
        "gpus": cmd_gpus,
        "fault": cmd_fault,
        "env": cmd_env,
        "_node": node_init,
    }
    try:
        return commands[args.command](args)
    except NodeError as exc:
        print(f"testnode: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
