"""The threaded topology: one process, one worker thread per device, a coordinator feeding them.

Each step the coordinator splits the global batch into one shard per worker and puts it on that
worker's queue; workers run forward and backward on their own replica and answer on a shared queue;
the coordinator then averages the gradients across replicas and every replica applies the same
update (as DDP does: identical gradients and optimizer states keep replicas identical).

Gradient averaging: with several CUDA devices, torch.cuda.nccl.all_reduce over one flat gradient
buffer per device. It is NCCL's collective driven from a single thread of a single process (one
tensor per GPU, no process group or rendezvous needed), so it uses NVLink/P2P like DDP does, with
one call per step. It runs in the coordinator while every worker waits for its next shard, so no
worker stream is busy. Otherwise (CPU, one device, or no NCCL) the buffers are summed by device
copies onto the first device and copied back: exact, and trivially cheap for one worker.

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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .replica import Replica, StepResult


class WorkerFailed(Exception):
    def __init__(self, rank: int, device: torch.device, trace: str):
        super().__init__(f"worker {rank} on {device} failed:\n{trace}")
        self.rank = rank
        self.trace = trace


def average_gradients(replicas: list[Replica], total_weight: float) -> None:
    """Every replica's gradient becomes sum(all replicas' gradients) / total_weight."""
    scale = 1.0 / max(total_weight, 1e-12)
    grads = [[p.grad if p.grad is not None else torch.zeros_like(p) for p in r.params] for r in replicas]
    flats = [_flatten_dense_tensors(g) for g in grads]
    if len(flats) > 1 and all(f.is_cuda for f in flats) and torch.cuda.nccl.is_available(flats):
        torch.cuda.nccl.all_reduce(flats)  # in place: every buffer now holds the sum
        for flat in flats:
            flat.mul_(scale)
    else:
        total = flats[0].clone()
        for other in flats[1:]:
            total += other.to(total.device)
        total.mul_(scale)
        flats = [total.to(f.device, copy=True) for f in flats]  # a buffer of its own per replica
    for replica, replica_grads, flat in zip(replicas, grads, flats, strict=True):
        for param, grad in zip(replica.params, _unflatten_dense_tensors(flat, replica_grads), strict=True):
            param.grad = grad


class ThreadedTopology:
    def __init__(self, replicas: list[Replica], step_timeout_s: float, log: Callable[[str], None]):
        self.replicas = replicas
        self.step_timeout_s = step_timeout_s
        self.log = log
        self.compile_lock = threading.Lock()
        self.inboxes: list[queue.Queue] = [queue.Queue() for _ in replicas]
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
                cudagraphs = replica.cfg.compile.uses_cudagraphs
                if replica.cfg.compile.mode != "none":
                    self.log(f"drafter on {replica.device}: compiling forward (cudagraphs={cudagraphs})")
                replica.compile()
                replica.warm_up()
            self.outbox.put(("ready", rank, None))
            while True:
                shard = self.inboxes[rank].get()
                if shard is None:
                    return
                self.outbox.put(("done", rank, replica.compute(*shard)))
        except BaseException:
            self.outbox.put(("error", rank, traceback.format_exc()))

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
                raise WorkerFailed(rank, self.replicas[rank].device, str(payload))
            if kind != expected:
                raise RuntimeError(f"worker {rank} sent {kind!r} while {expected!r} was expected")
            answers[rank] = payload
        return answers

    def launch(self) -> None:
        """Start the workers; each compiles and warms up in turn, then waits for shards."""
        for thread in self.threads:
            thread.start()

    def wait_ready(self, should_stop: Callable[[], bool]) -> bool:
        """Wait until every worker has warmed up. False if should_stop() turned true first."""
        return self._collect("ready", should_stop) is not None

    def step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, int, float]:
        """One optimisation step on the global batch: (loss, tokens, grad norm)."""
        shards_ids = input_ids.chunk(len(self.replicas))
        shards_mask = loss_mask.chunk(len(self.replicas))
        for inbox, ids, mask in zip(self.inboxes, shards_ids, shards_mask, strict=True):
            inbox.put((ids, mask))
        answers = self._collect("done", None)
        assert answers is not None
        results: list[StepResult] = [answers[rank] for rank in range(len(self.replicas))]  # type: ignore[misc]
        loss_sum = sum(r.loss_sum for r in results)
        weight_sum = sum(r.weight_sum for r in results)
        average_gradients(self.replicas, weight_sum)
        norms = [replica.apply_update() for replica in self.replicas]
        return loss_sum / max(weight_sum, 1e-12), sum(r.tokens for r in results), norms[0]

    def close(self, timeout_s: float = 5.0) -> None:
        """Tell every worker to finish and wait for them (bounded; they are daemon threads)."""
        for inbox in self.inboxes:
            inbox.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
