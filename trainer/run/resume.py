"""What a checkpoint holds, and how a run resumes from one.

A checkpoint carries everything an exact resume needs: the config, the drafter, the optimizer and
schedule, the data position and every random state (the host's, each worker's anchor generator,
the CUDA generators). `find_resume_point` picks and verifies the checkpoint to continue from;
`restore` puts it into the replicas. Checking happens before anything is written: a checkpoint of
another format or another setup is refused (BadInput, exit 2).

In the process topology no shared storage is needed: rank 0 decides (its newest checkpoint); a
rank whose own --out holds the same file (same name, same payload SHA-256) loads it from there;
when any rank lacks it, rank 0 sends the file's bytes to every rank, which verify them as a file
read from disk. Every problem is agreed (gathered), so every rank refuses the same way instead of
one rank failing while the others wait in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import Config, config_from_dict
from ..data.rows import Loader
from ..parallel.sharding import load_optimizer_state, optimizer_state, wait_for_parameters
from .checkpoint import (
    CheckpointError,
    checkpoint_from_bytes,
    header_digest,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_bytes,
    split_checkpoint,
)

CHECKPOINT_FORMAT = 1


class BadInput(Exception):
    """Bad input found only once work has begun (e.g. an unusable checkpoint): exit 2."""


def checkpoint_state(step: int, cfg: Config, topology, loader: Loader, tau0: float | None) -> dict:
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
    }


def check_resumable(state: dict, cfg: Config, workers: int, path: Path) -> None:
    """Refuse (before anything is written) a checkpoint of another format or another setup."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise BadInput(
            f"checkpoint {path} has format {state.get('format')}, this trainer reads {CHECKPOINT_FORMAT}"
        )
    saved = config_from_dict(state["config"])
    differences = [
        f"{section}.{key}: checkpoint {value!r}, now {getattr(getattr(cfg, section), key)!r}"
        for section in ("drafter", "model", "data")
        for key, value in getattr(saved, section).__dict__.items()
        if key not in ("cache_dir", "regen_batch_size") and getattr(getattr(cfg, section), key) != value
    ]
    for key in ("batch_size", "seq_len", "seed", "packing"):
        if getattr(saved.train, key) != getattr(cfg.train, key):
            differences.append(
                f"train.{key}: checkpoint {getattr(saved.train, key)!r}, now {getattr(cfg.train, key)!r}"
            )
    if len(state["rng"]["workers"]) != workers:
        differences.append(f"workers: checkpoint {len(state['rng']['workers'])}, now {workers}")
    if saved.run.topology != cfg.run.topology:
        differences.append(f"run.topology: checkpoint {saved.run.topology!r}, now {cfg.run.topology!r}")
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


def find_resume_point(cfg: Config, out_dir: Path, workers: int, world) -> ResumePoint | None:
    """The checkpoint --resume continues from, verified and checked on every rank; None: start at
    step 0. A collective when there are several ranks."""
    directory = out_dir / "checkpoints"
    if world.world_size == 1:
        return _newest_of_this_host(cfg, directory, workers)
    chosen, problem, raw, state = _rank0_choice(directory, world)
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
        received = world.broadcast_bytes(raw if world.is_lead else None)
        if state is None:
            try:
                state = checkpoint_from_bytes(received, f"{lead_path} (received from rank 0)", digest)
                how = "received from rank 0"
            except CheckpointError as exc:
                problems.append(str(exc))
        del received
    del raw
    if state is not None:
        try:
            check_resumable(state, cfg, workers, Path(lead_path))
        except BadInput as exc:
            problems.append(str(exc))
    _refuse_if_any_rank_refuses(problems, world)
    return ResumePoint(state, Path(lead_path), how)


def _newest_of_this_host(cfg: Config, directory: Path, workers: int) -> ResumePoint | None:
    checkpoints = list_checkpoints(directory)
    if not checkpoints:
        return None
    path = checkpoints[-1][1]
    try:
        state = load_checkpoint(path)
    except CheckpointError as exc:
        raise BadInput(f"{exc}; move it aside to resume from the one before it") from None
    check_resumable(state, cfg, workers, path)
    return ResumePoint(state, path)


def _rank0_choice(directory: Path, world):
    """Rank 0's newest checkpoint (name, path, digest) or its problem, on every rank; rank 0 also
    keeps the file's bytes and state."""
    raw, state, chosen, problem = None, None, None, None
    if world.is_lead:
        checkpoints = list_checkpoints(directory)
        if checkpoints:
            path = checkpoints[-1][1]
            try:
                raw = read_checkpoint_bytes(path)
                digest, _ = split_checkpoint(raw, path)
                state = checkpoint_from_bytes(raw, path, digest)
                chosen = (path.name, str(path), digest)
            except CheckpointError as exc:
                problem = f"{exc}; move it aside to resume from the one before it"
    chosen, problem = world.gather((chosen, problem))[0]
    return chosen, problem, raw, state


def _own_copy(path: Path, digest: str) -> tuple[dict | None, str]:
    """This host's copy of rank 0's checkpoint, when it is the same file; else (None, "")."""
    if header_digest(path) != digest:
        return None, ""
    try:
        return load_checkpoint(path), f"this host's copy {path}"
    except CheckpointError:
        return None, ""  # a damaged copy here: take rank 0's


def _refuse_if_any_rank_refuses(problems: list[str], world) -> None:
    refused = [(rank, text) for rank, texts in enumerate(world.gather(problems)) for text in texts]
    if refused:
        own = [text for rank, text in refused if rank == world.rank]
        raise BadInput(own[0] if own else f"rank {refused[0][0]}: {refused[0][1]}")


def restore(state: dict, topology, loader: Loader) -> None:
    """Put a checkpoint's state into every replica, the loader and the random generators."""
    for replica in topology.replicas:
        replica.drafter.load_state_dict(state["drafter"])
    load_optimizer_state(topology.replicas, state["optimizer"])
    for replica in topology.replicas:
        replica.scheduler.load_state_dict(state["scheduler"])
    try:
        loader.load_state_dict(state["data"])
    except ValueError as exc:  # the rows differ: other data, or a checkpoint from before packing
        raise BadInput(f"--resume: {exc}") from None
    torch.set_rng_state(state["rng"]["torch"])
    topology.set_worker_rng(state["rng"]["workers"], state["rng"]["cuda"])
