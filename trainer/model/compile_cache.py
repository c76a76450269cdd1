"""The compiled code of a machine, kept on it: a process compiles a shape once, and every later
process (the next GPU's worker, a restart, the next data set) loads it instead of compiling again.

Two of torch's own caches live in one directory per software stack, <root>/<stack_key()>, so an
upgrade of torch, transformers, the CUDA runtime or Python, or another GPU generation, never loads
a stale artifact (it compiles into a fresh directory):
- inductor/: TORCHINDUCTOR_CACHE_DIR, Inductor's FX graph, AOTAutograd and autotune caches and the
  Triton kernels, each entry written atomically by Inductor itself;
- mega/: torch.compiler.save_cache_artifacts' bundles ("mega-cache"), one file per bundle named by
  its content's hash, written to a temporary file and renamed, so workers saving at once never
  write the same name with different contents and a reader never sees a partial file; a process
  loads every bundle before it compiles (load_cache_artifacts).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def stack_key(device: torch.device | None = None) -> str:
    """torch, transformers, CUDA runtime, the device's compute capability and Python: what decides
    whether a compiled artifact fits this process."""
    import transformers

    accelerator = "cpu"
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        accelerator = f"cuda{torch.version.cuda}-sm{major}{minor}"
    python = f"py{sys.version_info.major}.{sys.version_info.minor}"
    key = f"torch{torch.__version__}-tf{transformers.__version__}-{accelerator}-{python}-{platform.machine()}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def cache_directory(root: Path, device: torch.device | None = None) -> Path:
    return root / stack_key(device)


def load(directory: Path) -> tuple[int, int]:
    """Point Inductor at directory/inductor and hot-load every saved bundle: (artifacts loaded,
    bundles that could not be read and were skipped). Call before anything compiles."""
    (directory / "inductor").mkdir(parents=True, exist_ok=True)
    (directory / "mega").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((directory / "inductor").absolute())
    loaded = skipped = 0
    for bundle in sorted((directory / "mega").glob("*.bin")):
        try:
            info = torch.compiler.load_cache_artifacts(bundle.read_bytes())
        except Exception:  # a bundle torch cannot read is only a slower start: compile instead
            info = None
        if info is None:  # torch refused it (it says why in a warning)
            skipped += 1
            continue
        loaded += artifact_count(info)
    return loaded, skipped


def artifact_count(info) -> int:
    artifacts = getattr(info, "artifacts", None) or {}
    return sum(len(keys) for keys in artifacts.values())


def save(directory: Path) -> int:
    """This process's new compiled artifacts as one bundle (none new: nothing written). Returns the
    artifacts saved."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data, info = saved
    count = artifact_count(info)
    if not data or count == 0:
        return 0
    bundle = directory / "mega" / f"{hashlib.sha256(data).hexdigest()[:32]}.bin"
    if bundle.exists():
        return count
    tmp = bundle.with_name(f".{bundle.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, bundle)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return count


def status(directory: Path, loaded: int, skipped: int) -> str:
    """The log line: whether this process starts from compiled code or compiles from nothing."""
    inductor = directory / "inductor"
    entries = any(inductor.iterdir()) if inductor.is_dir() else False
    unread = f"; {skipped} unreadable bundle(s) skipped" if skipped else ""
    if loaded:
        return f"compile cache: warm ({loaded} artifacts loaded from {directory}{unread})"
    if entries:
        return f"compile cache: warm (Inductor's cache in {directory / 'inductor'}{unread})"
    return f"compile cache: cold (compiling into {directory}{unread})"


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (torch's own timer of each compile:
    Dynamo's tracing, AOTAutograd and Inductor, what the compile cache held loaded in it); 0 where
    this torch keeps no such timer."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


def traces_loaded() -> int:
    """Compiled functions whose Dynamo output this process loaded from the cache (torch's
    precompile) instead of tracing them."""
    from torch._dynamo.utils import counters

    return int(counters["dynamo_cache"]["dynamo_cache_hit"])


def time_spent(elapsed: float, compiling: float, traces: int = 0) -> str:
    """How much of a block's time torch.compile took: what a warm cache saves is read off here."""
    loaded = f"; {traces} compiled function(s) loaded with their traces, not traced again" if traces else ""
    return (
        f"compile cache: {compiling:.1f} s of {elapsed:.1f} s in torch.compile (tracing, and compiling "
        f"or loading what the cache held); the rest ran the work{loaded}"
    )


@contextlib.contextmanager
def persisted(directory: Path | None, log: Callable[[str], None]) -> Iterator[None]:
    """Compile inside the block over the cache in `directory` (None: no cache, nothing said), and
    save what was compiled when it ends, stopped or not. A cache that cannot be written costs only
    the time: the work goes on and the log says so."""
    if directory is None:
        yield
        return
    with torch._dynamo.config.patch(caching_precompile=True):
        try:
            loaded, skipped = load(directory)
            log(status(directory, loaded, skipped))
        except OSError as exc:
            log(f"compile cache: not used ({directory}: {exc.strerror}); compiling from nothing")
            yield
            return
        began, compiling, traces = time.monotonic(), compile_seconds(), traces_loaded()
        try:
            yield
        finally:
            log(time_spent(time.monotonic() - began, compile_seconds() - compiling, traces_loaded() - traces))
            try:
                save(directory)
            except OSError as exc:
                log(f"compile cache: not saved ({directory}: {exc.strerror})")
            except Exception as exc:  # torch could not bundle what it compiled: the work is done all the same
                log(f"compile cache: not saved ({directory}: torch could not bundle it: {exc})")
