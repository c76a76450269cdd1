"""The process topology: one process per device, started by torchrun, gradients reduced by DDP.

Model, data, objective, checkpoints and metrics are the threaded topology's (trainer/run/train.py drives
both); only how workers start and how gradients are reduced differ. torchrun starts one process per
device and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; `ProcessWorld` joins the
process group (NCCL on CUDA, gloo on CPU) with a finite timeout, so a collective waiting for a dead
peer ends in an error instead of a hang (torchrun also tears the other ranks down when one dies).
Started without torchrun, the run is a world of one process (an in-memory store, no network).

Why DDP and not FSDP2: the drafter is small next to its target (about 1B trainable parameters at
the Qwen3-8B shape: five layers plus the context projection; embedding and LM head are the frozen
target's), so drafter, gradients and AdamW state fit on one GPU beside the target. Replicated data
parallelism is then the simplest and the fastest choice: one bucketed all-reduce per step that
overlaps the backward, and no parameter gathers in forward or backward. Sharding (FSDP2) pays only
when the model or its optimizer state does not fit on one device.

Same global batch and seed as the threaded topology: every rank draws the same global batch from an
identically seeded loader and takes its own shard (rank r: the r-th chunk, as thread r gets), and
rank r samples anchors from the generator thread r would use. The gradient is the same too: the
threaded coordinator divides the summed gradient of the weighted loss sums by the global weight
sum. DDP's bucketed all-reduce keeps its overlap with the backward, but its reduction is replaced
by a communication hook that does exactly that: sum the buckets over ranks, then multiply by
1 / global weight sum (all-reduced before the forward). On CPU with two ranks this is the very
arithmetic of the threaded coordinator (g0 + g1, then times the same factor), so losses match to
the last bit; DDP's own averaging (scaling the loss by world_size / weight sum) differs in
rounding, and Adam's first steps amplify that into visible loss differences within a few steps.

Stopping: SIGTERM/SIGINT set a flag on the rank that gets it (torchrun forwards them to every rank);
the ranks all-reduce the flags at every step boundary, so all stop after the same step, rank 0
writes the checkpoint and every rank exits 0.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .replica import Replica


class ProcessSetupError(Exception):
    """The process group cannot be set up as configured (bad input: exit 2)."""


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def exit_with_parent() -> None:
    """SIGTERM this rank when torchrun dies (even by SIGKILL): torchrun starts every rank in a
    session of its own, so nothing else would reach it, and it would train on as an orphan. On
    SIGTERM the ranks agree to stop and checkpoint as usual (Linux only; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class ProcessWorld:
    """This process's place in the process group: rank, world size, device, and small collectives."""

    def __init__(self, devices: list[torch.device], timeout_s: float):
        if launched_by_torchrun():
            exit_with_parent()
            self.rank = int(os.environ["RANK"])
            self.world_size = int(os.environ["WORLD_SIZE"])
            self.local_rank = int(os.environ["LOCAL_RANK"])
        else:
            self.rank, self.world_size, self.local_rank = 0, 1, 0
        if devices[0].type == "cuda":
            if self.local_rank >= len(devices):
                raise ProcessSetupError(
                    f"torchrun started local rank {self.local_rank} but parallel.devices names "
                    f"{len(devices)} GPU(s) on this host; start one process per GPU "
                    "(--nproc-per-node = the number of GPUs) or list more in parallel.devices"
                )
            self.device = devices[self.local_rank]
            torch.cuda.set_device(self.device)
            self.backend = "nccl"
        else:
            self.device = torch.device("cpu")
            self.backend = "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if launched_by_torchrun() and restart > 0:
            # torchrun restarted the ranks (--max-restarts): its store still holds the previous
            # attempt's keys (the ranks' old addresses), which a new process group would read and
            # fail to connect to. A prefix per attempt keeps each attempt's keys apart.
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(f"dflash/attempt_{restart}", store),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                device_id=self.device if self.device.type == "cuda" else None,
            )
        elif launched_by_torchrun():
            dist.init_process_group(
                self.backend,
                timeout=timeout,
                device_id=self.device if self.device.type == "cuda" else None,
            )
        else:
            dist.init_process_group(
                self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on any rank (a collective: every rank must call it)."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (a collective)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, obj: object) -> list:
        """Every rank's object, in rank order, on every rank (a collective)."""
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_bytes(self, data: bytes | None, chunk_bytes: int = 64 << 20) -> bytes:
        """Rank 0's `data` on every rank (a collective; the other ranks pass None). Sent in chunks
        through this rank's device, so a checkpoint of many GB never needs one tensor of its size
        (broadcast_object_list would pickle it whole, and on NCCL copy it whole to the GPU)."""
        if self.is_lead and data is None:
            raise ValueError("rank 0 must pass the bytes to broadcast")
        size = torch.tensor([len(data) if self.is_lead else 0], device=self.device)
        dist.broadcast(size, src=0)
        total = int(size.item())
        received = bytearray(0 if self.is_lead else total)
        for start in range(0, total, chunk_bytes):
            length = min(chunk_bytes, total - start)
            if self.is_lead:
                with warnings.catch_warnings():
                    # bytes are read-only; the tensor over them is only read (and copied) here.
                    warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
                    view = torch.frombuffer(data, dtype=torch.uint8, count=length, offset=start)
                chunk = view.to(self.device, copy=True)
            else:
                chunk = torch.empty(length, dtype=torch.uint8, device=self.device)
            dist.broadcast(chunk, src=0)
            if not self.is_lead:
                memoryview(received)[start : start + length] = chunk.cpu().numpy()
        return data if self.is_lead else bytes(received)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class ProcessTopology:
    """One replica in this process, its objective wrapped in DDP; the step takes this rank's shard."""

    def __init__(self, replica: Replica, world: ProcessWorld, log: Callable[[str], None]):
        self.replica = replica
        self.replicas = [replica]
        self.world = world
        self.log = log
        frozen = [name for name, param in replica.objective.named_parameters() if not param.requires_grad]
        # The frozen parts (the target's embedding and LM head) are identical on every rank by
        # construction: leave them out of DDP's start-up broadcast.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(replica.objective, frozen)
        self.grad_scale = 1.0
        self.global_weight = 0.0
        replica.wrap(self._ddp)

    def _ddp(self, module: torch.nn.Module) -> DistributedDataParallel:
        with warnings.catch_warnings():
            # Newer torch renames broadcast_buffers; the old name keeps working on every version.
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            ddp = DistributedDataParallel(
                module,
                device_ids=[self.world.device] if self.world.device.type == "cuda" else None,
                broadcast_buffers=False,  # the buffers (rotary tables) are constants, equal everywhere
                gradient_as_bucket_view=True,
                bucket_cap_mb=self.replica.cfg.parallel.bucket_mb,
            )

        # Unannotated on purpose: DDP checks the hook's annotations against the real classes, and
        # `from __future__ import annotations` would turn them into strings.
        def sum_then_scale(_state, bucket):
            """A bucket becomes its sum over ranks times this step's grad_scale."""
            scale = self.grad_scale
            future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return future.then(lambda done: done.value()[0].mul_(scale))

        ddp.register_comm_hook(None, sum_then_scale)
        return ddp

    def launch(self) -> None:
        """Compile and warm up now, in this process (the warm-up's backward is DDP's first all-reduce)."""
        cfg = self.replica.cfg
        if cfg.compile.mode != "none":
            self.log(
                f"drafter on {self.replica.device}: compiling forward "
                f"(cudagraphs={cfg.compile.uses_cudagraphs}, {self.world.world_size} process(es))"
            )
        self.replica.compile()
        self.replica.warm_up()

    def wait_ready(self, should_stop: Callable[[], bool]) -> bool:
        """Every rank is warmed up (launch returned); False on every rank if any was asked to stop."""
        return not self.world.any(should_stop())

    def _loss_scale(self, weight_sum: float) -> float:
        """Before the forward: the global weight sum sets the gradient scale of this step."""
        (self.global_weight,) = self.world.sum([weight_sum])
        self.grad_scale = 1.0 / max(self.global_weight, 1e-12)
        return 1.0

    def step(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[float, int, torch.Tensor]:
        """One optimisation step on the global batch (this rank computes its shard): (loss, tokens,
        gradient norm as a tensor: reading it waits for the update)."""
        size, rank = self.world.world_size, self.world.rank
        ids = input_ids.chunk(size)[rank]
        mask = loss_mask.chunk(size)[rank]
        positions = None if position_ids is None else position_ids.chunk(size)[rank]
        result = self.replica.compute(ids, mask, loss_scale=self._loss_scale, position_ids=positions)
        # Before the update is queued: this collective then waits only for the backward, and the
        # optimizer step runs on the device while the host prepares the next step.
        loss_sum, tokens = self.world.sum([float(result.loss_sum), float(result.tokens)])
        norm = self.replica.apply_update()
        return loss_sum / max(self.global_weight, 1e-12), int(tokens), norm

    def worker_rng(self) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """Every rank's anchor generator state (rank order) and CUDA RNG state (key rank<N>)."""
        cuda = torch.cuda.get_rng_state(self.replica.device) if self.replica.device.type == "cuda" else None
        states = self.world.gather((self.replica.anchor_generator.get_state(), cuda))
        return [s[0] for s in states], {f"rank{r}": s[1] for r, s in enumerate(states) if s[1] is not None}

    def set_worker_rng(self, workers: list[torch.Tensor], cuda: dict[str, torch.Tensor]) -> None:
        self.replica.anchor_generator.set_state(workers[self.world.rank])
        own = cuda.get(f"rank{self.world.rank}")
        if own is not None and self.replica.device.type == "cuda":
            torch.cuda.set_rng_state(own, self.replica.device)

    def close(self, timeout_s: float = 5.0) -> None:
        """Nothing to join: the process group is the world's to close."""
