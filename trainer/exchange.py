"""Gradient exchange of the threaded topology: buckets summed across replicas during the backward.

Every replica's trainable gradients live in one flat buffer of its own (each parameter's `.grad` is
a view into it, so autograd accumulates straight into the buffer and nothing is flattened or copied
per step). The buffer is cut into buckets of about `bucket_bytes`, in reverse parameter order, which
is about the order in which the backward pass finishes them. A hook on every parameter counts the
gradients of its bucket; once a replica has finished a bucket it tells the exchange thread, with a
CUDA event marking the point in its stream. As soon as every replica has finished a bucket, the
exchange thread sums it across replicas and multiplies it by 1 / (global loss-weight sum), while the
replicas' backward passes go on with the next buckets: the exchange overlaps the backward, as DDP's
bucketed all-reduce does in the process topology.

On CUDA the sum is torch.cuda.nccl.all_reduce over the bucket's views, one per device, on a
communication stream per device that first waits for the replica's event (NCCL driven from one
thread, no process group). Elsewhere (CPU workers) the bucket is summed by copies in replica order:
the arithmetic of the process topology's gloo all-reduce (g0 + g1 + ..., then times the scale), so
both topologies give the same losses to the last bit.

Per step a worker calls `report_weight` before its forward (the scale needs the global weight sum),
`finish` after its backward (buckets of parameters that got no gradient count as finished then), and
`wait_reduced` before its optimizer step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch


class ExchangeFailed(RuntimeError):
    """The exchange thread failed or timed out; the step cannot complete."""


def plan_buckets(sizes: Sequence[int], element_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Cut parameters (sizes in elements, in buffer order) into contiguous buckets of about
    bucket_bytes: [(first parameter, one past the last)]. A parameter is never split."""
    buckets, first, filled = [], 0, 0
    for index, size in enumerate(sizes):
        filled += size * element_bytes
        if filled >= bucket_bytes:
            buckets.append((first, index + 1))
            first, filled = index + 1, 0
    if first < len(sizes):
        buckets.append((first, len(sizes)))
    return buckets


class GradientExchange:
    def __init__(self, replicas, timeout_s: float, bucket_bytes: int = 256 << 20):
        self.replicas = replicas
        self.timeout_s = timeout_s
        # Buffer order: parameters in reverse, so the first buckets are the ones backward ends first.
        self.order = list(reversed(range(len(replicas[0].params))))
        sizes = [replicas[0].params[i].numel() for i in self.order]
        element_bytes = replicas[0].params[0].element_size()
        self.buckets = plan_buckets(sizes, element_bytes, bucket_bytes)
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = offsets
        self.bucket_of = {}  # parameter index -> bucket index
        for bucket, (first, last) in enumerate(self.buckets):
            for position in range(first, last):
                self.bucket_of[self.order[position]] = bucket
        self.bucket_sizes = [last - first for first, last in self.buckets]
        self.flats: list[torch.Tensor | None] = [None] * len(replicas)
        self.cuda = all(r.device.type == "cuda" for r in replicas) and len(
            {r.device for r in replicas}
        ) == len(replicas)
        self.streams = [torch.cuda.Stream(r.device) for r in replicas] if self.cuda else []
        self.lock = threading.Lock()
        self.armed = [False] * len(replicas)
        self.pending = [list(self.bucket_sizes) for _ in replicas]
        self.inbox: queue.Queue = queue.Queue()
        self.reduced: list[queue.Queue] = [queue.Queue() for _ in replicas]
        self.thread = threading.Thread(target=self._run, name="gradient-exchange", daemon=True)
        self.thread.start()

    # -- worker side --------------------------------------------------------------------------

    def attach(self, rank: int) -> None:
        """Give replica `rank` its flat gradient buffer and hooks (after its warm-up, in its thread)."""
        replica = self.replicas[rank]
        params = replica.params
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"the gradient exchange needs one parameter dtype, got {sorted(map(str, dtypes))}"
            )
        flat = torch.zeros(self.offsets[-1], dtype=params[0].dtype, device=replica.device)
        for position, index in enumerate(self.order):
            param = params[index]
            param.grad = flat[self.offsets[position] : self.offsets[position + 1]].view_as(param)
            param.register_post_accumulate_grad_hook(self._hook(rank, self.bucket_of[index]))
        self.flats[rank] = flat
        replica.grad_buffer = flat

    def _hook(self, rank: int, bucket: int):
        def on_gradient(_param: torch.Tensor) -> None:
            if not self.armed[rank]:
                return  # a backward outside a step (the warm-up's happens before attach anyway)
            with self.lock:
                self.pending[rank][bucket] -= 1
                finished = self.pending[rank][bucket] == 0
            if finished:
                self.inbox.put(("bucket", rank, (bucket, self._mark(rank))))

        return on_gradient

    def _mark(self, rank: int):
        """An event at this point of the replica's current stream (None on CPU: work is done)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.replicas[rank].device))
        return event

    def report_weight(self, rank: int, weight_sum: float) -> float:
        """Before the forward: this shard's loss-weight sum; arms the hooks. Returns the loss scale."""
        with self.lock:
            self.pending[rank] = list(self.bucket_sizes)
        self.armed[rank] = True
        self.inbox.put(("weight", rank, weight_sum))
        return 1.0

    def finish(self, rank: int) -> None:
        """After the backward: buckets still open (parameters that got no gradient) count as done."""
        self.armed[rank] = False
        with self.lock:
            open_buckets = [b for b, count in enumerate(self.pending[rank]) if count > 0]
            for bucket in open_buckets:
                self.pending[rank][bucket] = 0
        event = self._mark(rank) if open_buckets else None
        for bucket in open_buckets:
            self.inbox.put(("bucket", rank, (bucket, event)))

    def wait_reduced(self, rank: int) -> None:
        """Block until every bucket of this step is summed; order this device's stream after it."""
        try:
            outcome = self.reduced[rank].get(timeout=self.timeout_s)
        except queue.Empty:
            raise ExchangeFailed(
                f"gradients were not exchanged within parallel.step_timeout_s={self.timeout_s}"
            ) from None
        if isinstance(outcome, BaseException):
            raise ExchangeFailed(f"gradient exchange failed: {outcome!r}") from outcome
        if outcome is not None:
            torch.cuda.current_stream(self.replicas[rank].device).wait_event(outcome)

    def close(self) -> None:
        self.inbox.put(None)

    # -- exchange thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._one_step():
                pass
        except BaseException as exc:  # tell every waiting worker instead of leaving it blocked
            for box in self.reduced:
                box.put(exc)

    def _one_step(self) -> bool:
        n = len(self.replicas)
        weights: dict[int, float] = {}
        ready: list[dict[int, object]] = [{} for _ in self.buckets]
        waiting: list[int] = []  # buckets finished everywhere, before the weights were all known
        remaining = len(self.buckets)
        while remaining:
            message = self.inbox.get()
            if message is None:
                return False
            kind, rank, payload = message
            if kind == "weight":
                weights[rank] = payload
            else:
                bucket, event = payload
                ready[bucket][rank] = event
                if len(ready[bucket]) == n:
                    waiting.append(bucket)
            if len(weights) == n:
                scale = 1.0 / max(sum(weights[r] for r in range(n)), 1e-12)
                for bucket in waiting:
                    self._reduce(bucket, ready[bucket], scale)
                remaining -= len(waiting)
                waiting = []
        done = [self._mark_stream(rank) for rank in range(n)]
        for rank in range(n):
            self.reduced[rank].put(done[rank])
        return True

    def _views(self, bucket: int) -> list[torch.Tensor]:
        first, last = self.buckets[bucket]
        start, end = self.offsets[first], self.offsets[last]
        return [flat[start:end] for flat in self.flats]

    def _reduce(self, bucket: int, events: dict[int, object], scale: float) -> None:
        views = self._views(bucket)
        if not self.cuda:
            total = views[0].clone()
            for other in views[1:]:
                total += other
            total.mul_(scale)
            for view in views:
                view.copy_(total)
            return
        for rank, stream in enumerate(self.streams):
            if events[rank] is not None:
                stream.wait_event(events[rank])
        torch.cuda.nccl.all_reduce(views, streams=self.streams)
        for view, stream in zip(views, self.streams, strict=True):
            with torch.cuda.device(view.device), torch.cuda.stream(stream):
                view.mul_(scale)

    def _mark_stream(self, rank: int):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.streams[rank])
        return event
