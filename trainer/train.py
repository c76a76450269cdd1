"""The training run: setup, the loop, evaluation, checkpoints and signals.

`train` owns the run (output files, data, replicas, the topology); `train_step` is one optimisation
step; the loop around it logs, evaluates and checkpoints. Model, data, objective, checkpoints and
metrics do not depend on how workers start: worker threads (topology.py) or one process per device
under torchrun (process.py). In the process topology every rank runs this same code; rank 0 alone
writes the output files, the first rank of every other host prints the same lines to its stdout
(that host's log), and the stop decision and the evaluation's outcome are agreed by all ranks.
"""

from __future__ import annotations

import datetime
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from . import runrecord
from .checkpoint import (
    CheckpointError,
    checkpoint_from_bytes,
    header_digest,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_bytes,
    save_checkpoint,
    split_checkpoint,
)
from .config import Config, config_from_dict, dump_config
from .data import (
    ChatFormat,
    Loader,
    build_train_set,
    load_conversations,
    load_examples,
    prompt_ids,
    regen_cache_key,
    regenerate,
    save_examples,
    tokenize,
)
from .embedded import ensure_embedded
from .environment import resolve_devices
from .evaluate import acceptance_length
from .model import target_layer_ids
from .process import ProcessSetupError, ProcessTopology, ProcessWorld, launched_by_torchrun
from .recompiles import RecompileWatch
from .replica import Replica
from .target import load_target, load_tokenizer, num_target_layers
from .topology import ThreadedTopology

CHECKPOINT_FORMAT = 1


class BadInput(Exception):
    """Bad input found only once work has begun (e.g. an unusable checkpoint): exit 2."""


class Output:
    """stdout and <out>/train.log, line by line, flushed; metrics.jsonl rows."""

    def __init__(self, out_dir: Path, tensorboard: bool = False):
        self.lock = threading.Lock()  # workers log their compile line from their own threads
        self.board = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise BadInput(
                    "log.tensorboard is true but the tensorboard package is missing: install it "
                    "(pip install tensorboard==2.21.0) or set log.tensorboard: false"
                ) from None
            self.board = SummaryWriter(str(out_dir / "tensorboard"))
        self.log_file: TextIO = (out_dir / "train.log").open("a")
        self.metrics: TextIO = (out_dir / "metrics.jsonl").open("a")

    def line(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)
            self.log_file.write(text + "\n")
            self.log_file.flush()

    def metric(self, row: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.board is not None:
            for key, value in row.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)):
                    self.board.add_scalar(f"{row['kind']}/{key}", value, row["step"])
            self.board.flush()

    def close(self) -> None:
        self.log_file.close()
        self.metrics.close()
        if self.board is not None:
            self.board.close()


class ConsoleOutput(Output):
    """Output of local rank 0 on every host but rank 0's (process topology on several hosts): the
    same lines on stdout, which is that host's run log (launch.yml waits for its progress line,
    status.yml reads it), and no files: rank 0 alone writes train.log, metrics.jsonl, config.yml
    and the checkpoints. The values in the lines are global ones (losses and token counts summed
    over every rank, rank 0's tau), so every host's log shows the same numbers."""

    def __init__(self):
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)

    def metric(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class NullOutput(Output):
    """Output of the other ranks in the process topology (one rank per host speaks)."""

    def __init__(self):
        pass

    def line(self, text: str) -> None:
        pass

    def metric(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints and exits 0 at the next safe point."""

    def __init__(self):
        self.signal_name: str | None = None

    def __call__(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        def handler(signum, _frame):
            if self.signal_name is None:
                self.signal_name = signal.Signals(signum).name

        self.previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def uninstall(self, ignore_late_signals: bool = False) -> None:
        """Restore the previous handlers; or, for a rank under torchrun whose run is over, ignore
        SIGTERM/SIGINT from now on: on several hosts a stop request reaches each host's torchrun
        at its own moment, and one that arrives after this rank already stopped (the ranks agreed
        on it when another host's request came) must not kill it on its way out, or torchrun
        reports a failed rank instead of a clean stop."""
        for sig, previous in getattr(self, "previous", {}).items():
            signal.signal(sig, signal.SIG_IGN if ignore_late_signals else previous)


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


def prepare_data(
    cfg: Config,
    target,
    tokenizer,
    chat: ChatFormat,
    train_file: Path,
    target_path: Path,
    device: torch.device,
    out: Output,
    should_stop,
):
    """Tokenized, target-regenerated examples (cached), split into training set and eval prompts."""
    examples = tokenize(load_conversations(train_file), chat)
    held_out = cfg.train.eval_prompts
    if len(examples) <= held_out:
        raise BadInput(
            f"{train_file} has {len(examples)} conversations; more than train.eval_prompts="
            f"{held_out} are needed (lower train.eval_prompts or add data)"
        )
    eval_examples, train_examples = examples[-held_out:], examples[:-held_out]
    if cfg.data.regenerate:
        key = regen_cache_key(train_file, target_path, cfg.data.regen_max_new_tokens, cfg.model.dtype)
        cache = Path(cfg.data.cache_dir).expanduser() / "regenerated" / f"{key}.jsonl"
        if cache.exists():
            train_examples = load_examples(cache)
            out.line(f"data: {len(train_examples)} regenerated conversations from cache {cache}")
        else:
            started = time.monotonic()
            regenerated = regenerate(
                train_examples,
                target,
                chat,
                cfg.data.regen_max_new_tokens,
                cfg.data.regen_batch_size,
                device,
                should_stop,
            )
            if regenerated is None:
                return None
            train_examples = regenerated
            save_examples(cache, train_examples)
            out.line(
                f"data: regenerated {len(train_examples)} conversations with the target in "
                f"{time.monotonic() - started:.1f}s, cached at {cache}"
            )
    first_user = [
        next(i for i, (role, _) in enumerate(e.turns) if role == "assistant") for e in eval_examples
    ]
    prompts = [prompt_ids(e, chat, turn) for e, turn in zip(eval_examples, first_user, strict=True)]
    return train_examples, prompts


Topology = ThreadedTopology | ProcessTopology


def worker_rng(topology: Topology) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Every worker's anchor generator state and the CUDA RNG states (a collective in processes)."""
    if isinstance(topology, ProcessTopology):
        return topology.worker_rng()
    cuda_states = {}
    for replica in topology.replicas:
        if replica.device.type == "cuda":
            cuda_states[str(replica.device)] = torch.cuda.get_rng_state(replica.device)
    return [r.anchor_generator.get_state() for r in topology.replicas], cuda_states


def checkpoint_state(step: int, cfg: Config, topology: Topology, loader: Loader, tau0: float | None) -> dict:
    lead = topology.replicas[0]
    workers, cuda_states = worker_rng(topology)
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "config": cfg.to_dict(),
        "drafter": lead.drafter.state_dict(),
        "optimizer": lead.optimizer.state_dict(),
        "scheduler": lead.scheduler.state_dict(),
        "data": loader.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": cuda_states,
            "workers": workers,
        },
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
    for key in ("batch_size", "seq_len", "seed"):
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


def find_resume_point(
    cfg: Config, out_dir: Path, workers: int, world: ProcessWorld | None
) -> ResumePoint | None:
    """The checkpoint --resume continues from, verified and checked on every rank; None: start at 0.

    Rank 0 decides: its newest checkpoint. No shared storage is needed: a rank whose own --out
    holds the same file (same name, same payload SHA-256) loads it from there; when any rank lacks
    it, rank 0 sends the file's bytes to every rank, which verify them as a file read from disk.
    Every problem is agreed (gathered), so every rank refuses the same way instead of one rank
    failing while the others wait in a collective. A collective in processes.
    """
    directory = out_dir / "checkpoints"
    if world is None:
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
    chosen, problem = world.gather((chosen, problem))[0]  # rank 0's decision, on every rank
    if problem is not None:
        raise BadInput(problem if world.is_lead else f"rank 0: {problem}")
    if chosen is None:
        return None
    name, lead_path, digest = chosen
    how = ""
    if not world.is_lead:
        own = directory / name
        if header_digest(own) == digest:
            try:
                state, how = load_checkpoint(own), f"this host's copy {own}"
            except CheckpointError:
                state = None  # a damaged copy here: take rank 0's
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
    refused = [(rank, text) for rank, texts in enumerate(world.gather(problems)) for text in texts]
    if refused:
        own = [text for rank, text in refused if rank == world.rank]
        raise BadInput(own[0] if own else f"rank {refused[0][0]}: {refused[0][1]}")
    return ResumePoint(state, Path(lead_path), how)


def restore_state(state: dict, topology: Topology, loader: Loader) -> None:
    for replica in topology.replicas:
        replica.drafter.load_state_dict(state["drafter"])
        replica.optimizer.load_state_dict(state["optimizer"])
        replica.scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["torch"])
    if isinstance(topology, ProcessTopology):
        topology.set_worker_rng(state["rng"]["workers"], state["rng"]["cuda"])
        return
    for replica, generator_state in zip(topology.replicas, state["rng"]["workers"], strict=True):
        replica.anchor_generator.set_state(generator_state)
    for device, rng in state["rng"]["cuda"].items():
        torch.cuda.set_rng_state(rng, torch.device(device))


def train_step(topology: Topology, loader: Loader) -> tuple[float, int, torch.Tensor]:
    """One optimisation step: the next global batch through every worker, averaged, applied."""
    input_ids, loss_mask = loader.next_batch()
    return topology.step(input_ids, loss_mask)


def train(cfg: Config, out_dir: Path, resume: bool) -> int:
    """Run training to the end or to a signal. Returns the exit code."""
    devices = resolve_devices(cfg.parallel.devices)
    if cfg.parallel.cpu_threads:
        torch.set_num_threads(cfg.parallel.cpu_threads)
    world: ProcessWorld | None = None
    if cfg.run.topology == "process":
        try:
            world = ProcessWorld(devices, cfg.parallel.step_timeout_s)
        except ProcessSetupError as exc:
            raise BadInput(str(exc)) from None
        devices = [world.device]
        workers = world.world_size
    else:
        if devices == [torch.device("cpu")]:
            devices = devices * cfg.parallel.cpu_workers
        workers = len(devices)

    def agree(flag: bool) -> bool:
        """Every rank's decision is the same: true if it is true on any rank (processes)."""
        return flag if world is None else world.any(flag)

    try:
        return _train(cfg, out_dir, resume, devices, workers, world, agree)
    finally:
        if world is not None and sys.exc_info()[0] is None:
            world.close()


def _train(
    cfg: Config,
    out_dir: Path,
    resume: bool,
    devices: list[torch.device],
    workers: int,
    world: ProcessWorld | None,
    agree: Callable[[bool], bool],
) -> int:
    """The run itself, on every rank alike (threads: one call; processes: one per rank)."""
    lead_rank = world is None or world.is_lead
    resume_from = find_resume_point(cfg, out_dir, workers, world) if resume else None

    if lead_rank:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yml").write_text(dump_config(cfg))
        out: Output = Output(out_dir, cfg.log.tensorboard)
    elif world is not None and world.local_rank == 0:
        out = ConsoleOutput()  # the first rank of another host: its host's log
    else:
        out = NullOutput()
    topology = None
    stop = StopFlag()
    stop.install()
    try:
        where = ", ".join(map(str, devices))
        if world is not None:
            where = f"{world.world_size} process(es) ({world.backend}), rank {world.rank} on {where}"
        out.line(
            f"run {cfg.run.name}: topology {cfg.run.topology}, devices {where}, "
            f"compile mode {cfg.compile.mode}, out {out_dir}"
        )
        if resume and resume_from is None:
            out.line(f"--resume: no checkpoint in {out_dir / 'checkpoints'}; starting from step 0")
        target_path, train_file = (
            Path(cfg.model.target_path).expanduser(),
            Path(cfg.data.train_file).expanduser(),
        )
        if not cfg.model.target_path:
            # Processes: local rank 0 builds the embedded default into this host's cache first,
            # the others wait (an all-reduce as the barrier) and then find it complete.
            if world is not None and world.local_rank != 0:
                agree(False)
            target_path, embedded_data = ensure_embedded(cfg.data.cache_dir)
            if world is not None and world.local_rank == 0:
                agree(False)
            train_file = train_file if cfg.data.train_file else embedded_data
        tokenizer = load_tokenizer(
            Path(cfg.model.tokenizer_path).expanduser() if cfg.model.tokenizer_path else target_path
        )
        mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else tokenizer.mask_token_id
        if mask_id is None:
            raise BadInput("the tokenizer has no mask token; set drafter.mask_token_id to a token id")
        chat = ChatFormat(tokenizer)

        lead_target = load_target(target_path, devices[0], cfg.model.dtype)
        layer_ids = target_layer_ids(num_target_layers(lead_target.config), cfg.drafter.num_context_layers)

        torch.manual_seed(cfg.train.seed)
        replicas = []
        if world is not None:
            replicas.append(Replica(cfg, devices[0], lead_target, layer_ids, mask_id, world.rank))
        for rank, device in enumerate(devices if world is None else []):
            target = lead_target if rank == 0 else load_target(target_path, device, cfg.model.dtype)
            first = replicas[0] if replicas else None  # the others copy its weights
            replicas.append(Replica(cfg, device, target, layer_ids, mask_id, rank, copy_of=first))
        n_params = sum(p.numel() for p in replicas[0].params)
        out.line(
            f"drafter: {cfg.drafter.num_layers} layers, {n_params / 1e6:.2f}M trainable parameters, "
            f"block {cfg.drafter.block_size}, {cfg.drafter.num_anchors} anchors"
        )

        # Workers compile and warm up one at a time on a dummy batch of the real shapes, and nothing
        # else runs meanwhile: tracing patches torch.nn.Module.__call__ process-wide, so an eager
        # forward in another thread (regeneration, evaluation) would be traced into the graph.
        if world is not None:
            topology = ProcessTopology(replicas[0], world, out.line)
        else:
            topology = ThreadedTopology(replicas, cfg.parallel.step_timeout_s, out.line)
        topology.launch()
        if not topology.wait_ready(stop):
            return stopped(out, stop, 0, None, out_dir, world)

        prepared = prepare_data(
            cfg, lead_target, tokenizer, chat, train_file, target_path, devices[0], out, stop
        )
        if agree(prepared is None):
            return stopped(out, stop, 0, None, out_dir, world)
        train_examples, eval_prompts = prepared
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.end_id
        train_set = build_train_set(train_examples, chat, cfg.train.seq_len, pad_id)
        out.line(
            f"data: {len(train_examples)} training conversations, {len(eval_prompts)} held-out prompts, "
            f"{train_set.supervised_fraction:.0%} of tokens supervised; target layers {layer_ids}"
        )
        loader = Loader(train_set, cfg.train.batch_size * workers, cfg.train.seed)
        recompiles = RecompileWatch()

        def warn_about_recompiles() -> None:
            for warning in recompiles.poll():
                out.line(warning)

        def evaluate(at_step: int) -> float | None:
            tau = acceptance_length(
                replicas[0].drafter,
                lead_target,
                eval_prompts,
                layer_ids,
                cfg.drafter.block_size,
                mask_id,
                cfg.train.eval_max_new_tokens,
                chat.end_id,
                devices[0],
                stop,
            )
            if world is not None:
                # Every rank evaluates the same drafter on the same prompts; rank 0's tau is the
                # one every host logs (CUDA kernels need not agree to the last bit across hosts).
                taus = world.gather(tau)
                tau = None if any(value is None for value in taus) else taus[0]
            if tau is None:
                return None
            out.line(f"eval step {at_step} tau {tau:.3f} prompts {len(eval_prompts)}")
            out.metric({"kind": "eval", "step": at_step, "tau": tau, "prompts": len(eval_prompts)})
            warn_about_recompiles()
            return tau

        def save(at_step: int) -> None:
            state = checkpoint_state(at_step, cfg, topology, loader, tau0)  # a collective in processes
            path = save_checkpoint(out_dir / "checkpoints", at_step, state) if lead_rank else None
            if world is None or lead_rank:
                out.line(f"checkpoint saved step {at_step} {path}")
                runrecord.note(out_dir, last_step=at_step, last_checkpoint=str(path))
            if world is not None:
                # The other hosts log where rank 0 put it once it is there (stop.yml reports
                # that line on every host); rank 0's file is the run's only checkpoint.
                host, saved = world.gather((socket.gethostname(), str(path)) if lead_rank else None)[0]
                if not lead_rank:
                    out.line(f"checkpoint saved step {at_step} by rank 0 on {host}: {saved}")

        step, tau0 = 0, None
        if resume_from is not None:
            restore_state(resume_from.state, topology, loader)
            step = int(resume_from.state["step"])
            tau0 = resume_from.state["tau0"] if resume_from.state["tau0"] >= 0 else None
            how = f" ({resume_from.how})" if resume_from.how else ""
            out.line(f"resumed from {resume_from.path} at step {step}{how}")
            resume_from = None  # the state's tensors are in the model now: drop the copy
        if tau0 is None:
            tau0 = evaluate(step)
            if tau0 is None:
                return stopped(out, stop, step, save, out_dir, world)

        total = cfg.train.steps
        started = time.monotonic()
        window_start, window_tokens, window_steps = started, 0, 0
        tau = tau0
        if lead_rank and step > 0:
            # A resumed run's latest tau is its last evaluation, not the first one.
            last_eval = runrecord.last_metrics(out_dir)["eval"]
            if last_eval and last_eval.get("step", -1) <= step:
                tau = float(last_eval["tau"])
        while step < total:
            if agree(stop()):
                return stopped(out, stop, step, save, out_dir, world)
            loss, tokens, _ = train_step(topology, loader)
            step += 1
            window_tokens += tokens
            window_steps += 1
            if step % cfg.train.log_every == 0 or step == total:
                now = time.monotonic()
                tokens_per_s = window_tokens / max(now - window_start, 1e-9)
                eta = (now - window_start) / window_steps * (total - step)
                lr = replicas[0].scheduler.get_last_lr()[0]
                out.line(
                    f"step {step}/{total} loss {loss:.4f} lr {lr:.2e} tok/s {tokens_per_s:.0f} "
                    f"eta {format_eta(eta)}"
                )
                out.metric(
                    {
                        "kind": "train",
                        "step": step,
                        "loss": loss,
                        "lr": lr,
                        "tokens_per_s": tokens_per_s,
                        "elapsed_s": now - started,
                    }
                )
                window_start, window_tokens, window_steps = now, 0, 0
                warn_about_recompiles()
            if step == total or (cfg.train.eval_every and step % cfg.train.eval_every == 0):
                result = evaluate(step)
                if result is None:
                    return stopped(out, stop, step, save, out_dir, world)
                tau = result
            if step == total or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0):
                save(step)
        out.line(f"done: step {step}, tau {tau:.2f} (step 0: {tau0:.2f})")
        if world is None or world.local_rank == 0:
            runrecord.note(
                out_dir,
                state="finished",
                exit_status=0,
                exit_reason="finished",
                last_step=step,
                tau=tau,
                ended_at=runrecord.utc_now(),
            )
        return 0
    finally:
        if topology is not None:
            topology.close()
        out.close()
        stop.uninstall(ignore_late_signals=world is not None and launched_by_torchrun())


def stopped(out: Output, stop: StopFlag, step: int, save, out_dir: Path, world: ProcessWorld | None) -> int:
    # In the process topology the signal may have reached another rank only.
    out.line(f"signal {stop.signal_name or 'on another rank'}: checkpointing and exiting")
    if save is not None:
        save(step)
    else:
        out.line("nothing to checkpoint yet (training had not started)")
    out.line(f"stopped at step {step}")
    if world is None or world.local_rank == 0:
        runrecord.note(
            out_dir,
            state="stopped",
            exit_status=0,
            exit_reason=f"stopped at step {step}",
            ended_at=runrecord.utc_now(),
        )
    sys.stdout.flush()
    return 0
