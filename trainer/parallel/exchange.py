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

Sharded update (parallel.shard_optimizer, ZeRO stage 1): each bucket is padded to split into one
equal slice per replica, and replica r updates slice r of every bucket only. The parameters become
views of a second flat buffer laid out like the gradients. A finished bucket is reduce-scattered
instead of all-reduced (on CPU: each slice summed by copies in replica order, the same arithmetic),
so each replica holds the summed gradient of its slices. Before its optimizer step a worker calls
`sum_across_replicas` with the squared norm of its slices' gradients (clipping needs the global
norm); after it, `share_update`: once every replica has updated its slices the exchange thread
all-gathers them into every replica's parameter buffer. `wait_gathered` orders a device's stream
after that gather; a worker calls it between the target's forward and the drafter's, so the gather
overlaps the target's forward.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SHARD_ALIGN = 16
"""Sharded layout: every parameter and every slice starts at a multiple of 16 elements (64 bytes in
fp32), so compiled kernels and the fused optimizer get tensors as aligned as fresh allocations."""


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


@dataclass
class BufferLayout:
    """Where the parameters lie in a replica's flat buffers: the parameter at each position (buffer
    order), its first element, the buckets (runs of positions) and each bucket's elements, padded
    with zeros where needed so that a bucket splits into `parts` equal slices."""

    order: list[int]  # position -> parameter index
    sizes: list[int]  # position -> elements
    starts: list[int]  # position -> its first element in the buffer
    buckets: list[tuple[int, int]]  # bucket -> (first position, one past the last)
    spans: list[tuple[int, int]]  # bucket -> (first element, one past the last), padding included
    parts: int

    @property
    def total(self) -> int:
        return self.spans[-1][1] if self.spans else 0

    def extent(self, position: int) -> tuple[int, int]:
        """The elements of the parameter at `position`: (first, one past the last)."""
        return self.starts[position], self.starts[position] + self.sizes[position]

    def owned(self, bucket: int, part: int) -> tuple[int, int]:
        """The elements of slice `part` of `bucket`: (first, one past the last)."""
        begin, end = self.spans[bucket]
        width = (end - begin) // self.parts
        return begin + part * width, begin + (part + 1) * width


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def plan_layout(
    order: list[int], sizes: list[int], element_bytes: int, bucket_bytes: int, parts: int = 1, align: int = 1
) -> BufferLayout:
    """Lay parameters (sizes in elements, in buffer order) out in buckets of about bucket_bytes;
    with parts > 1 each parameter starts at a multiple of `align` and each bucket is padded to a
    multiple of parts x align. parts = align = 1: the parameters back to back, no padding."""
    buckets = plan_buckets(sizes, element_bytes, bucket_bytes)
    starts: list[int] = []
    spans: list[tuple[int, int]] = []
    cursor = 0
    for first, last in buckets:
        begin = cursor
        for position in range(first, last):
            starts.append(cursor)
            cursor = _round_up(cursor + sizes[position], align)
        cursor = begin + _round_up(cursor - begin, parts * align)
        spans.append((begin, cursor))
    return BufferLayout(order, sizes, starts, buckets, spans, parts)


def sum_in_replica_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A new tensor: tensors[0] + tensors[1] + ..., in that order (gloo's order, so the CPU
    exchange gives the process topology's results to the last bit)."""
    total = tensors[0].clone()
    for other in tensors[1:]:
        total += other
    return total


def _one_dtype(params: list[torch.Tensor]) -> torch.dtype:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"the gradient exchange needs one parameter dtype, got {sorted(map(str, dtypes))}")
    return params[0].dtype


class GradientExchange:
    def __init__(self, replicas, timeout_s: float, bucket_bytes: int = 256 << 20, shard: bool = False):
        self.replicas = replicas
        self.timeout_s = timeout_s
        self.shard = shard
        count = len(replicas)
        params = replicas[0].params
        # Buffer order: parameters in reverse, so the first buckets are the ones backward ends first.
        order = list(reversed(range(len(params))))
        sizes = [params[i].numel() for i in order]
        parts, align = (count, SHARD_ALIGN) if shard else (1, 1)
        self.layout = plan_layout(order, sizes, params[0].element_size(), bucket_bytes, parts, align)
        self.bucket_of = {}  # parameter index -> bucket index
        for bucket, (first, last) in enumerate(self.layout.buckets):
            for position in range(first, last):
                self.bucket_of[order[position]] = bucket
        self.bucket_sizes = [last - first for first, last in self.layout.buckets]
        self.flats: list[torch.Tensor | None] = [None] * count
        self.param_flats: list[torch.Tensor | None] = [None] * count
        self.owned_params: list[list[torch.nn.Parameter]] = [[] for _ in replicas]
        self.cuda = (
            all(r.device.type == "cuda" for r in replicas) and len({r.device for r in replicas}) == count
        )
        self.streams = [torch.cuda.Stream(r.device) for r in replicas] if self.cuda else []
        self.lock = threading.Lock()
        self.armed = [False] * count
        self.pending = [list(self.bucket_sizes) for _ in replicas]
        self.inbox: queue.Queue = queue.Queue()
        self.reduced: list[queue.Queue] = [queue.Queue() for _ in replicas]
        self.gathered = threading.Condition()
        self.gather_pending = [False] * count
        self.gather_events: list[object] = [None] * count
        self.failure: BaseException | None = None
        # The gradient hooks refer to this exchange, and it to the replicas: torch keeps a hook where
        # the garbage collector cannot see it, so close() removes them or the models outlive the run.
        self.hook_handles: list = []
        self.thread = threading.Thread(target=self._run, name="gradient-exchange", daemon=True)
        self.thread.start()

    # -- worker side --------------------------------------------------------------------------

    def flatten_parameters(self, rank: int) -> list[torch.nn.Parameter]:
        """Sharded update: make replica `rank`'s parameters views of one flat buffer laid out like
        its gradients (before it compiles, so compiled code sees the final storage). Returns the
        slices it owns, one per bucket: what its optimizer updates."""
        replica = self.replicas[rank]
        flat = torch.zeros(self.layout.total, dtype=_one_dtype(replica.params), device=replica.device)
        with torch.no_grad():
            for position, index in enumerate(self.layout.order):
                param = replica.params[index]
                start, end = self.layout.extent(position)
                flat[start:end].copy_(param.reshape(-1))
                param.data = flat[start:end].view_as(param)
        self.param_flats[rank] = flat
        self.owned_params[rank] = [torch.nn.Parameter(flat[lo:hi]) for lo, hi in self._owned_by(rank)]
        return self.owned_params[rank]

    def attach(self, rank: int) -> None:
        """Give replica `rank` its flat gradient buffer and hooks (after its warm-up, in its thread)."""
        replica = self.replicas[rank]
        params = replica.params
        flat = torch.zeros(self.layout.total, dtype=_one_dtype(params), device=replica.device)
        for position, index in enumerate(self.layout.order):
            param = params[index]
            start, end = self.layout.extent(position)
            param.grad = flat[start:end].view_as(param)
            self.hook_handles.append(
                param.register_post_accumulate_grad_hook(self._hook(rank, self.bucket_of[index]))
            )
        if self.shard:
            for owned, (lo, hi) in zip(self.owned_params[rank], self._owned_by(rank), strict=True):
                owned.grad = flat[lo:hi]
        self.flats[rank] = flat
        replica.grad_buffer = flat

    def _owned_by(self, rank: int) -> list[tuple[int, int]]:
        return [self.layout.owned(bucket, rank) for bucket in range(len(self.layout.buckets))]

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
        self._await(rank, "gradients were not exchanged")

    def sum_across_replicas(self, rank: int, value: torch.Tensor) -> torch.Tensor:
        """Sharded update: replica `rank`'s one-element `value` (the squared gradient norm of its
        slices) summed with every other replica's, in place, on its device: no host read."""
        value = value.reshape(1)
        self.inbox.put(("sum", rank, (value, self._mark(rank))))
        self._await(rank, "the gradient norms were not summed")
        return value.reshape(())

    def share_update(self, rank: int) -> None:
        """Sharded update: replica `rank` has updated its slices (after its optimizer step)."""
        with self.gathered:
            self.gather_pending[rank] = True
        self.inbox.put(("updated", rank, self._mark(rank)))

    def wait_gathered(self, rank: int) -> None:
        """Sharded update: block until the gather of the last update into replica `rank` is issued;
        order its device's current stream after it (the worker's, or the main thread's before an
        evaluation or a checkpoint). Returns at once when no update is pending."""
        with self.gathered:
            done = self.gathered.wait_for(
                lambda: not self.gather_pending[rank] or self.failure is not None, self.timeout_s
            )
            event, failure = self.gather_events[rank], self.failure
        if failure is not None:
            raise ExchangeFailed(f"gradient exchange failed: {failure!r}") from failure
        if not done:
            raise ExchangeFailed(
                f"parameters were not gathered within parallel.step_timeout_s={self.timeout_s}"
            )
        if event is not None:
            torch.cuda.current_stream(self.replicas[rank].device).wait_event(event)

    def _await(self, rank: int, what: str) -> None:
        """The exchange thread's next answer to replica `rank`: its device's stream waits for it."""
        try:
            outcome = self.reduced[rank].get(timeout=self.timeout_s)
        except queue.Empty:
            raise ExchangeFailed(f"{what} within parallel.step_timeout_s={self.timeout_s}") from None
        if isinstance(outcome, BaseException):
            raise ExchangeFailed(f"gradient exchange failed: {outcome!r}") from outcome
        if outcome is not None:
            torch.cuda.current_stream(self.replicas[rank].device).wait_event(outcome)

    def close(self) -> None:
        self.inbox.put(None)

    def release(self, timeout_s: float = 5.0) -> None:
        """Once the workers are done: wait for the exchange thread (bounded: it is a daemon) and
        take the hooks off the replicas' parameters."""
        self.thread.join(timeout_s)
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles.clear()

    # -- exchange thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._one_step():
                pass
        except BaseException as exc:  # tell every waiting worker instead of leaving it blocked
            with self.gathered:
                self.failure = exc
                self.gathered.notify_all()
            for box in self.reduced:
                box.put(exc)

    def _one_step(self) -> bool:
        """One step's exchange; False once the exchange is closed."""
        if not self._reduce_gradients():
            return False
        return not self.shard or (self._sum_norms() and self._gather_parameters())

    def _reduce_gradients(self) -> bool:
        n = len(self.replicas)
        weights: dict[int, float] = {}
        ready: list[dict[int, object]] = [{} for _ in self.layout.buckets]
        waiting: list[int] = []  # buckets finished everywhere, before the weights were all known
        remaining = len(self.layout.buckets)
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
        self._answer_every_replica()
        return True

    def _answer_every_replica(self) -> None:
        done = [self._mark_stream(rank) for rank in range(len(self.replicas))]
        for rank in range(len(self.replicas)):
            self.reduced[rank].put(done[rank])

    def _collect(self, kind: str) -> dict[int, object] | None:
        """One `kind` message from every replica: {rank: payload}; None once the exchange is closed."""
        received: dict[int, object] = {}
        while len(received) < len(self.replicas):
            message = self.inbox.get()
            if message is None:
                return None
            got, rank, payload = message
            if got != kind:
                raise RuntimeError(f"replica {rank} sent {got!r} while {kind!r} was expected")
            received[rank] = payload
        return received

    def _views(self, flats: list, bucket: int) -> list[torch.Tensor]:
        begin, end = self.layout.spans[bucket]
        return [flat[begin:end] for flat in flats]

    def _slices(self, flats: list, bucket: int) -> list[torch.Tensor]:
        """Each replica's own slice of `bucket` in its buffer of `flats`."""
        return [flat[slice(*self.layout.owned(bucket, rank))] for rank, flat in enumerate(flats)]

    def _streams_wait(self, events: dict[int, object]) -> None:
        for rank, stream in enumerate(self.streams):
            if events[rank] is not None:
                stream.wait_event(events[rank])

    def _reduce(self, bucket: int, events: dict[int, object], scale: float) -> None:
        if self.cuda:
            self._streams_wait(events)
        if self.shard:
            self._reduce_scatter(bucket, scale)
        else:
            self._all_reduce(bucket, scale)

    def _all_reduce(self, bucket: int, scale: float) -> None:
        views = self._views(self.flats, bucket)
        if not self.cuda:
            total = sum_in_replica_order(views).mul_(scale)
            for view in views:
                view.copy_(total)
            return
        torch.cuda.nccl.all_reduce(views, streams=self.streams)
        self._scale(views, scale)

    def _reduce_scatter(self, bucket: int, scale: float) -> None:
        """Each replica's slice of the bucket becomes that slice summed across replicas, scaled."""
        owned = self._slices(self.flats, bucket)
        if self.cuda:
            torch.cuda.nccl.reduce_scatter(self._views(self.flats, bucket), owned, streams=self.streams)
            self._scale(owned, scale)
            return
        for rank, target in enumerate(owned):
            lo, hi = self.layout.owned(bucket, rank)
            target.copy_(sum_in_replica_order([flat[lo:hi] for flat in self.flats]).mul_(scale))

    def _scale(self, views: list[torch.Tensor], scale: float) -> None:
        for view, stream in zip(views, self.streams, strict=True):
            with torch.cuda.device(view.device), torch.cuda.stream(stream):
                view.mul_(scale)

    def _sum_norms(self) -> bool:
        """Sharded update: every replica's one-element value replaced by the sum of all of them."""
        sent = self._collect("sum")
        if sent is None:
            return False
        values = [sent[rank][0] for rank in range(len(self.replicas))]
        if self.cuda:
            self._streams_wait({rank: event for rank, (_, event) in sent.items()})
            torch.cuda.nccl.all_reduce(values, streams=self.streams)
        else:
            total = sum_in_replica_order(values)
            for value in values:
                value.copy_(total)
        self._answer_every_replica()
        return True

    def _gather_parameters(self) -> bool:
        """Sharded update: once every replica has updated its slices, copy them into every replica."""
        updated = self._collect("updated")
        if updated is None:
            return False
        if self.cuda:
            self._streams_wait(updated)
        for bucket in range(len(self.layout.buckets)):
            self._all_gather(bucket)
        with self.gathered:
            for rank in range(len(self.replicas)):
                self.gather_events[rank] = self._mark_stream(rank)
                self.gather_pending[rank] = False
            self.gathered.notify_all()
        return True

    def _all_gather(self, bucket: int) -> None:
        owned = self._slices(self.param_flats, bucket)
        if self.cuda:
            # In place: replica r's input is slice r of its output, as NCCL's in-place all-gather has it.
            torch.cuda.nccl.all_gather(owned, self._views(self.param_flats, bucket), streams=self.streams)
            return
        for source, piece in enumerate(owned):
            lo, hi = self.layout.owned(bucket, source)
            for rank, flat in enumerate(self.param_flats):
                if rank != source:
                    flat[lo:hi].copy_(piece)

    def _mark_stream(self, rank: int):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.streams[rank])
        return event
