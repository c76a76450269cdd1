"""The training run: setup, then one loop over named steps.

`train` places the workers (threads, or this rank under torchrun) and runs `run_training` on them:
setup (`open_output`, `load_models`, `start_topology`, `load_data`, `Run.restore`), then
`training_loop`, which repeats `train_step` and logs, evaluates and checkpoints at their intervals
until the last step or a stop request. Model, data, objective, checkpoints and metrics do not depend
on how workers start: worker threads (topology.py) or one process per device under torchrun
(process.py). In the process topology every rank runs this same code; rank 0 alone writes the
output files, the first rank of every other host prints the same lines to its stdout (that host's
log; sinks.py), and the stop decision and the evaluation's outcome hold on every rank alike
(`world.any`, `world.gather`). Resuming is resume.py's.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import Config
from ..data.chat import ChatFormat, DataError
from ..data.embedded import ensure_embedded
from ..data.engine.conversations import release_engines
from ..data.regen import ShardDamaged
from ..data.rows import Batch, Loader, build_train_set, valid_anchor_count
from ..data.store import BuildStopped, open_or_build, store_built
from ..model.drafter import target_layer_ids
from ..model.evaluate import acceptance_length
from ..model.target import load_target, load_tokenizer, num_target_layers
from ..parallel.process import ProcessSetupError, ProcessTopology, ProcessWorld, launched_by_torchrun
from ..parallel.replica import Replica, StepLoss
from ..parallel.sharding import wait_for_parameters
from ..parallel.topology import ThreadedTopology, ThreadedWorld
from . import runrecord
from .checkpoint import CheckpointWriter, HostStaging, Written, prune_checkpoints
from .checkpoint_process import SharedStaging, WriterProcess
from .environment import resolve_devices
from .flops import FlopShape, peak_flops, squared_conversation_lengths
from .recompiles import RecompileWatch
from .regen import DataSource, Engines, prepare_data
from .resume import (
    BadInput,
    ResumePoint,
    Shape,
    checkpoint_state,
    describe_resume,
    find_resume_point,
    restore,
    stretches_after,
    this_shape,
)
from .sinks import Output, open_output
from .startup import StartupClock, compile_seconds, compiled_graphs
from .startup import describe as describe_startup

__all__ = ["BadInput", "Diverged", "train"]  # the command line turns both into exit status 2


class Diverged(BadInput):
    """The loss or the weights stopped being finite numbers: training on would only waste the
    machine (a restart from the same checkpoint diverges the same way), so the run ends `failed`."""


Topology = ThreadedTopology | ProcessTopology
World = ThreadedWorld | ProcessWorld


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


@dataclass
class Placement:
    """Where this process's workers run: its devices, its place among the ranks, and how many
    workers the run has in all (threads of this process, or ranks under torchrun)."""

    devices: list[torch.device]
    world: World
    workers: int
    shape: Shape  # the workers, topology and hosts: the run record's and checkpoint's stretch


@dataclass
class Models:
    """The target, its tokenizer and chat format, and one drafter replica per worker here."""

    target: torch.nn.Module
    target_path: Path
    train_file: Path
    tokenizer: object
    chat: ChatFormat
    mask_id: int
    layer_ids: list[int]
    replicas: list[Replica]


def format_eta(seconds: float) -> str:
    # Bounded below timedelta's limit (999999999 days): a very long run's ETA must never end it.
    return str(datetime.timedelta(seconds=int(min(max(0.0, seconds), 86400 * 999_999))))


def place_workers(cfg: Config) -> Placement:
    devices = resolve_devices(cfg.parallel.devices)
    if cfg.parallel.cpu_threads:
        torch.set_num_threads(cfg.parallel.cpu_threads)
    if cfg.run.topology == "process":
        try:
            world = ProcessWorld(devices, cfg.parallel.step_timeout_s)
        except ProcessSetupError as exc:
            raise BadInput(str(exc)) from None
        return Placement([world.device], world, world.world_size, this_shape(cfg, world.world_size, world))
    if devices == [torch.device("cpu")]:
        devices = devices * cfg.parallel.cpu_workers
    world = ThreadedWorld()
    return Placement(devices, world, len(devices), this_shape(cfg, len(devices), world))


def train(
    cfg: Config, out_dir: Path, resume: bool, began: float | None = None, checked_s: float = 0.0
) -> int:
    """Run training to the end or to a signal. Returns the exit code. `began`: time.perf_counter()
    at the trainer's entry, where the startup breakdown counts from (this call otherwise);
    `checked_s`: of the time since, the config's loading and the machine's check."""
    clock = StartupClock(time.perf_counter() if began is None else began)
    clock.add("config and machine check", checked_s)
    clock.add("imports", time.perf_counter() - clock.began - checked_s)
    with clock.part("workers placed"):
        place = place_workers(cfg)
    try:
        return run_training(cfg, out_dir, resume, place, clock)
    finally:
        if sys.exc_info()[0] is None:
            place.world.close()


def run_training(
    cfg: Config, out_dir: Path, resume: bool, place: Placement, clock: StartupClock | None = None
) -> int:
    """The run on this process (threads: the only call; processes: one per rank). Its output is
    closed (the trackers waited for) only once the models' memory is given back."""
    world = place.world
    clock = clock or StartupClock(time.perf_counter())
    resume_from = preload = None
    if resume:
        preload = TargetLoad.beside_resume(cfg, place.devices[0])
        try:
            with clock.part("checkpoint read"):
                resume_from = find_resume_point(cfg, out_dir, world)
        except BaseException:
            if preload is not None:
                preload.thread.join()  # nothing of the run is left running behind a refusal
            raise
    # In a list that train_models empties: no frame but its own holds the checkpoint's tensors.
    resume_point = [resume_from]
    del resume_from
    out = open_output(cfg, out_dir, writes_files=world.is_lead, prints_lines=world.local_rank == 0)
    stop = StopFlag()
    stop.install()
    try:
        return train_models(cfg, out_dir, resume, resume_point, place, out, stop, clock, preload)
    except BaseException as exc:
        # The frames of a crash hold the models, batches and optimizer until the process ends:
        # their locals go (the traceback keeps its lines) so the memory is given back below.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        release_memory(place.devices)
        out.close(stopped=stop())
        stop.uninstall(ignore_late_signals=cfg.run.topology == "process" and launched_by_torchrun())


def release_memory(devices: list[torch.device]) -> None:
    """Give the GPU memory of a run that has ended back to the driver (other processes see it free)."""
    gc.collect()
    if any(device.type == "cuda" for device in devices):
        torch.cuda.empty_cache()


def train_models(
    cfg: Config,
    out_dir: Path,
    resume: bool,
    resume_point: list[ResumePoint | None],
    place: Placement,
    out: Output,
    stop: StopFlag,
    clock: StartupClock,
    preload: TargetLoad | None,
) -> int:
    """Load the models, prepare the data and train: every tensor of the run lives in this call."""
    world = place.world
    resume_from = resume_point.pop()
    topology = run = first_weights = None
    try:
        out.line(describe_run(cfg, out_dir, place))
        if resume and resume_from is None:
            out.line(f"--resume: no checkpoint in {out_dir / 'checkpoints'}; starting from step 0")
        weights = resume_from.state["drafter"] if resume_from is not None else None
        models = load_models(cfg, place, out, clock, preload, weights)
        del weights
        room = checkpoint_room_problem(out_dir, models.replicas[0].drafter) if world.is_lead else None
        if world.any(room is not None):
            raise BadInput(room or "rank 0's disk cannot hold a checkpoint of this run (its log says why)")
        first_weights = FirstEvaluationWeights.of_start(resume_from, models.replicas[0].drafter)
        # A stop before training: the run stays at its checkpoint's step (0 on a fresh start).
        begun = int(resume_from.state.get("step", 0)) if resume_from is not None else 0
        with clock.part("compile and warm-up"):
            topology = start_topology(cfg, models.replicas, world, out)
            ready = topology.wait_ready(stop)
        if not ready:
            return checkpoint_and_stop(out, stop, world, out_dir, begun)
        prepared = load_data(cfg, models, place, out, stop, clock)
        if world.any(prepared is None):
            return checkpoint_and_stop(out, stop, world, out_dir, begun)
        run = Run(cfg, out_dir, out, stop, world, topology, models, *prepared, gpus=place.workers)
        run.startup, run.first_weights = clock, first_weights
        with clock.part("state restore"):
            step = run.restore(resume_from, place.shape)
        resume_from = None  # the state's tensors are in the model now: drop the copy
        return training_loop(run, step)
    finally:
        if first_weights is not None:
            first_weights.wait()  # nothing of the run is left running behind its end
        if run is not None:
            run.close_checkpoints()
        if topology is not None:
            topology.close()


# What a checkpoint holds besides the weights and their moments (the step, the RNG and data state,
# the file's header): 46 KB on the embedded default, 43 KB at the recipe's shape; room for more.
CHECKPOINT_EXTRA_BYTES = 2**20


def free_disk_bytes(path: Path) -> int:
    """The free space of the filesystem that holds `path` (or, not made yet, its nearest parent)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return shutil.disk_usage(path).free


def checkpoint_room_problem(out_dir: Path, drafter: torch.nn.Module) -> str | None:
    """Why the run's disk cannot hold one checkpoint, or None: then its first checkpoint, a stop's
    included, would fail, and the training before it be lost. A checkpoint holds the trainable
    weights and AdamW's two moments, each their size (the recipe's: 1.05 B parameters, 11.72 GiB),
    and a little more (the step, the RNG and data state: CHECKPOINT_EXTRA_BYTES at most)."""
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    needed = 3 * sum(p.numel() * p.element_size() for p in trainable) + CHECKPOINT_EXTRA_BYTES
    directory = out_dir / "checkpoints"
    free = free_disk_bytes(directory)
    if free >= needed:
        return None
    return (
        f"the disk of {directory} has {free / 2**30:.2f} GiB free, and a checkpoint of this run takes about "
        f"{needed / 2**30:.2f} GiB (the drafter's {sum(p.numel() for p in trainable):,} trainable parameters "
        "and AdamW's two moments): its first checkpoint, a stop's too, would fail and lose the training "
        "before it. Free space there, or give the run an output on a larger disk"
    )


def describe_run(cfg: Config, out_dir: Path, place: Placement) -> str:
    where = ", ".join(map(str, place.devices))
    if cfg.run.topology == "process":
        world = place.world
        where = f"{world.world_size} process(es) ({world.backend}), rank {world.rank} on {where}"
    return (
        f"run {cfg.run.name}: topology {cfg.run.topology}, devices {where}, "
        f"compile mode {cfg.compile.mode}, out {out_dir}"
    )


def target_and_data_paths(cfg: Config, world: World) -> tuple[Path, Path]:
    """The target model and the training data: the configured ones, or the embedded default,
    built into this host's cache by its first rank while the others wait (an all-reduce as the
    barrier), after which they find it complete."""
    target_path = Path(cfg.model.target_path).expanduser()
    train_file = Path(cfg.data.train_file).expanduser()
    if cfg.model.target_path:
        return target_path, train_file
    if world.local_rank != 0:
        world.any(False)
    target_path, embedded_data = ensure_embedded(cfg.data.cache_dir)
    if world.local_rank == 0:
        world.any(False)
    return target_path, train_file if cfg.data.train_file else embedded_data


class TargetLoad:
    """The target loaded on a thread of its own while a resume reads and verifies its checkpoint:
    both read gigabytes (at the Qwen3-8B recipe's shape the target's 16 GB from safetensors, the
    checkpoint's 12.6 GB and its SHA-256), and neither needs the other. For a configured
    model.target_path (the embedded default is built first, by one rank of each host)."""

    def __init__(self, path: Path, device: torch.device, dtype: str):
        self.path, self.device = path, device
        self.model: torch.nn.Module | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._load, args=(dtype,), name="target-load", daemon=True)
        self.thread.start()

    @classmethod
    def beside_resume(cls, cfg: Config, device: torch.device) -> TargetLoad | None:
        if not cfg.model.target_path:
            return None
        return cls(Path(cfg.model.target_path).expanduser(), device, cfg.model.dtype)

    def _load(self, dtype: str) -> None:
        try:
            self.model = load_target(self.path, self.device, dtype)
        except BaseException as exc:  # raised where the target is needed, as a load in line would
            self.error = exc

    def result(self, path: Path, device: torch.device) -> torch.nn.Module | None:
        """The target, once loaded (its error raised here); None if it is not the one asked for."""
        self.thread.join()
        if (path, device) != (self.path, self.device):
            return None
        if self.error is not None:
            raise self.error
        model, self.model = self.model, None  # handed over: this load holds no tensor of the run's end
        return model


class FirstEvaluationWeights:
    """The drafter's weights the first evaluation of a start reads: the step-0 evaluation runs after
    the first step (launch.yml waits for its progress line; the evaluation takes minutes), and that
    step changes them. A resume whose checkpoint has no step-0 evaluation reads the checkpoint's own,
    already on the host. A start copies them to the host on a thread of its own while the workers
    compile and warm up, which leaves the weights as they are. At the recipe's shape the copy is
    3.9 GB; made in line it sat in the 3.3-3.6 s of `other` of every startup breakdown on one H100."""

    def __init__(self, drafter: torch.nn.Module | None = None, weights: dict | None = None):
        self.weights, self.error = weights, None
        self.thread: threading.Thread | None = None
        if weights is None:
            self.thread = threading.Thread(
                target=self._copy, args=(drafter,), name="first-weights", daemon=True
            )
            self.thread.start()

    @classmethod
    def of_start(
        cls, resume_from: ResumePoint | None, drafter: torch.nn.Module
    ) -> FirstEvaluationWeights | None:
        """None when the checkpoint's run has its step-0 evaluation already."""
        if resume_from is None:
            return cls(drafter=drafter)
        if resume_from.state["tau0"] >= 0:
            return None
        return cls(weights=resume_from.state["drafter"])

    def _copy(self, drafter: torch.nn.Module) -> None:
        try:
            self.weights = host_copy(drafter)
        except BaseException as exc:  # raised where the weights are needed
            self.error = exc

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def result(self) -> dict:
        self.wait()
        if self.error is not None:
            raise self.error
        weights, self.weights = self.weights, None  # handed over: the evaluation drops them after use
        assert weights is not None
        return weights


def load_models(
    cfg: Config,
    place: Placement,
    out: Output,
    clock: StartupClock | None = None,
    preload: TargetLoad | None = None,
    weights: dict | None = None,
) -> Models:
    """The target and a drafter replica on each of this process's devices; `weights`: a resumed
    run's drafter weights (from its checkpoint), built with them instead of drawing random ones."""
    clock = clock or StartupClock(time.perf_counter())
    with clock.part("target load"):
        target_path, train_file = target_and_data_paths(cfg, place.world)
        tokenizer = load_tokenizer(
            Path(cfg.model.tokenizer_path).expanduser() if cfg.model.tokenizer_path else target_path
        )
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else tokenizer.mask_token_id
    if mask_id is None:
        raise BadInput("the tokenizer has no mask token; set drafter.mask_token_id to a token id")
    with clock.part("target load"):  # with a preload: the wait for it, beyond the checkpoint read
        target = preload.result(target_path, place.devices[0]) if preload is not None else None
        target = target if target is not None else load_target(target_path, place.devices[0], cfg.model.dtype)
    layer_ids = target_layer_ids(num_target_layers(target.config), cfg.drafter.num_context_layers)
    torch.manual_seed(cfg.train.seed)
    replicas: list[Replica] = []
    for index, device in enumerate(place.devices):
        with clock.part("target load"):
            device_target = target if index == 0 else load_target(target_path, device, cfg.model.dtype)
        rank = place.world.rank + index  # threads: the worker's index; processes: the rank
        first = replicas[0] if replicas else None  # the other workers copy its weights
        with clock.part("drafter build"):
            replicas.append(
                Replica(cfg, device, device_target, layer_ids, mask_id, rank, copy_of=first, weights=weights)
            )
    n_params = sum(p.numel() for p in replicas[0].params)
    out.line(
        f"drafter: {cfg.drafter.num_layers} layers, {n_params / 1e6:.2f}M trainable parameters, "
        f"block {cfg.drafter.block_size}, {cfg.drafter.num_anchors} anchors"
    )
    chat = ChatFormat(tokenizer)
    return Models(target, target_path, train_file, tokenizer, chat, mask_id, layer_ids, replicas)


def start_topology(cfg: Config, replicas: list[Replica], world: World, out: Output) -> Topology:
    """Start the workers. They compile and warm up one at a time on a dummy batch of the real
    shapes, and nothing else runs meanwhile: tracing patches torch.nn.Module.__call__ process-wide,
    so an eager forward in another thread (regeneration, evaluation) would be traced into the graph."""
    if cfg.run.topology == "process":
        topology: Topology = ProcessTopology(replicas[0], world, out.line)
    else:
        topology = ThreadedTopology(replicas, cfg.parallel.step_timeout_s, out.line)
    topology.launch()
    return topology


def load_data(
    cfg: Config, models: Models, place: Placement, out: Output, should_stop, clock: StartupClock | None = None
):
    """(loader, held-out prompts), or None when a stop came during the target's regeneration."""
    clock = clock or StartupClock(time.perf_counter())
    try:
        with clock.part("data preparation"):
            examples = regenerated_examples(cfg, models, place, out, should_stop)
    except DataError as exc:  # a broken data file: its message names the file (and the line)
        raise BadInput(
            f'{exc}; data.train_file must hold one {{"messages": [...]}} per line, with an assistant turn'
        ) from None
    if examples is None:
        return None
    train_examples, prompts, data_key = examples
    # The training set also depends on which conversations are held out for evaluation.
    source_key = f"{data_key}|held_out={cfg.train.eval_prompts}"
    chat, tokenizer, t = models.chat, models.tokenizer, cfg.train
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.end_id
    store_root = Path(cfg.data.cache_dir).expanduser() / "store"
    total = len(train_examples) if hasattr(train_examples, "__len__") else None
    try:
        with clock.part("data store open and pack"):
            store = open_or_build(
                store_root, source_key, chat, lambda: train_examples, out.line, total, should_stop
            )
            train_set = build_train_set(store, t.seq_len, pad_id, t.packing, t.seed)
    except BuildStopped:
        out.line("data: stopped while building the token store (nothing of it kept)")
        return None
    except ShardDamaged as exc:  # names the shard and the way out
        raise BadInput(str(exc)) from None
    except DataError as exc:
        raise BadInput(f"{models.train_file}: {exc}") from None
    rows = "packed" if t.packing else "padded, one conversation each"
    global_batch = t.batch_size * place.workers
    out.line(
        f"data: {store.conversations} training conversations in {train_set.rows} rows of {t.seq_len} "
        f"tokens ({rows}; {train_set.real_token_share():.0%} real tokens, the rest padding), "
        f"{train_set.cut} cut to train.seq_len, {train_set.supervised_fraction():.0%} of tokens "
        f"supervised, {len(prompts)} held-out prompts; target layers {models.layer_ids}; one epoch is "
        f"{math.ceil(train_set.rows / global_batch):,} steps of {global_batch} rows "
        f"(train.steps {t.steps:,}: {t.steps * global_batch / max(train_set.rows, 1):.2f} epochs)"
    )
    return Loader(train_set, global_batch, t.seed), prompts


def regenerated_examples(cfg: Config, models: Models, place: Placement, out: Output, should_stop):
    """(training conversations, held-out prompts, data key), or None when a stop came during the
    regeneration. The conversations are an iterable of Example in the input's order, streamed from
    the regeneration's shard files (or tokenized from the data file as it is, data.regenerate:
    false); the key names that data (the regeneration's cache key, or raw-<file and tokenizer>).
    Every worker of the run regenerates its share of what the cache lacks (run/regen.py)."""
    tokenizer_path = Path(cfg.model.tokenizer_path).expanduser() if cfg.model.tokenizer_path else None
    source = DataSource(
        models.train_file,
        models.target_path,
        tokenizer_path or models.target_path,
        models.tokenizer,
        models.chat,
    )
    targets = [replica.target for replica in models.replicas]
    engines = Engines(place.devices, models.target_path, cfg.model.dtype, loaded=targets)
    out_dir = getattr(out, "out_dir", None)  # where this process writes the run's files, if it does
    for device in dict.fromkeys(place.devices):  # the data stage's own peak, not the warm-up's
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    store_root = Path(cfg.data.cache_dir).expanduser() / "store"

    def will_read(data_key: str) -> bool:  # the same key as load_data's token store
        return not store_built(store_root, f"{data_key}|held_out={cfg.train.eval_prompts}", models.chat)

    prepared = prepare_data(cfg, source, engines, place.world, out, should_stop, out_dir, will_read=will_read)
    release_data_stage_memory(place.devices, out)
    if prepared is None:
        return None
    return prepared.examples, prepared.eval_prompts, prepared.key


def release_data_stage_memory(devices: list[torch.device], out: Output) -> None:
    """Give the GPU memory the regeneration held (its KV caches, its compiled decode's buffers) back
    before training allocates its own, and say what is left and what the stage took at its peak."""
    release_engines()  # the paged engine kept for the next shards: its KV pool, before training's memory
    if devices[0].type != "cuda":
        return
    gc.collect()
    for device in dict.fromkeys(devices):
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
        in_use = torch.cuda.memory_allocated(device) / 2**30
        reserved = torch.cuda.memory_reserved(device) / 2**30
        out.line(
            f"data: GPU memory on {device} after the data stage: {in_use:.1f} GiB in use, {reserved:.1f} "
            f"GiB held (the stage's peak {peak:.1f} GiB)"
        )
        torch.cuda.reset_peak_memory_stats(device)


class Run:
    """What the loop works with once setup is done: the workers, the data, the output, and the
    evaluation, checkpoint and progress steps."""

    def __init__(self, cfg, out_dir, out, stop, world, topology, models, loader, eval_prompts, gpus=1):
        self.cfg, self.out_dir, self.out, self.stop, self.world = cfg, out_dir, out, stop, world
        self.topology, self.models, self.loader, self.eval_prompts = topology, models, loader, eval_prompts
        self.gpus = gpus  # the run's workers: each step's global batch is theirs
        self.flop_shape = FlopShape.of(models.target.config, models.layer_ids, cfg.drafter, cfg.train.seq_len)
        self.recompiles = RecompileWatch()
        self.tau0: float | None = None
        self.tau0_step = 0  # the step tau0 was evaluated at: a resume stands in for a step 0 never finished
        self.tau: float | None = None
        self.best_tau: float | None = None  # the best evaluation so far: its step is checkpointed
        self.new_best = False  # the evaluation of this step gave the best tau so far
        self.last_save = time.monotonic()  # for train.checkpoint_every_s
        self.stretches: list[dict] = []
        # Rank 0's host copy of a checkpoint, reused by the next one; written in the background
        # (train.async_checkpoints), a copy of every tensor, the host's too: training changes them.
        background = cfg.train.async_checkpoints
        self.writer_process: WriterProcess | None = None
        if background and cfg.train.checkpoint_writer == "process":
            self.staging = SharedStaging(host_too=True)
            self.writer_process = WriterProcess(self.staging)
            self.writer = CheckpointWriter(self.staging, background, self.writer_process.save)
        else:
            self.staging = HostStaging(host_too=background)
            self.writer = CheckpointWriter(self.staging, background)
        self.announcement: tuple[int, str, str] | None = None  # rank 0's last checkpoint written
        self.startup: StartupClock | None = None  # this start's clock, until its first step is logged
        self.first_weights: FirstEvaluationWeights | None = None  # train_models's, for the first evaluation
        self.resumed = False

    def restore(self, resume_from: ResumePoint | None, shape: Shape) -> int:
        """The step to start from: 0, or the checkpoint's (its state restored everywhere, on this
        shape of machine); the run's stretches go into the run record."""
        state = resume_from.state if resume_from is not None else None
        step = int(state["step"]) if state is not None else 0
        self.stretches = stretches_after(state, shape, step, runrecord.utc_now())
        if self.world.local_rank == 0:  # every host's record (each host's status reads its own)
            runrecord.note(self.out_dir, stretches=self.stretches)
        if resume_from is None:
            return 0
        self.resumed = True
        # load_models built the drafters with the state's weights (train_models)
        restore(state, self.topology, self.loader, self.cfg.train.seed, shape, built_with=True)
        self.tau0 = state["tau0"] if state["tau0"] >= 0 else None
        self.tau0_step = int(state.get("tau0_step", 0))
        self.out.line(describe_resume(resume_from, shape, self.loader, self.cfg.train.batch_size))
        if resume_from.cost:
            self.out.line(f"checkpoint read: {resume_from.path.name}, {resume_from.cost}")
        if self.world.is_lead:
            # A resumed run's latest tau is its last evaluation, not the first one.
            last_eval = runrecord.last_metrics(self.out_dir)["eval"]
            if last_eval and last_eval.get("step", -1) <= state["step"]:
                self.tau = float(last_eval["tau"])
            taus = evaluations(self.out_dir, up_to=step)
            self.best_tau = max(taus.values()) if taus else None
        return step

    def evaluate(self, step: int, weights: dict | None = None) -> float | None:
        """tau on the held-out prompts (rank 0's, logged on every host); None if a stop came.
        `weights`: the drafter's of an earlier step (drafter_weights), evaluated in its place."""
        m = self.models
        wait_for_parameters(m.replicas)
        with drafter_weights(m.replicas[0].drafter, weights):
            tau = acceptance_length(
                m.replicas[0].drafter, m.target, self.eval_prompts, m.layer_ids, self.cfg.drafter.block_size,
                m.mask_id, self.cfg.train.eval_max_new_tokens, m.chat.end_id, m.replicas[0].device,
                self.stop,
            )  # fmt: skip
        # Every rank evaluates the same drafter on the same prompts; rank 0's tau is the one every
        # host logs (CUDA kernels need not agree to the last bit across hosts).
        taus = self.world.gather(tau)
        if any(value is None for value in taus):
            return None
        self.tau = taus[0]
        self.new_best = self.best_tau is None or self.tau > self.best_tau
        self.best_tau = max(self.tau, self.best_tau or self.tau)
        self.out.line(f"eval step {step} tau {self.tau:.3f} prompts {len(self.eval_prompts)}")
        self.out.metric({"kind": "eval", "step": step, "tau": self.tau, "prompts": len(self.eval_prompts)})
        self.warn_about_recompiles()
        return self.tau

    def weights_before_first_step(self) -> dict:
        """The weights the first evaluation reads (FirstEvaluationWeights), a copy taken now where
        there are none; the wait for them is a part of the startup breakdown."""
        kept, self.first_weights = self.first_weights, None
        if kept is None:
            return host_copy(self.models.replicas[0].drafter)
        if self.startup is None:
            return kept.result()
        with self.startup.part("weights for the first evaluation"):
            return kept.result()

    def report_startup(self) -> None:
        """Where this start's time went, once its first progress line is out: a log line, and the
        run record's `startup` (a resume's replaces the start's; the log keeps both)."""
        if self.startup is None:
            return
        clock, self.startup = self.startup, None
        breakdown = clock.breakdown()
        self.out.line(describe_startup(breakdown, self.resumed, clock.graphs, clock.compiling))
        if self.world.local_rank == 0:
            runrecord.note(self.out_dir, startup={"resumed": self.resumed, "seconds": breakdown})

    def prepare_checkpoint(self) -> None:
        """Rank 0 allocates its host copy of a checkpoint while training goes on (HostStaging.prepare),
        for the tensors of checkpoint_state's drafter and optimizer, in that order. A sharded
        optimizer's state is gathered on the host at each checkpoint: the drafter's alone then."""
        if not self.world.is_lead:
            return
        first = self.topology.replicas[0]
        wait_for_parameters(self.topology.replicas)  # the workers' optimizer steps are done
        state = {"drafter": first.drafter.state_dict()}
        if first.shard is None:
            state["optimizer"] = first.optimizer.state_dict()
        self.staging.prepare(state)

    def save(self, step: int, final: bool = False) -> None:
        """A checkpoint of this step, written by rank 0 (a collective in the process topology):
        training waits for the host copy, the write goes on in the background (train.async_checkpoints)
        and is reported once it is on disk (`collect_checkpoint`); `final` (a stop, the last step)
        waits for it. The write before it is waited for first: the copy goes into its buffers.
        Weights that are no longer finite are never written: the newest checkpoint stays the last
        finite one."""
        began = time.perf_counter()
        finite = all(bool(torch.isfinite(p).all()) for p in self.models.replicas[0].params)
        if self.world.any(not finite):
            self.diverged(step, "the drafter's weights are not finite")
        writer = self.world.is_lead
        waited = (0.0, None)
        if writer:
            in_flight, before, waiting = self.writer.in_flight, self.writer.last_step, time.perf_counter()
            self.report(self.writer.wait())
            if in_flight:  # checkpoints came faster than one is written: training waited for it
                waited = (time.perf_counter() - waiting, before)
        self.announce()  # the ranks wait here for rank 0's write before: none races into its buffers
        state = checkpoint_state(
            step, self.cfg, self.topology, self.loader, self.tau0, self.stretches, self.tau0_step
        )
        if writer:
            self.writer.start(self.out_dir / "checkpoints", step, state, began, waited)
        del state  # the live tensors' references: the writer holds its copy
        self.last_save = time.monotonic()
        if final or not self.cfg.train.async_checkpoints:
            if writer:
                self.report(self.writer.wait(), final=final)
            self.announce()

    def save_final(self, step: int) -> None:
        self.save(step, final=True)

    def collect_checkpoint(self) -> None:
        """Report rank 0's background write if it has ended since (never waits for it)."""
        if self.world.is_lead:
            self.report(self.writer.poll())

    def close_checkpoints(self) -> None:
        """On the way out of a run: wait for rank 0's write in flight, say what became of it, and end
        the writer process (if any)."""
        if not self.world.is_lead:
            return
        try:
            written = self.writer.wait()
        except Exception as exc:  # the writer's own fault, beside the one that ends the run
            self.out.line(f"checkpoint step {self.writer.last_step} not saved: {type(exc).__name__}: {exc}")
            return
        finally:
            if self.writer_process is not None:
                self.writer_process.stop()
        self.report(written, then="")

    def report(self, written: Written | None, final: bool = False, then: str | None = None) -> None:
        """Rank 0's lines and run record for a checkpoint whose write has ended; the older ones
        pruned once it is on disk. A write that failed (a full disk, say) loses that checkpoint only:
        training goes on and the next one tries again; at a stop or the end it ends the run."""
        if written is None:
            return
        step = written.step
        if written.unstaged:
            self.out.line(f"checkpoint step {step}: written without a host copy: {written.unstaged}")
        if written.error is not None:
            runrecord.note(self.out_dir, checkpoint_lost={"step": step, "reason": str(written.error)})
            if final:
                raise written.error
            if then is None:
                then = "; training goes on, and the next checkpoint tries again"
            self.out.line(f"checkpoint step {step} not saved: {written.error}{then}")
            return
        self.out.line(f"checkpoint saved step {step} {written.path}")
        runrecord.note(self.out_dir, last_step=step, last_checkpoint=str(written.path), checkpoint_lost=None)
        self.out.line(self.keep_checkpoints(written))
        self.announcement = (step, socket.gethostname(), str(written.path))

    def announce(self) -> None:
        """A collective of several ranks: the others log where rank 0 put its last checkpoint once
        it is on disk (stop.yml reports that line on every host); rank 0's file is the run's only one."""
        announced, self.announcement = self.announcement, None
        if self.world.world_size == 1:
            return
        note = self.world.gather(announced if self.world.is_lead else None)[0]
        if note is not None and not self.world.is_lead:
            step, host, saved = note
            self.out.line(f"checkpoint saved step {step} by rank 0 on {host}: {saved}")

    def keep_checkpoints(self, written: Written) -> str:
        """Remove the checkpoints train.keep_checkpoints lets go (the new one is complete on disk);
        one line for the log: what the checkpoint cost, and what is kept."""
        directory = self.out_dir / "checkpoints"
        taus = evaluations(self.out_dir)
        saved = [saved_step for saved_step, _ in runrecord.checkpoints(self.out_dir)]
        evaluated = [saved_step for saved_step in saved if saved_step in taus]
        best = max(evaluated, key=lambda s: (taus[s], s)) if evaluated else None
        protected = {best} if best is not None else set()
        removed = prune_checkpoints(directory, self.cfg.train.keep_checkpoints, protected)
        kept = ", ".join(str(saved_step) for saved_step in saved if saved_step not in removed)
        waited = ""
        if written.waited_s >= 0.01:
            waited = (
                f" ({written.waited_s:.2f} s of it waiting for step {written.waited_for}'s write to end: "
                "checkpoints came faster than one is written)"
            )
        line = (
            f"checkpoint step {written.step}: training paused {written.paused_s:.2f} s{waited}; "
            f"{written.size / 2**30:.2f} GiB written in {written.write_s:.1f} s; kept steps {kept}"
        )
        if best is not None:
            line += f" (best tau {taus[best]:.3f} at step {best})"
        return line + (f"; removed steps {', '.join(map(str, removed))}" if removed else "")

    def checkpoint_due(self, step: int) -> bool:
        """A step, clock (train.checkpoint_every_s, agreed among ranks) or the last one's checkpoint."""
        t = self.cfg.train
        if step == t.steps or every(step, t.checkpoint_every):
            return True
        if not t.checkpoint_every_s:
            return False
        return self.world.any(time.monotonic() - self.last_save >= t.checkpoint_every_s)

    def diverged(self, step: int, what: str) -> None:
        """Stop the run: one line naming the step, the newest (finite) checkpoint and the way out.
        A write in the background is waited for first: the newest may be the one in flight."""
        if self.world.is_lead:
            with contextlib.suppress(Exception):  # the writer's own fault: close_checkpoints says it
                self.report(self.writer.wait(), then="")
        saved = runrecord.checkpoints(self.out_dir)
        kept = f"its newest checkpoint, step {saved[-1][0]}, is kept" if saved else "it has no checkpoint"
        if not self.world.is_lead:
            kept = "rank 0 keeps its newest checkpoint"
        raise Diverged(
            f"{what} at step {step} (train.lr {self.cfg.train.lr:g}); the run stopped, {kept}: "
            "lower train.lr or check the data, then resume or start fresh"
        )

    def log_progress(self, step: int, loss: float, meter: Throughput, row: bool = True) -> None:
        """The progress line; with `row`, the metrics row too (every train.log_every steps and the
        last: the first step of a start gets the line alone, so a resumed run's rows stay those of
        an uninterrupted one)."""
        window, eta, elapsed = meter.report(step)
        lr = self.models.replicas[0].scheduler.get_last_lr()[0]
        total = self.cfg.train.steps
        self.out.line(
            f"step {step}/{total} loss {loss:.4f} lr {lr:.2e} tok/s {window['tokens_per_s']:.0f} "
            f"padding {window['padding_share']:.0%} anchors {window['valid_anchor_share']:.0%} "
            + (f"mfu {window['mfu']:.0%} " if "mfu" in window else "")
            + f"eta {format_eta(eta)}"
        )
        if row:
            metrics = {"kind": "train", "step": step, "loss": loss, "lr": lr, **window}
            device = self.models.replicas[0].device
            if device.type == "cuda":  # the training stage's peak so far (the data stage's apart)
                metrics["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            self.out.metric({**metrics, "elapsed_s": elapsed})
        self.warn_about_recompiles()

    def warn_about_recompiles(self) -> None:
        for warning in self.recompiles.poll():
            self.out.line(warning)

    def finish(self, step: int) -> int:
        self.out.line(f"done: step {step}, tau {self.tau:.2f} (step {self.tau0_step}: {self.tau0:.2f})")
        if self.world.local_rank == 0:
            runrecord.note(
                self.out_dir, state="finished", exit_status=0, exit_reason="finished",
                last_step=step, tau=self.tau, ended_at=runrecord.utc_now(),
            )  # fmt: skip
        return 0


def evaluations(out_dir: Path, up_to: int | None = None) -> dict[int, float]:
    """tau by step from metrics.jsonl (a step trained again after a crash: its last row)."""
    rows = runrecord.jsonl_rows(out_dir / "metrics.jsonl")
    taus = {int(r["step"]): float(r["tau"]) for r in rows if r.get("kind") == "eval" and "tau" in r}
    return {step: tau for step, tau in taus.items() if up_to is None or step <= up_to}


@dataclass
class StepCount:
    """What one step's batch held: conversations' tokens, row slots, valid anchors, anchor slots,
    and the useful FLOPs of its work (trainer/run/flops.py)."""

    real_tokens: int
    row_tokens: int
    valid_anchors: int
    anchor_slots: int
    useful_flops: float = 0.0


class Throughput:
    """Over the steps since the last report: real tokens (conversations' tokens, not padding) per
    second, the padding share of the rows, the share of anchor slots with a real anchor, the useful
    TFLOP/s per GPU and (where the GPU's peak is known) the model FLOPs utilisation; and the time
    left. gpus: the run's workers, whose global batch each step counts."""

    def __init__(self, total_steps: int, gpus: int = 1, peak_flops: float | None = None):
        self.total_steps = total_steps
        self.gpus, self.peak_flops = max(gpus, 1), peak_flops
        self.started = self.window_start = time.monotonic()
        self.counts = StepCount(0, 0, 0, 0)
        self.steps = 0

    def add(self, count: StepCount) -> None:
        for name in ("real_tokens", "row_tokens", "valid_anchors", "anchor_slots", "useful_flops"):
            setattr(self.counts, name, getattr(self.counts, name) + getattr(count, name))
        self.steps += 1

    def report(self, step: int) -> tuple[dict[str, float], float, float]:
        """(the window's figures, seconds left, seconds since the start); starts a new window."""
        now = time.monotonic()
        seconds = max(now - self.window_start, 1e-9)
        c = self.counts
        window = {
            "tokens_per_s": c.real_tokens / seconds,
            "row_tokens_per_s": c.row_tokens / seconds,
            "padding_share": 1 - c.real_tokens / max(c.row_tokens, 1),
            "valid_anchor_share": c.valid_anchors / max(c.anchor_slots, 1),
            "tflops_per_gpu": c.useful_flops / seconds / self.gpus / 1e12,
        }
        if self.peak_flops:
            window["mfu"] = c.useful_flops / seconds / (self.gpus * self.peak_flops)
        eta = (now - self.window_start) / max(self.steps, 1) * (self.total_steps - step)
        self.window_start, self.counts, self.steps = now, StepCount(0, 0, 0, 0), 0
        return window, eta, now - self.started


def count_batch(batch: Batch, num_anchors: int, shape: FlopShape) -> StepCount:
    valid = valid_anchor_count(batch.loss_mask, batch.position_ids, num_anchors)
    rows, real_tokens = batch.input_ids.shape[0], batch.real_tokens
    squared = squared_conversation_lengths(batch.position_ids, batch.real)
    useful = shape.useful(real_tokens, squared, valid)
    return StepCount(real_tokens, batch.input_ids.numel(), valid, rows * num_anchors, useful)


def train_step(topology: Topology, loader: Loader) -> tuple[StepLoss | float, Batch, torch.Tensor]:
    """One optimisation step: the next global batch through every worker, reduced, applied."""
    batch = loader.next_batch()
    loss, _, norm = topology.step(batch.input_ids, batch.loss_mask, batch.position_ids)
    return loss, batch, norm


def every(step: int, interval: int) -> bool:
    return bool(interval) and step % interval == 0


def host_copy(drafter: torch.nn.Module) -> dict:
    return {name: value.detach().to("cpu", copy=True) for name, value in drafter.state_dict().items()}


@contextlib.contextmanager
def drafter_weights(drafter: torch.nn.Module, weights: dict | None):
    """Inside the block the drafter holds `weights` (a host_copy); after it, its own again, bit for
    bit, also when the block raises. Copied in place: compiled code sees the same tensors."""
    if weights is None:
        yield
        return
    own = host_copy(drafter)
    drafter.load_state_dict(weights)
    try:
        yield
    finally:
        drafter.load_state_dict(own)


def training_loop(run: Run, step: int) -> int:
    """Step, log, evaluate and checkpoint until the last step or a stop request (on any rank)."""
    cfg = run.cfg
    total = cfg.train.steps
    # The step-0 evaluation of a fresh start runs after the first step's progress line, on a copy
    # of the step-0 weights: launch.yml waits for that line, and the recipe's evaluation (32 prompts
    # of 256 new tokens, an untrained drafter needing a verify step a token) takes minutes. A resumed
    # run whose step-0 evaluation did not finish evaluates its resumed step's weights in its stead,
    # the same way: after its first step.
    initial = run.weights_before_first_step() if run.tau0 is None and step < total else None
    if run.tau0 is None and initial is None:  # resumed at the last step: nothing to train first
        run.tau0, run.tau0_step = run.evaluate(step), step
        if run.tau0 is None:
            return checkpoint_and_stop(run.out, run.stop, run.world, run.out_dir, step, run.save_final)
    run.tau = run.tau if run.tau is not None else run.tau0
    meter = Throughput(total, run.gpus, peak_flops(run.models.replicas[0].device))
    started = step
    first_step_began, graphs_before = time.perf_counter(), compiled_graphs()
    compiling_before = compile_seconds()
    while step < total:
        run.collect_checkpoint()
        if run.world.any(run.stop()):
            return checkpoint_and_stop(run.out, run.stop, run.world, run.out_dir, step, run.save_final)
        loss, batch, _ = train_step(run.topology, run.loader)
        step += 1
        meter.add(count_batch(batch, cfg.drafter.num_anchors, run.flop_shape))
        logs = step == total or every(step, cfg.train.log_every)
        # The first step of every start is logged too: launch.yml waits for a progress line, and
        # the recipe logs every 50 steps (80 s on one H200).
        first = step == started + 1
        saves = run.checkpoint_due(step)
        if logs or first or saves:
            # Read only where the loss is waited for anyway (a log line, a checkpoint): reading it
            # every step would stall the workers, which queue the next step before it is read.
            loss = float(loss)
            if not math.isfinite(loss):
                run.diverged(step, f"the loss is {loss}")
        if first and run.startup is not None:
            run.startup.add("first step", time.perf_counter() - first_step_began)
            run.startup.count_graphs("first step", graphs_before)
            run.startup.count_compiling("first step", compiling_before)
        if logs or first:
            run.log_progress(step, loss, meter, row=logs)
        if first:
            run.report_startup()
            run.prepare_checkpoint()
        if initial is not None:
            run.tau0, run.tau0_step = run.evaluate(started, weights=initial), started
            initial = None
            if run.tau0 is None:
                return checkpoint_and_stop(run.out, run.stop, run.world, run.out_dir, step, run.save_final)
            run.tau = run.tau if run.tau is not None else run.tau0
        run.new_best = False
        if (step == total or every(step, cfg.train.eval_every)) and run.evaluate(step) is None:
            return checkpoint_and_stop(run.out, run.stop, run.world, run.out_dir, step, run.save_final)
        if saves or (run.new_best and cfg.train.keep_checkpoints):
            run.save(step, final=step == total)
    return run.finish(step)


def checkpoint_and_stop(
    out: Output, stop: StopFlag, world: World, out_dir: Path, step: int, save=None
) -> int:
    """A stop request: checkpoint this step (when training has begun), record it, exit 0."""
    # In the process topology the signal may have reached another rank only.
    out.line(f"signal {stop.signal_name or 'on another rank'}: checkpointing and exiting")
    if save is not None:
        save(step)
    else:
        out.line("nothing to checkpoint yet (training had not started)")
    out.line(f"stopped at step {step}")
    reason = f"stopped at step {step}" + ("" if save is not None else ", before training began")
    if world.local_rank == 0:
        runrecord.note(
            out_dir, state="stopped", exit_status=0, exit_reason=reason, last_step=step,
            ended_at=runrecord.utc_now(),
        )  # fmt: skip
    sys.stdout.flush()
    return 0
