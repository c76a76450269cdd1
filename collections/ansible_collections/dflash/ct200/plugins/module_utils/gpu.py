# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read GPU usage with nvidia-smi and judge whether every GPU is idle.

A GPU is busy when its used memory or utilization is above a threshold, or a compute process
runs on it. Inside a container (its own PID namespace) the process list shows the host's PIDs and
may lack names, so memory and utilization are judged too, never the process list alone.
"""

from __future__ import annotations

QUERY_USAGE = ["--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits"]
QUERY_UUID = ["--query-gpu=index,uuid", "--format=csv,noheader,nounits"]
QUERY_APPS = ["--query-compute-apps=pid,gpu_uuid,process_name,used_memory", "--format=csv,noheader,nounits"]


def number(text: str) -> int | None:
    """nvidia-smi prints '[N/A]' or '[Not Supported]' where a value is unknown (MIG, some boards)."""
    try:
        return int(float(text))
    except ValueError:
        return None


def rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split(",")] for line in text.splitlines() if line.strip()]


def query(module, binary: str, args: list[str]) -> str:
    rc, out, err = module.run_command([binary, *args])
    if rc != 0:
        raise RuntimeError(f"{binary} {' '.join(args)} exited {rc}: {(err or out).strip()}")
    return out


def read_gpus(module, binary: str) -> list[dict]:
    uuids = {row[0]: row[1] for row in rows(query(module, binary, QUERY_UUID)) if len(row) >= 2}
    gpus = []
    for row in rows(query(module, binary, QUERY_USAGE)):
        if len(row) < 3:
            raise RuntimeError(f"unexpected nvidia-smi line: {', '.join(row)}")
        gpus.append(
            {
                "index": number(row[0]),
                "uuid": uuids.get(row[0]),
                "memory_used_mib": number(row[1]),
                "utilization_pct": number(row[2]),
                "apps": [],
            }
        )
    by_uuid = {gpu["uuid"]: gpu for gpu in gpus}
    for row in rows(query(module, binary, QUERY_APPS)):
        if len(row) < 4:
            continue
        app = {"pid": number(row[0]), "name": row[2] or None, "used_memory_mib": number(row[3])}
        if row[2] in ("", "[N/A]", "[Not Found]"):
            app["name"] = None
        gpu = by_uuid.get(row[1])
        if gpu is None:  # a process on a GPU this container cannot see: keep it visible anyway
            gpu = {"index": None, "uuid": row[1], "memory_used_mib": None, "utilization_pct": None}
            gpu["apps"] = []
            gpus.append(gpu)
            by_uuid[row[1]] = gpu
        gpu["apps"].append(app)
    return gpus


def judge(gpus: list[dict], max_memory: int, max_util: int) -> list[str]:
    problems = []
    for gpu in gpus:
        reasons = []
        name = f"GPU {gpu['index']}" if gpu["index"] is not None else f"GPU {gpu['uuid']}"
        if gpu["memory_used_mib"] is not None and gpu["memory_used_mib"] > max_memory:
            reasons.append(f"{gpu['memory_used_mib']} MiB used (limit {max_memory} MiB)")
        if gpu["utilization_pct"] is not None and gpu["utilization_pct"] > max_util:
            reasons.append(f"{gpu['utilization_pct']} % utilization (limit {max_util} %)")
        for app in gpu["apps"]:
            label = app["name"] or "unnamed process (a host PID, seen from a container?)"
            held = "?" if app["used_memory_mib"] is None else app["used_memory_mib"]
            reasons.append(f"process {app['pid']} {label} holding {held} MiB")
        if reasons:
            problems.append(f"{name} is busy: " + "; ".join(reasons))
    return problems


def describe(gpu: dict) -> str:
    apps = ", ".join(f"{app['pid']} {app['name'] or '(no name)'}" for app in gpu["apps"]) or "no processes"
    memory = "?" if gpu["memory_used_mib"] is None else gpu["memory_used_mib"]
    util = "?" if gpu["utilization_pct"] is None else gpu["utilization_pct"]
    return f"GPU {gpu['index']}: {memory} MiB used, {util} % utilization, {apps}"


def gpu_report(module, max_memory_mib: int, max_utilization_pct: int) -> dict:
    """{available, note, gpus, problems, lines}; never raises for a missing or broken nvidia-smi."""
    binary = module.get_bin_path("nvidia-smi")
    empty = {"available": False, "gpus": [], "problems": [], "lines": []}
    if binary is None:
        return {**empty, "note": "nvidia-smi not found on PATH"}
    try:
        gpus = read_gpus(module, binary)
    except RuntimeError as error:
        return {**empty, "note": str(error)}
    if not gpus:
        return {**empty, "note": "nvidia-smi lists no GPU"}
    return {
        "available": True,
        "note": "",
        "gpus": gpus,
        "problems": judge(gpus, max_memory_mib, max_utilization_pct),
        "lines": [describe(gpu) for gpu in gpus],
    }
