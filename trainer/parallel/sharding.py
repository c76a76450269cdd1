"""Sharded optimizer update of the threaded topology (parallel.shard_optimizer): each replica's
optimizer covers the slices of the parameters it owns, and checkpoints keep the unsharded state.

The exchange (trainer/parallel/exchange.py) lays every replica's parameters and gradients out in flat
buffers of padded buckets; replica r owns slice r of every bucket. `OptimizerShard` is one
replica's part: AdamW over its slices (1-D views of its parameter buffer whose gradients are the
matching slices of its gradient buffer), clipping by the norm over every replica's slices, and
handing the update to the exchange, which gathers it into every replica.

A checkpoint holds what the unsharded optimizer's state_dict() holds: per parameter, its step and
its AdamW moments shaped like the parameter. `optimizer_state` assembles that from every replica's
slices, `load_optimizer_state` cuts it into them, so a checkpoint resumes with sharding on or off.
"""

from __future__ import annotations

import copy

import torch

from .exchange import GradientExchange


class OptimizerShard:
    """What replica `rank` updates when the optimizer is sharded: one slice of every bucket."""

    def __init__(self, exchange: GradientExchange, rank: int):
        self.exchange = exchange
        self.rank = rank
        self.params = exchange.flatten_parameters(rank)

    def wait_for_parameters(self) -> None:
        """Order this device's current stream after the gather of the last update."""
        self.exchange.wait_gathered(self.rank)

    def global_norm(self) -> torch.Tensor:
        """The norm of the gradients over every replica's slices (what clip_grad_norm_ would see
        unsharded), summed on the devices: it stays on the device."""
        grads = [param.grad for param in self.params]
        squared = torch.nn.utils.get_total_norm(grads).square()
        return self.exchange.sum_across_replicas(self.rank, squared).sqrt()

    def share_update(self) -> None:
        """After the optimizer step: the exchange gathers the new slices into every replica."""
        self.exchange.share_update(self.rank)


def wait_for_parameters(replicas) -> None:
    """Before this thread reads the replicas' parameters (evaluation, checkpoint): every sharded
    update is gathered. Nothing to do without sharding."""
    for replica in replicas:
        if replica.shard is not None:
            replica.shard.wait_for_parameters()


def optimizer_state(replicas) -> dict:
    """The state_dict of the unsharded optimizer (over replicas[0].params), sharded or not."""
    if replicas[0].shard is None:
        return replicas[0].optimizer.state_dict()
    layout = replicas[0].shard.exchange.layout
    shards = [replica.optimizer.state_dict() for replica in replicas]
    params = replicas[0].params
    state: dict[int, dict] = {}
    for bucket, (first, last) in enumerate(layout.buckets if shards[0]["state"] else []):
        pieces = [shard["state"][bucket] for shard in shards]
        begin = layout.spans[bucket][0]
        whole = {key: torch.cat([piece[key].cpu() for piece in pieces]) for key in pieces[0] if key != "step"}
        for position in range(first, last):
            index = layout.order[position]
            start, end = (at - begin for at in layout.extent(position))
            state[index] = {"step": pieces[0]["step"].to("cpu", copy=True)}
            for key, values in whole.items():
                state[index][key] = values[start:end].view_as(params[index]).clone()
    return {"state": state, "param_groups": [_group(shards[0], len(params))]}


def load_optimizer_state(replicas, full: dict) -> None:
    """Put an unsharded optimizer state_dict into every replica's optimizer (its slices when sharded)."""
    if replicas[0].shard is None:
        for index, replica in enumerate(replicas):
            # load_state_dict keeps tensors already on the parameter's device: CPU replicas would
            # share (and each step) one state; the others get copies on their devices anyway.
            own = index > 0 and replica.device.type == "cpu"
            replica.optimizer.load_state_dict(copy.deepcopy(full) if own else full)
        return
    layout = replicas[0].shard.exchange.layout
    shards = [{"state": {}, "param_groups": [_group(full, len(layout.buckets))]} for _ in replicas]
    for bucket, (first, last) in enumerate(layout.buckets if full["state"] else []):
        begin, end = layout.spans[bucket]
        sample = full["state"][layout.order[first]]
        whole = {}
        for key, value in sample.items():
            if key != "step":
                whole[key] = torch.zeros(end - begin, dtype=value.dtype, device=value.device)  # padding: 0
        for position in range(first, last):
            start, stop = (at - begin for at in layout.extent(position))
            for key, values in whole.items():
                values[start:stop] = full["state"][layout.order[position]][key].reshape(-1)
        for rank, shard in enumerate(shards):
            lo, hi = (at - begin for at in layout.owned(bucket, rank))
            shard["state"][bucket] = {"step": sample["step"].clone()}
            shard["state"][bucket].update({key: values[lo:hi].clone() for key, values in whole.items()})
    for replica, shard in zip(replicas, shards, strict=True):
        replica.optimizer.load_state_dict(shard)


def _group(state_dict: dict, count: int) -> dict:
    """Its one parameter group's hyperparameters (learning rate and the rest), over `count` tensors."""
    hyper = {key: value for key, value in state_dict["param_groups"][0].items() if key != "params"}
    return {**hyper, "params": list(range(count))}
