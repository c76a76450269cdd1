"""The threaded topology: one process, one worker thread per device, a coordinator feeding them.

Each step the coordinator splits the global batch into one shard per worker and puts it on that
worker's queue; each worker runs forward and backward on its own replica while the gradient exchange
(trainer/parallel/exchange.py) sums finished gradient buckets across replicas during the backward, then
applies the update itself, so the replicas' optimizer steps run side by side and every replica
applies the same update (as DDP does: identical gradients and optimizer states keep replicas
identical). The coordinator collects the answers. With one worker there is nothing to exchange: the
worker scales its gradients by 1 / loss-weight sum. With parallel.shard_optimizer each worker updates
only its slice of the parameters and the exchange gathers the slices (trainer/parallel/sharding.py).

A worker that raises sends its traceback to the coordinator, which stops every worker and raises
WorkerFailed; workers are daemon threads blocked only on their queues, so none can hang the exit.
Dynamo is not thread safe and compiles lazily, so workers compile and warm up one at a time under
a lock before any concurrent step.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable

import torch

from .exchange import GradientExchange
from .replica import Replica, StepLoss, StepResult
from .sharding import OptimizerShard


class WorkerFailed(Exception):
    def __init__(self, rank: int, device: torch.device, trace: str, rows: int | None = None):
        super().__init__(f"worker {rank} on {device} failed:\n{trace}")
        self.rank = rank
        self.trace = trace
        self.hint = out_of_memory_hint(device, trace, rows)


def out_of_memory_hint(device: torch.device, trace: str, rows: int | None) -> str | None:
    """The way out of a worker's failure that was its GPU's memory running out (its traceback's
    last line says so), or None."""
    last = trace.strip().splitlines()[-1] if trace.strip() else ""
    if not last.startswith("torch.OutOfMemoryError"):
        return None
    at = f" at train.batch_size={rows}" if rows else ""
    return (
        f"{device} ran out of memory in the training step{at}: lower train.batch_size, or free the GPU "
        "of other processes (at the qwen3-8b recipe's shape a first start into an empty compile cache "
        "fitted 6 rows on an 80 GB H100, and 8 rows fit a 141 GB H200)"
    )


class ThreadedWorld:
    """The threaded topology's place among ranks: one process, rank 0 of 1. Its collectives are
    the identity, so the run's code is the same for threads and for ranks under torchrun."""

    rank = 0
    local_rank = 0
    world_size = 1
    is_lead = True

    def any(self, flag: bool) -> bool:
        return flag

    def gather(self, obj: object) -> list:
        return [obj]

    def close(self) -> None:
        pass


class ThreadedTopology:
    def __init__(self, replicas: list[Replica], step_timeout_s: float, log: Callable[[str], None]):
        self.replicas = replicas
        self.step_timeout_s = step_timeout_s
        self.log = log
        self.compile_lock = threading.Lock()
        # A stop while the workers compile: their lines after it would say they finished after the
        # run's "stopped at step 0"; they say nothing more once it is given up (under say_lock).
        self.say_lock = threading.Lock()
        self.given_up = False
        parallel = replicas[0].cfg.parallel
        shard = parallel.shard_optimizer and len(replicas) > 1
        self.exchange = (
            GradientExchange(replicas, step_timeout_s, parallel.bucket_mb << 20, shard=shard)
            if len(replicas) > 1
            else None
        )
        if shard:
            # Before the workers compile: the parameters move into the exchange's flat buffers.
            for rank, replica in enumerate(replicas):
                replica.use_shard(OptimizerShard(self.exchange, rank))
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in replicas]
        self.step_ends: list[torch.cuda.Event | None] = [None] * len(replicas)
        self.outbox: queue.Queue = queue.Queue()
        self.threads = [
            threading.Thread(target=self._work, args=(rank,), name=f"worker-{rank}", daemon=True)
            for rank in range(len(replicas))
        ]

    def _work(self, rank: int) -> None:
        replica = self.replicas[rank]
        try:
            if replica.device.type == "cuda":
                torch.cuda.set_device(replica.device)  # the current device is per thread
            with self.compile_lock:
                self._compile(replica)
            if self.exchange is not None:
                self.exchange.attach(rank)
            self.outbox.put(("ready", rank, None))
            while True:
                shard = self.inboxes[rank].get()
                if shard is None:
                    return
                self.outbox.put(("done", rank, self._train_shard(rank, *shard)))
        except BaseException:
            self.outbox.put(("error", rank, traceback.format_exc()))

    def _compile(self, replica: Replica) -> None:
        began = time.monotonic()
        if replica.cfg.compile.mode != "none":
            cudagraphs = replica.cfg.compile.uses_cudagraphs
            self._say(f"drafter on {replica.device}: compiling forward (cudagraphs={cudagraphs})")
        replica.compile()
        replica.warm_up()
        if replica.cfg.compile.mode != "none":
            took = time.monotonic() - began
            self._say(f"drafter on {replica.device}: compiled and warmed up in {took:.1f}s")

    def _say(self, text: str) -> None:
        with self.say_lock:
            if not self.given_up:
                self.log(text)

    def _train_shard(
        self, rank: int, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[StepResult, torch.Tensor]:
        """Forward and backward on this worker's shard, gradients exchanged, the update applied."""
        replica = self.replicas[rank]
        if self.exchange is None:
            # One worker: the update divides the gradient of the loss sum by its weight (the
            # exchange does this otherwise).
            result = replica.compute(ids, mask, position_ids=positions)
            norm = replica.apply_update(weight_sum=result.weight_sum)
        else:
            result = replica.compute(
                ids, mask, loss_scale=lambda weight: self.exchange.report_weight(rank, weight),
                position_ids=positions,
            )  # fmt: skip
            self.exchange.finish(rank)
            self.exchange.wait_reduced(rank)
            norm = replica.apply_update()
        self._bound_queue(rank)
        return result, norm

    def _bound_queue(self, rank: int) -> None:
        """Nothing in a step waits for the device, so the host prepares the next step while this
        one runs (no idle device between steps); it is held back once it is a whole step ahead."""
        device = self.replicas[rank].device
        if device.type != "cuda":
            return
        previous = self.step_ends[rank]
        self.step_ends[rank] = torch.cuda.Event()
        self.step_ends[rank].record(torch.cuda.current_stream(device))
        if previous is not None:
            previous.synchronize()

    def _collect(self, expected: str, should_stop: Callable[[], bool] | None) -> dict[int, object] | None:
        """Wait for one message per worker; None if should_stop() turns true meanwhile."""
        answers: dict[int, object] = {}
        deadline = time.monotonic() + self.step_timeout_s
        while len(answers) < len(self.replicas):
            if should_stop is not None and should_stop():
                return None
            try:
                kind, rank, payload = self.outbox.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"workers did not answer within parallel.step_timeout_s={self.step_timeout_s}"
                    ) from None
                continue
            if kind == "error":
                replica = self.replicas[rank]
                raise WorkerFailed(rank, replica.device, str(payload), replica.cfg.train.batch_size)
            if kind != expected:
                raise RuntimeError(f"worker {rank} sent {kind!r} while {expected!r} was expected")
            answers[rank] = payload
        return answers

    def launch(self) -> None:
        """Start the workers; each compiles and warms up in turn, then waits for shards."""
        for thread in self.threads:
            thread.start()

    def wait_ready(self, should_stop: Callable[[], bool]) -> bool:
        """Wait until every worker has warmed up. False if should_stop() turned true first: from then
        on the workers' compile lines are left out (the run's stop lines come after this)."""
        if self._collect("ready", should_stop) is not None:
            return True
        with self.say_lock:
            self.given_up = True
        return False

    def step(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[StepLoss, int, torch.Tensor]:
        """One optimisation step on the global batch: (loss, read with float(), which waits for the
        step; tokens; gradient norm as a tensor on the first device, read likewise)."""
        workers = len(self.replicas)
        shards_ids = input_ids.chunk(workers)
        shards_mask = loss_mask.chunk(workers)
        shards_positions = position_ids.chunk(workers) if position_ids is not None else [None] * workers
        for inbox, ids, mask, positions in zip(
            self.inboxes, shards_ids, shards_mask, shards_positions, strict=True
        ):
            inbox.put((ids, mask, positions))
        answers = self._collect("done", None)
        assert answers is not None
        results: list[StepResult] = [answers[rank][0] for rank in range(len(self.replicas))]  # type: ignore[index]
        loss = StepLoss([r.loss_sum for r in results], sum(r.weight_sum for r in results))
        return loss, sum(r.tokens for r in results), answers[0][1]  # type: ignore[index]

    def worker_rng(self) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """Every worker's anchor generator state, and every CUDA device's RNG state (key: device)."""
        cuda = {
            str(r.device): torch.cuda.get_rng_state(r.device)
            for r in self.replicas
            if r.device.type == "cuda"
        }
        return [r.anchor_generator.get_state() for r in self.replicas], cuda

    def set_worker_rng(self, workers: list[torch.Tensor], cuda: dict[str, torch.Tensor]) -> None:
        for replica, generator_state in zip(self.replicas, workers, strict=True):
            replica.anchor_generator.set_state(generator_state)
        for device, state in cuda.items():
            torch.cuda.set_rng_state(state, torch.device(device))

    def close(self, timeout_s: float = 5.0) -> None:
        """Tell every worker to finish and wait for them (bounded; they are daemon threads)."""
        for inbox in self.inboxes:
            inbox.put(None)
        if self.exchange is not None:
            self.exchange.close()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        if self.exchange is not None and not any(thread.is_alive() for thread in self.threads):
            self.exchange.release(max(0.0, deadline - time.monotonic()))
