"""What a checkpoint holds, and how a run resumes from one.

A checkpoint carries everything an exact resume needs: the config, the drafter, the optimizer and
schedule, the data position, every random state (the host's, each worker's anchor generator, the
CUDA generators) and the run's stretches (the worker count and topology of each part of the run).
`find_resume_point` picks and verifies the checkpoint to continue from; `restore` puts it into the
replicas. Checking happens before anything is written: a checkpoint of another format or another
setup (model, data, batch per worker, sequence length, seed) is refused (BadInput, exit 2).

Another shape of machine is not another setup: a checkpoint written by N workers (worker threads
or torchrun ranks, on one host or several) resumes on M. The drafter and the optimizer state are
the same whatever the worker count (replicas hold the same weights; a sharded optimizer's state is
stored unsharded); the step counter and the learning-rate schedule continue by step; the loader
continues from the rows it had consumed (its position is a count of rows in the epoch's fixed
order, not of batches), so within the epoch no conversation is seen twice and none is skipped,
only the global batch (train.batch_size x workers) changes from there. Each worker's anchor
generator is re-derived from the seed, its rank and the step (with the same worker count the
saved ones carry over, rank for rank). The resume line says what changed; such a run is no longer
bit-exact with the original.

In the process topology no shared storage is needed: rank 0 decides (its newest checkpoint); a
rank whose own --out holds the same file (same name, same payload SHA-256) loads it from there;
when any rank lacks it, rank 0 sends the file's bytes to every rank, which verify them as a file
read from disk. Every problem is agreed (gathered), so every rank refuses the same way instead of
one rank failing while the others wait in a collective.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import SPEED_ONLY_DATA_KEYS, Config, config_from_dict
from ..data.rows import Loader
from ..parallel.sharding import load_optimizer_state, optimizer_state, wait_for_parameters
from .checkpoint import (
    CheckpointError,
    Loaded,
    checkpoint_from_bytes,
    list_checkpoints,
    read_checkpoint_bytes,
    read_verified,
    recorded_digest,
)

CHECKPOINT_FORMAT = 1


class BadInput(Exception):
    """Bad input found only once work has begun (e.g. an unusable checkpoint): exit 2."""


@dataclass(frozen=True)
class Shape:
    """How many workers a stretch of the run had, and how they ran."""

    workers: int
    topology: str  # threaded (worker threads of one process) or process (torchrun ranks)
    hosts: int = 1  # 0: not recorded (a checkpoint from before stretches were kept)

    def same_as(self, other: Shape) -> bool:
        """The same workers, topology and hosts (hosts not recorded: taken as the same)."""
        hosts = self.hosts == other.hosts or 0 in (self.hosts, other.hosts)
        return self.workers == other.workers and self.topology == other.topology and hosts

    def text(self) -> str:
        unit = "worker thread" if self.topology == "threaded" else "torchrun rank"
        hosts = f" on {self.hosts} hosts" if self.hosts > 1 else ""
        return f"{self.workers} {unit}{'' if self.workers == 1 else 's'}{hosts}"


def this_shape(cfg: Config, workers: int, world) -> Shape:
    """The shape of this start (a collective in the process topology: the hosts are counted by
    torchrun's node rank, GROUP_RANK, of every rank)."""
    if cfg.run.topology != "process" or world.world_size == 1:
        return Shape(workers, cfg.run.topology, 1)
    return Shape(workers, "process", len(set(world.gather(os.environ.get("GROUP_RANK", "0")))))


def saved_shape(state: dict) -> Shape:
    """The shape that wrote a checkpoint: its last stretch, or (a checkpoint from before stretches
    were kept) its worker generators and topology."""
    stretches = state.get("stretches")
    if isinstance(stretches, list) and stretches and _well_formed(stretches[-1]):
        return _shape_of(stretches[-1])
    return Shape(len(state["rng"]["workers"]), config_from_dict(state["config"]).run.topology, 0)


def stretches_after(state: dict | None, shape: Shape, step: int, started_at: str) -> list[dict]:
    """The run's stretches once this start is counted ({from_step, workers, topology, hosts,
    started_at} each, oldest first): a new one where the shape changed."""
    new = {"from_step": step, **asdict(shape), "started_at": started_at}
    if state is None:
        return [new]
    stretches = state.get("stretches")
    stretches = [dict(s) for s in stretches if _well_formed(s)] if isinstance(stretches, list) else []
    if not stretches:
        saved = saved_shape(state)
        saved = shape if saved.same_as(shape) else saved
        stretches = [{"from_step": 0, **asdict(saved), "started_at": None}]
    while stretches and not _shape_of(stretches[-1]).same_as(shape) and stretches[-1]["from_step"] == step:
        stretches.pop()  # it ended where it began: that start stopped before its first step
    if stretches and _shape_of(stretches[-1]).same_as(shape):
        return stretches
    return [*stretches, new]


def _well_formed(stretch) -> bool:
    return (
        isinstance(stretch, dict)
        and all(isinstance(stretch.get(key), int) for key in ("from_step", "workers"))
        and stretch.get("topology") in ("threaded", "process")
    )


def _shape_of(stretch: dict) -> Shape:
    return Shape(int(stretch["workers"]), str(stretch["topology"]), int(stretch.get("hosts", 1)))


def checkpoint_state(
    step: int, cfg: Config, topology, loader: Loader, tau0: float | None, stretches: list[dict] | None = None,
    tau0_step: int = 0,
) -> dict:
    """The whole training state at `step` (a collective in the process topology)."""
    first = topology.replicas[0]
    workers, cuda_states = topology.worker_rng()
    wait_for_parameters(topology.replicas)
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "config": cfg.to_dict(),
        "drafter": first.drafter.state_dict(),
        "optimizer": optimizer_state(topology.replicas),
        "scheduler": first.scheduler.state_dict(),
        "data": loader.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "cuda": cuda_states, "workers": workers},
        "tau0": -1.0 if tau0 is None else tau0,  # -1: step-0 evaluation not finished
        "tau0_step": tau0_step,  # where tau0 came from: a resume evaluates there when step 0's did not finish
        "stretches": list(stretches or []),
    }


def check_resumable(state: dict, cfg: Config, path: Path) -> None:
    """Refuse (before anything is written) a checkpoint of another format or another setup. Another
    worker count or topology is no other setup: see the module's docstring."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise BadInput(
            f"checkpoint {path} has format {state.get('format')}, this trainer reads {CHECKPOINT_FORMAT}"
        )
    saved = config_from_dict(state["config"])
    differences = [
        f"{section}.{key}: checkpoint {value!r}, now {getattr(getattr(cfg, section), key)!r}"
        for section in ("drafter", "model", "data")
        for key, value in getattr(saved, section).__dict__.items()
        if getattr(getattr(cfg, section), key) != value
        and not (section == "data" and key in SPEED_ONLY_DATA_KEYS)
    ]
    for key in ("batch_size", "seq_len", "seed", "packing"):
        if getattr(saved.train, key) != getattr(cfg.train, key):
            differences.append(
                f"train.{key}: checkpoint {getattr(saved.train, key)!r}, now {getattr(cfg.train, key)!r}"
            )
    if differences:
        raise BadInput(
            f"--resume: {path} was written by a different setup ({'; '.join(differences)}); "
            "resume with the same settings, or start a new --out"
        )


@dataclass
class ResumePoint:
    """The checkpoint a run continues from: rank 0's newest, and how this rank got its state."""

    state: dict
    path: Path  # the file on rank 0's host
    how: str = ""  # on ranks of other hosts: "this host's copy <path>" or "received from rank 0"
    cost: str = ""  # rank 0's read of it: its size, the read from disk, the checksum and unpacking


def find_resume_point(cfg: Config, out_dir: Path, world) -> ResumePoint | None:
    """The checkpoint --resume continues from, verified and checked on every rank; None: start at
    step 0. A collective when there are several ranks."""
    directory = out_dir / "checkpoints"
    if world.world_size == 1:
        return _newest_of_this_host(cfg, directory)
    chosen, problem, state, cost = _rank0_choice(directory, world)
    if problem is not None:
        raise BadInput(problem if world.is_lead else f"rank 0: {problem}")
    if chosen is None:
        return None
    name, lead_path, digest = chosen
    how = ""
    if not world.is_lead:
        state, how = _own_copy(directory / name, digest)
    problems: list[str] = []
    if any(world.gather(state is None)):
        # rank 0's file again: from the page cache its own read just filled
        received = world.broadcast_bytes(read_checkpoint_bytes(Path(lead_path)) if world.is_lead else None)
        if state is None:
            try:
                state = checkpoint_from_bytes(received, f"{lead_path} (received from rank 0)", digest)
                how = "received from rank 0"
            except CheckpointError as exc:
                problems.append(str(exc))
        del received
    if state is not None:
        try:
            check_resumable(state, cfg, Path(lead_path))
        except BadInput as exc:
            problems.append(str(exc))
    _refuse_if_any_rank_refuses(problems, world)
    return ResumePoint(state, Path(lead_path), how, cost)


def _newest_of_this_host(cfg: Config, directory: Path) -> ResumePoint | None:
    checkpoints = list_checkpoints(directory)
    if not checkpoints:
        return None
    path = checkpoints[-1][1]
    loaded = _read_newest(path)
    check_resumable(loaded.state, cfg, path)
    return ResumePoint(loaded.state, path, cost=loaded.cost())


def _read_newest(path: Path) -> Loaded:
    try:
        return read_verified(path)
    except CheckpointError as exc:
        raise BadInput(f"{exc}; move it aside to resume from the one before it") from None


def _rank0_choice(directory: Path, world):
    """Rank 0's newest checkpoint (name, path, digest) or its problem, on every rank; rank 0 also
    keeps the state and what its read cost."""
    state, chosen, problem, cost = None, None, None, ""
    if world.is_lead:
        checkpoints = list_checkpoints(directory)
        if checkpoints:
            path = checkpoints[-1][1]
            try:
                loaded = _read_newest(path)
                state, cost, chosen = loaded.state, loaded.cost(), (path.name, str(path), loaded.digest)
            except BadInput as exc:
                problem = str(exc)
    chosen, problem = world.gather((chosen, problem))[0]
    return chosen, problem, state, cost


def _own_copy(path: Path, digest: str) -> tuple[dict | None, str]:
    """This host's copy of rank 0's checkpoint, when it is the same file; else (None, "")."""
    if recorded_digest(path) != digest:
        return None, ""
    try:
        return read_verified(path, digest).state, f"this host's copy {path}"
    except CheckpointError:
        return None, ""  # a damaged copy here: take rank 0's


def _refuse_if_any_rank_refuses(problems: list[str], world) -> None:
    refused = [(rank, text) for rank, texts in enumerate(world.gather(problems)) for text in texts]
    if refused:
        own = [text for rank, text in refused if rank == world.rank]
        raise BadInput(own[0] if own else f"rank {refused[0][0]}: {refused[0][1]}")


def restore(
    state: dict, topology, loader: Loader, seed: int = 0, shape: Shape | None = None, built_with: bool = False
) -> None:
    """Put a checkpoint's state into every replica, the loader and the random generators (each
    worker's re-derived from the seed and step where the worker count changed; `shape`: this run's,
    by default the checkpoint's own). `built_with`: the drafters were built with the state's weights
    (load_models' weights), which are not copied to the devices a second time."""
    for replica in [] if built_with else topology.replicas:
        replica.drafter.load_state_dict(state["drafter"])
    load_optimizer_state(topology.replicas, state["optimizer"])
    for replica in topology.replicas:
        replica.scheduler.load_state_dict(state["scheduler"])
    try:
        loader.load_state_dict(state["data"])
    except ValueError as exc:  # the rows differ: other data, or a checkpoint from before packing
        raise BadInput(f"--resume: {exc}") from None
    torch.set_rng_state(state["rng"]["torch"])
    saved = saved_shape(state)
    shape = shape or saved
    workers = state["rng"]["workers"]
    if saved.workers != shape.workers:
        workers = [worker_generator_state(seed, rank, int(state["step"])) for rank in range(shape.workers)]
    # CUDA generator states are kept per device (threads) or per rank (processes), and only for
    # the same workers; nothing in training draws from them (anchors come from the CPU generators).
    same_workers = saved.workers == shape.workers and saved.topology == shape.topology
    topology.set_worker_rng(workers, state["rng"]["cuda"] if same_workers else {})


def worker_generator_state(seed: int, rank: int, step: int) -> torch.Tensor:
    """The anchor generator of worker `rank` in a run that changed its worker count at `step`: a
    stream of its own, from the seed, the rank and the step (not one the run used before)."""
    digest = hashlib.sha256(f"dflash-anchors|{seed}|{rank}|{step}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1).get_state()


def describe_resume(point: ResumePoint, shape: Shape, loader: Loader, batch_size: int) -> str:
    """The resume line: as before when nothing changed; else, in the same line, what changed and how
    the run continues."""
    state = point.state
    how = f" ({point.how})" if point.how else ""
    line = f"resumed from {point.path} at step {state['step']}{how}" + changed_data_text(loader)
    saved = saved_shape(state)
    if saved.same_as(shape):
        return line
    where = loader.position()
    streams = "re-derived from the seed and step" if saved.workers != shape.workers else "carried over"
    return (
        f"{line} on {shape.text()} (written by {saved.text()}): the data continues after conversation "
        f"{where['conversations_done']} of {where['conversations']} of epoch {where['epoch'] + 1}, "
        f"the global batch is now {shape.workers * batch_size} rows (was {saved.workers * batch_size}); "
        "the step count, learning-rate schedule and optimizer state continue by step, each worker's "
        f"anchor stream {streams}; the run is no longer bit-exact with the original"
    )


def changed_data_text(loader: Loader) -> str:
    """What the resume line adds where the data is not the checkpoint's (Loader.load_state_dict)."""
    changed = getattr(loader, "changed_data", None)
    if not changed:
        return ""
    where = loader.position()
    return (
        f"; the data is not the one the checkpoint trained on ({changed['rows']:,} rows, now "
        f"{where['rows']:,}: prepared again, after a newer regeneration format, a change of the data "
        f"file or of train.eval_prompts): training goes on with it from the same share of epoch "
        f"{where['epoch'] + 1} "
        f"({where['rows_done']:,} of {where['rows']:,} rows done)"
    )
