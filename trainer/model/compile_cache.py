"""The compiled code of a machine, kept on it: a process compiles a shape once, and every later
process (the next GPU's worker, a restart, the next data set) loads it instead of compiling again.

Two of torch's own caches live in one directory per software stack, <root>/<stack_key()>, so an
upgrade of torch, transformers, the CUDA runtime or Python, or another GPU generation, never loads
a stale artifact (it compiles into a fresh directory):
- inductor/: TORCHINDUCTOR_CACHE_DIR, Inductor's FX graph, AOTAutograd and autotune caches and the
  Triton kernels, each entry written atomically by Inductor itself;
- mega/: torch.compiler.save_cache_artifacts' bundles ("mega-cache"), with the Dynamo output of the
  functions compiled through keeping_traces (torch's precompile), one file per bundle named by
  its content's hash, written to a temporary file and renamed, so workers saving at once never
  write the same name with different contents and a reader never sees a partial file; a process
  loads every bundle before it compiles (load_cache_artifacts).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import os
import platform
import re
import sys
import time
import types
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


def compile_seconds() -> tuple[float, float]:
    """Seconds this process has spent in torch.compile so far (torch's own timer of each compile:
    Dynamo's tracing, AOTAutograd and Inductor, what the compile cache held loaded in it), and of
    them in Dynamo's tracing of bytecode; (0, 0) before torch._dynamo is imported (importing it here
    would cost seconds of a start) or where this torch keeps no such timers."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(dynamo_utils, "compilation_time_metrics", None)
    if metrics is None:
        return 0.0, 0.0
    total, tracing = metrics.get("_compile.compile_inner", []), metrics.get("bytecode_tracing", [])
    return float(sum(total)), float(sum(tracing))


def keeping_traces(fn: Callable, **options) -> Callable:
    """torch.compile(fn, **options) with its Dynamo output kept in the compile cache too (torch's
    precompile), so that a fresh process over the cache loads it instead of tracing fn again. For
    this function only: the process's other compiles (transformers' own flex attention, say) stay
    as torch makes them, as torch 2.11 cannot load some kept traces (flex attention's) and fails
    where it tries. Where torch cannot load fn's own, fn is traced again (and the log says so).

    A process that loaded traces and then meets an input they lack (a new batch shape) traces fn
    again in module scopes that already hold the loaded traces' globals; torch names a new trace's
    globals from a counter that starts at 0 in every process, as the loaded ones were named, and
    fails on the clash (torch 2.11 and 2.13: "assert name not in scope"). So the counter is moved
    past every loaded name; should the compile machinery fail all the same on a call with loaded
    traces, fn is compiled afresh without them (fresh_compile) and the call made again, once, and
    the log says which input and why. fn must give the same result when run again on the same
    inputs (the decode step does: its KV cache writes land on the same slots)."""
    from torch._dynamo.utils import counters

    found = counters["dynamo_cache"]["dynamo_cache_hit"]
    with torch._dynamo.config.patch(caching_precompile=True), refused_loads() as refused:
        try:
            compiled = torch.compile(fn, **options)
        except Exception as exc:  # kept traces torch could not install (2.11 asserts on some): trace again
            refused.append(f"{type(exc).__name__}: {exc}")
            compiled = None
    loaded = False
    if refused:
        TRACES_REFUSED.append(f"{fn.__qualname__}: {'; '.join(refused)}")
    elif counters["dynamo_cache"]["dynamo_cache_hit"] > found:
        TRACES_LOADED.append(fn.__qualname__)
        loaded = True
        number_after_loaded_names()
    if compiled is None:
        return torch.compile(fn, **options)
    fresh: list[Callable] = []  # fn compiled without the loaded traces, once they failed

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if fresh:
            return fresh[0](*args, **kwargs)
        try:
            with torch._dynamo.config.patch(caching_precompile=True):  # what it compiles is kept
                return compiled(*args, **kwargs)
        except Exception as exc:
            if not loaded or not compile_machinery_failed(exc):
                raise
            why = f"{type(exc).__name__}: {first_line(exc)}".rstrip(": ")
            TRACES_ABANDONED.append(f"{fn.__qualname__} on inputs {input_shapes(args)}: {why}")
        number_after_loaded_names()
        fresh.append(fresh_compile(fn, **options))
        return fresh[0](*args, **kwargs)

    return call


# Dynamo's own packages: an exception whose innermost frame is in one of them is the compile
# machinery's failure, not the traced code's.
COMPILER_PARTS = ("_dynamo", "_inductor", "_functorch", "fx", "_guards.py")
COMPILER_PACKAGES = tuple(str(Path(torch.__file__).parent / name) for name in COMPILER_PARTS)
# The names torch gives a trace's globals (unique_id: a prefix, a counter, at times a uuid).
UUID_SUFFIX = r"_[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12}"
DYNAMO_GLOBAL_NAME = re.compile(rf"^__\w*?_(\d+)(?:{UUID_SUFFIX})?$")


def compile_machinery_failed(exc: BaseException) -> bool:
    """Whether exc comes from torch.compile itself (Dynamo, AOTAutograd, Inductor: raised in their
    code), not from the traced code or the device: an operation of the traced code that fails
    while traced (TorchRuntimeError), a misuse Dynamo names (UserError) and out of memory (the
    caller names the batch to shrink) never count."""
    from torch._dynamo.exc import TorchRuntimeError, UserError

    if isinstance(exc, (torch.OutOfMemoryError, TorchRuntimeError, UserError)):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(COMPILER_PACKAGES)


def number_after_loaded_names() -> None:
    """Move torch's counter of generated global names past every such name a module holds (those
    the loaded traces installed): a new trace then never names a global as a loaded one is named.
    A torch without that counter is left alone (the fallback in keeping_traces covers it)."""
    from torch._dynamo import bytecode_transformation

    counter = getattr(bytecode_transformation, "_unique_id_counter", None)
    if counter is None:
        return
    highest = -1
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name in list(names):
            if isinstance(name, str) and name.startswith("__") and (match := DYNAMO_GLOBAL_NAME.match(name)):
                highest = max(highest, int(match[1]))
    following = next(counter)
    bytecode_transformation._unique_id_counter = itertools.count(max(following, highest + 1))


def fresh_compile(fn: Callable, **options) -> Callable:
    """fn compiled as if nothing had been loaded: a copy of its code object (Dynamo keeps a code
    object's compiled entries on it, the loaded ones too) over a copy of its module's globals
    without the names Dynamo installed there, compiled without kept traces."""
    scope = {name: value for name, value in fn.__globals__.items() if not DYNAMO_GLOBAL_NAME.match(name)}
    copy = types.FunctionType(fn.__code__.replace(), scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return torch.compile(copy, **options)


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message for one log line: Dynamo's run over many lines."""
    text = str(exc).strip().splitlines()
    return text[0][:limit] if text else ""


def input_shapes(args) -> str:
    """The shapes of a call's tensor arguments (and of those in its dict arguments), for the log."""
    shapes = []
    for value in args:
        for item in value.values() if isinstance(value, dict) else (value,):
            shape = getattr(item, "shape", None)
            if isinstance(shape, tuple) and all(isinstance(size, int) for size in shape):
                shapes.append("x".join(map(str, shape)) or "scalar")
    return ", ".join(shapes) or "without tensors"


# The functions whose kept traces this process loaded, and those it found but torch could not load
# (each traced again instead), with why.
TRACES_LOADED: list[str] = []
TRACES_REFUSED: list[str] = []
# The calls whose loaded traces failed in the compile machinery, with why: each function compiled
# afresh without them from then on.
TRACES_ABANDONED: list[str] = []


class _RefusedLoads(logging.Handler):
    """Torch says a kept trace could not be loaded only as a warning (and traces again)."""

    def __init__(self, refused: list[str]):
        super().__init__(logging.WARNING)
        self.refused = refused

    def emit(self, record: logging.LogRecord) -> None:
        if "Failed to load entry from dynamo cache" in record.getMessage():
            reason = record.exc_info[1] if record.exc_info else None
            self.refused.append(f"{type(reason).__name__}: {reason}" if reason else record.getMessage())


@contextlib.contextmanager
def refused_loads() -> Iterator[list[str]]:
    """The kept traces torch refuses to load inside the block. Guards' sources that torch 2.11
    rebuilds while loading (an imported module's) install a guard of their own, which fails outside
    a trace ("TracingContext.get() must be called within an ongoing trace"): they are rebuilt inside
    a throwaway one that drops those guards; the guards kept with the trace are the ones checked."""
    from torch._dynamo import package
    from torch._guards import TracingContext, tracing

    refused: list[str] = []
    eval_frame_log = logging.getLogger("torch._dynamo.eval_frame")
    load_guards_state = getattr(package, "load_guards_state", None)  # None: a torch that loads otherwise

    def load_in_a_trace(state):
        if TracingContext.try_get() is not None:
            return load_guards_state(state)
        context = TracingContext(None)
        context.guards_context.skip_install = True
        with tracing(context):
            return load_guards_state(state)

    handler = _RefusedLoads(refused)
    eval_frame_log.addHandler(handler)
    if load_guards_state is not None:
        package.load_guards_state = load_in_a_trace
    try:
        yield refused
    finally:
        if load_guards_state is not None:
            package.load_guards_state = load_guards_state
        eval_frame_log.removeHandler(handler)


def time_spent(elapsed: float, compiling: float, traces: int = 0, refused: list[str] | None = None,
               abandoned: list[str] | None = None) -> str:  # fmt: skip
    """How much of a block's time torch.compile took: what a warm cache saves is read off here."""
    loaded = f"; {traces} compiled function(s) loaded with their traces, not traced again" if traces else ""
    if refused:
        loaded += f"; kept traces torch could not load, traced again ({'; '.join(refused)})"
    if abandoned:
        loaded += (
            "; loaded traces that failed torch.compile on a new input, the function compiled afresh "
            f"without them ({'; '.join(abandoned)})"
        )
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
    try:
        loaded, skipped = load(directory)
        log(status(directory, loaded, skipped))
    except OSError as exc:
        log(f"compile cache: not used ({directory}: {exc.strerror}); compiling from nothing")
        yield
        return
    began, compiling = time.monotonic(), compile_seconds()[0]
    loaded, refused, abandoned = len(TRACES_LOADED), len(TRACES_REFUSED), len(TRACES_ABANDONED)
    try:
        yield
    finally:
        spent = time.monotonic() - began, compile_seconds()[0] - compiling
        traces = len(TRACES_LOADED) - loaded
        log(time_spent(*spent, traces, TRACES_REFUSED[refused:], TRACES_ABANDONED[abandoned:]))
        try:
            with torch._dynamo.config.patch(caching_precompile=True):  # the kept traces saved too
                save(directory)
        except OSError as exc:
            log(f"compile cache: not saved ({directory}: {exc.strerror})")
        except Exception as exc:  # torch could not bundle what it compiled: the work is done all the same
            log(f"compile cache: not saved ({directory}: torch could not bundle it: {exc})")
