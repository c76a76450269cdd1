"""Gradient averaging across replicas: device copies on CPU, NCCL across CUDA devices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.topology import average_gradients

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)


def _replicas(devices, grads_per_replica):
    replicas = []
    for device, grads in zip(devices, grads_per_replica, strict=True):
        params = []
        for grad in grads:
            param = torch.nn.Parameter(torch.zeros_like(grad, device=device))
            param.grad = grad.to(device)
            params.append(param)
        replicas.append(SimpleNamespace(params=params))
    return replicas


def _expected(grads_per_replica, total_weight):
    return [sum(g[i] for g in grads_per_replica) / total_weight for i in range(len(grads_per_replica[0]))]


def test_average_by_device_copies():
    torch.manual_seed(0)
    grads = [[torch.randn(3, 4), torch.randn(5)] for _ in range(3)]
    replicas = _replicas(["cpu"] * 3, grads)
    average_gradients(replicas, total_weight=6.0)
    for replica in replicas:
        for param, expected in zip(replica.params, _expected(grads, 6.0), strict=True):
            assert torch.allclose(param.grad, expected)


def test_single_replica_is_scaled():
    grads = [[torch.ones(2, 2) * 4]]
    replicas = _replicas(["cpu"], grads)
    average_gradients(replicas, total_weight=2.0)
    assert torch.equal(replicas[0].params[0].grad, torch.full((2, 2), 2.0))


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL all-reduce across devices)"
)
def test_average_by_nccl_across_gpus():
    count = torch.cuda.device_count()
    torch.manual_seed(0)
    grads = [[torch.randn(64, 32), torch.randn(7)] for _ in range(count)]
    replicas = _replicas([f"cuda:{i}" for i in range(count)], grads)
    average_gradients(replicas, total_weight=10.0)
    for replica in replicas:
        for param, expected in zip(replica.params, _expected(grads, 10.0), strict=True):
            assert torch.allclose(param.grad.cpu(), expected, atol=1e-5)
