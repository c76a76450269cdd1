"""The real-container half of the test node: CT configs in PVE's format turned into LXC containers.

Standard library only: the `pct` shim imports it with the node's system Python. A container lives in
the test node's own LXC path (never /var/lib/lxc), named by its vmid as PVE names them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

LXC_TIMEOUT_S = 30
# Where the nvidia-smi stand-in reads the GPU states inside the container (a read-only bind mount).
GPU_STATE_MOUNT = "var/lib/testnode-gpu"
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class NodeError(RuntimeError):
    """A container operation of the test node failed; the message says which and why."""


@dataclass(frozen=True)
class LxcNode:
    """The LXC side of the test node.

    lxcpath: the node's private LXC path. templates: folder holding the `local` storage's vztmpl
    files. gpu_state_dir: host folder with the GPU state file, bind-mounted read-only into every
    container. extra_binds: (host path, path in container) read-only binds every container gets
    (the local wheel folder, so pip inside finds the CPU torch wheel as on the host).
    nvidia_smi: the stand-in installed as /usr/local/bin/nvidia-smi in each new container.
    """

    lxcpath: Path
    templates: Path
    gpu_state_dir: Path
    nvidia_smi: Path
    extra_binds: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def _run(self, *argv: str) -> str:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=LXC_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise NodeError(f"{' '.join(argv[:2])} did not finish within {LXC_TIMEOUT_S}s") from None
        if proc.returncode != 0:
            raise NodeError(f"{' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
        return proc.stdout

    def ct_dir(self, vmid: int) -> Path:
        return self.lxcpath / str(vmid)

    def exists(self, vmid: int) -> bool:
        return (self.ct_dir(vmid) / "config").is_file()

    def state(self, vmid: int) -> str:
        """running or stopped (what `pct status` prints), from LXC itself."""
        if not self.exists(vmid):
            raise NodeError(f"Configuration file 'nodes/pve1/lxc/{vmid}.conf' does not exist")
        out = self._run("lxc-info", "-P", str(self.lxcpath), "-n", str(vmid), "-s", "-H")
        return "running" if out.strip() == "RUNNING" else "stopped"

    def create(self, vmid: int, ostemplate: str, config: dict[str, str]) -> None:
        """Unpack the template volume into a new rootfs and write the LXC config."""
        if str(config.get("unprivileged", "0")) in ("1", "true"):
            raise NodeError("the test node runs privileged containers only: set unprivileged to false")
        name = ostemplate.partition(":")[2].removeprefix("vztmpl/")
        tarball = self.templates / name
        if not tarball.is_file():
            raise NodeError(f"volume '{ostemplate}' has no file {tarball} on the test node")
        rootfs = self.ct_dir(vmid) / "rootfs"
        if self.ct_dir(vmid).exists():
            raise NodeError(f"CT {vmid}: {self.ct_dir(vmid)} already exists")
        rootfs.mkdir(parents=True)
        try:
            self._run("tar", "-xzf", str(tarball), "-C", str(rootfs), "--numeric-owner")
            stand_in = rootfs / "usr/local/bin/nvidia-smi"
            shutil.copyfile(self.nvidia_smi, stand_in)
            stand_in.chmod(0o755)
            self._configure_pip(rootfs)
            self.write_config(vmid, config)
        except BaseException:
            shutil.rmtree(self.ct_dir(vmid), ignore_errors=True)
            raise

    @staticmethod
    def _configure_pip(rootfs: Path) -> None:
        """Give the CT the node's CA bundle, for pip as on the node, and a pip that installs without
        compiling bytecode.

        Outbound TLS from this machine may pass a proxy with its own CA that only the node's bundle
        holds; pip's vendored bundle lacks it, so pip.conf points at the system one (as the node's does).
        Compiling every module of torch and its neighbours at install took about 57 s of CPU of the
        venv's 90 on this 2-core machine, twice in each CI run (the real-host tests and the molecule
        scenario each provision from nothing); the trainer's first import in the container compiles
        the modules it uses (about 13 s, once). What the tests check of the venv is the same either way.
        """
        pip_conf = "[global]\n"
        bundle = Path(HOST_CA_BUNDLE)
        if bundle.is_file():
            target = rootfs / HOST_CA_BUNDLE.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bundle, target)
            pip_conf += f"cert = {HOST_CA_BUNDLE}\n"
        (rootfs / "etc/pip.conf").write_text(pip_conf + "\n[install]\nno-compile = true\n")

    def write_config(self, vmid: int, config: dict[str, str]) -> None:
        (self.ct_dir(vmid) / "config").write_text(self.render(vmid, config))

    def render(self, vmid: int, config: dict[str, str]) -> str:
        """The LXC config for a PVE container config (what pve-container generates at start)."""
        ct = self.ct_dir(vmid)
        lines = [
            "# written by the dflash test node from the CT's PVE config; regenerated on each start",
            "lxc.include = /usr/share/lxc/config/common.conf",
            "lxc.arch = amd64",
            f"lxc.uts.name = {config.get('hostname', f'CT{vmid}')}",
            f"lxc.rootfs.path = dir:{ct / 'rootfs'}",
            # The node's network namespace is shared: the simplest honest setup on loopback
            # (a real node gives the CT a veth on vmbr0 from its net0 entry).
            "lxc.net.0.type = none",
            # tini as PID 1 reaps the trainer once it exits, so a dead PID never looks alive.
            "lxc.init.cmd = /usr/bin/tini -- /bin/sleep infinity",
            "lxc.signal.halt = SIGTERM",
            "lxc.apparmor.profile = unconfined",
            "lxc.mount.auto = proc:mixed sys:mixed cgroup:mixed",
            f"lxc.mount.entry = {self.gpu_state_dir} {GPU_STATE_MOUNT} none ro,bind,create=dir 0 0",
        ]
        for host, inside in self.extra_binds:
            lines.append(f"lxc.mount.entry = {host} {inside.lstrip('/')} none ro,bind,create=dir 0 0")
        cgroup_key = (
            "lxc.cgroup.devices.allow"
            if Path("/sys/fs/cgroup/devices").is_dir()
            else "lxc.cgroup2.devices.allow"
        )
        for key in sorted(config, key=_natural):
            value = str(config[key])
            if re.fullmatch(r"mp\d+", key):
                source, props = _split(value)
                if not source.startswith("/"):
                    raise NodeError(f"{key}: the test node mounts host folders only, not volume {source}")
                target = props.get("mp", "").lstrip("/")
                options = "ro,rbind" if props.get("ro") in ("1", "true") else "rbind"
                lines.append(f"lxc.mount.entry = {source} {target} none {options},create=dir 0 0")
            elif re.fullmatch(r"dev\d+", key):
                path, _props = _split(value)
                major, minor = device_numbers(path)
                lines.append(f"{cgroup_key} = c {major}:{minor} rwm")
                inside = path.lstrip("/")
                lines.append(f"lxc.mount.entry = {path} {inside} none bind,optional,create=file 0 0")
        return "\n".join(lines) + "\n"

    def start(self, vmid: int, config: dict[str, str]) -> None:
        self.write_config(vmid, config)
        self._run("lxc-start", "-P", str(self.lxcpath), "-n", str(vmid))
        self._run("lxc-wait", "-P", str(self.lxcpath), "-n", str(vmid), "-s", "RUNNING", "-t", "20")

    def stop(self, vmid: int) -> None:
        if self.state(vmid) == "running":
            self._run("lxc-stop", "-P", str(self.lxcpath), "-n", str(vmid), "-t", "10")

    def destroy(self, vmid: int) -> None:
        """Stop (killing what does not stop) and remove the container's folder, rootfs included."""
        if self.exists(vmid) and self.state(vmid) == "running":
            try:
                self._run("lxc-stop", "-P", str(self.lxcpath), "-n", str(vmid), "-t", "10")
            except NodeError:
                self._run("lxc-stop", "-P", str(self.lxcpath), "-n", str(vmid), "-k")
        # What lxc-destroy does for a dir rootfs, without its time limit on a large rootfs.
        shutil.rmtree(self.ct_dir(vmid), ignore_errors=True)

    def attach_argv(self, vmid: int, command: list[str]) -> list[str]:
        """What `pct exec <vmid> -- command` runs: lxc-attach with a clean environment, as pct does."""
        return [
            "lxc-attach",
            "-P",
            str(self.lxcpath),
            "-n",
            str(vmid),
            "--clear-env",
            "--keep-var",
            "TERM",
            "--set-var",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--set-var",
            "HOME=/root",
            "--",
            *command,
        ]


def device_numbers(path: str) -> tuple[int, int]:
    """Major and minor of a character device on the node, or a clear error."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NodeError(f"Device {path} does not exist") from None
    import stat as stat_mod

    if not stat_mod.S_ISCHR(st.st_mode):
        raise NodeError(f"{path} is not a character device")
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def _split(value: str) -> tuple[str, dict[str, str]]:
    first, *rest = value.split(",")
    props = dict(part.split("=", 1) for part in rest if "=" in part)
    return first, props


def _natural(key: str) -> tuple[str, int]:
    m = re.fullmatch(r"([a-z]+)(\d*)", key)
    return (m.group(1), int(m.group(2) or -1)) if m else (key, -1)
