"""Gradient exchange across replicas: buckets summed during the backward, on CPU and across GPUs."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch

from trainer.parallel.exchange import GradientExchange, plan_buckets
from trainer.parallel.replica import scale_gradients

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)


class Tiny(torch.nn.Module):
    """Three parameters, one of them unused by forward (its bucket must still complete)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 4, bias=False)
        self.unused = torch.nn.Parameter(torch.zeros(5))

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))).pow(2).sum()


def _replicas(devices):
    torch.manual_seed(0)
    reference = Tiny()
    replicas = []
    for device in devices:
        module = Tiny().to(device)
        module.load_state_dict(reference.state_dict())
        replicas.append(
            SimpleNamespace(module=module, params=list(module.parameters()), device=torch.device(device))
        )
    return replicas


def _inputs(count):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(3, 8, generator=generator) for _ in range(count)]


def _expected_grads(replicas, inputs, weights):
    """Each replica's gradient computed alone, then summed in replica order and scaled."""
    grads = []
    for replica, x in zip(replicas, inputs, strict=True):
        module = Tiny()
        module.load_state_dict({k: v.cpu() for k, v in replica.module.state_dict().items()})
        module(x).backward()
        grads.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()])
    scale = 1.0 / sum(weights)
    expected = []
    for index in range(len(grads[0])):
        total = grads[0][index].clone()
        for other in grads[1:]:
            total += other[index]
        expected.append(total.mul_(scale))
    return expected


def _step(exchange, replicas, inputs, weights):
    """What each worker thread does in a step, concurrently: report, backward, finish, wait."""
    errors = []

    def work(rank):
        try:
            replica = replicas[rank]
            exchange.report_weight(rank, weights[rank])
            replica.module(inputs[rank].to(replica.device)).backward()
            exchange.finish(rank)
            exchange.wait_reduced(rank)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors


def test_buckets_are_contiguous_and_cover_every_parameter():
    assert plan_buckets([10, 10, 10, 10], element_bytes=4, bucket_bytes=80) == [(0, 2), (2, 4)]
    assert plan_buckets([100, 1, 1], element_bytes=4, bucket_bytes=16) == [(0, 1), (1, 3)]
    assert plan_buckets([1, 1, 1], element_bytes=4, bucket_bytes=1 << 20) == [(0, 3)]
    assert plan_buckets([], element_bytes=4, bucket_bytes=8) == []


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64])  # one bucket; one bucket per parameter or so
def test_cpu_exchange_sums_and_scales_like_one_big_batch(bucket_bytes):
    replicas = _replicas(["cpu", "cpu", "cpu"])
    inputs, weights = _inputs(3), [2.0, 3.0, 5.0]
    expected = _expected_grads(replicas, inputs, weights)
    exchange = GradientExchange(replicas, timeout_s=30, bucket_bytes=bucket_bytes)
    try:
        for rank in range(3):
            exchange.attach(rank)
        for _ in range(2):  # the buffers are zeroed between steps, as apply_update does
            _step(exchange, replicas, inputs, weights)
            for replica in replicas:
                for param, want in zip(replica.params, expected, strict=True):
                    assert torch.equal(param.grad, want)
                replica.module.zero_grad(set_to_none=False)
    finally:
        exchange.close()


def test_gradients_are_views_of_one_buffer_per_replica():
    replicas = _replicas(["cpu", "cpu"])
    exchange = GradientExchange(replicas, timeout_s=30)
    try:
        for rank in range(2):
            exchange.attach(rank)
        buffer = replicas[0].grad_buffer
        assert buffer.numel() == sum(p.numel() for p in replicas[0].params)
        buffer.fill_(7.0)
        assert all(torch.all(p.grad == 7.0) for p in replicas[0].params)
        assert all(torch.all(p.grad == 0.0) for p in replicas[1].params)
    finally:
        exchange.close()


def test_a_missing_worker_times_out_instead_of_hanging():
    replicas = _replicas(["cpu", "cpu"])
    exchange = GradientExchange(replicas, timeout_s=0.5)
    try:
        for rank in range(2):
            exchange.attach(rank)
        exchange.report_weight(0, 1.0)
        replicas[0].module(_inputs(1)[0]).backward()
        exchange.finish(0)
        with pytest.raises(RuntimeError, match="step_timeout_s"):
            exchange.wait_reduced(0)
    finally:
        exchange.close()


def test_single_replica_is_scaled():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    param.grad = torch.ones(2, 2) * 4
    scale_gradients([param], 1 / 2.0)
    assert torch.equal(param.grad, torch.full((2, 2), 2.0))


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL all-reduce across devices)"
)
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64])
def test_nccl_exchange_across_gpus(bucket_bytes):
    count = torch.cuda.device_count()
    replicas = _replicas([f"cuda:{i}" for i in range(count)])
    inputs, weights = _inputs(count), [float(i + 1) for i in range(count)]
    expected = _expected_grads(replicas, inputs, weights)
    exchange = GradientExchange(replicas, timeout_s=60, bucket_bytes=bucket_bytes)
    try:
        for rank in range(count):
            exchange.attach(rank)
        _step(exchange, replicas, inputs, weights)
        for replica in replicas:
            torch.cuda.synchronize(replica.device)
            for param, want in zip(replica.params, expected, strict=True):
                assert torch.allclose(param.grad.cpu(), want, atol=1e-5)
    finally:
        exchange.close()


def replica_config_and_target():
    """(a two-layer drafter's config on the CPU, a six-layer random Qwen3 target) for Replica."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.config import load_config

    cfg = load_config("eager", sets=["drafter.num_layers=2", "parallel.devices=cpu"])
    shape = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return cfg, Qwen3ForCausalLM(shape).eval().requires_grad_(False)


def test_another_workers_replica_copies_the_first_ones_weights():
    from trainer.parallel.replica import Replica

    cfg, target = replica_config_and_target()
    torch.manual_seed(0)
    first = Replica(cfg, torch.device("cpu"), target, [1, 3], 63, 0)
    second = Replica(cfg, torch.device("cpu"), target, [1, 3], 63, 1, copy_of=first)
    mine, theirs = first.drafter.state_dict(), second.drafter.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[key], theirs[key]) for key in mine)
    assert all(mine[key].data_ptr() != theirs[key].data_ptr() for key in mine), "copies, not shared"
    assert second.drafter.shared.embed is first.drafter.shared.embed  # the target's, not copied


def test_a_resumed_run_s_replica_is_built_with_the_checkpoint_s_weights_without_drawing_random_ones(
    monkeypatch,
):
    from trainer.model.drafter import DFlashDrafter
    from trainer.parallel.replica import Replica

    cfg, target = replica_config_and_target()
    torch.manual_seed(0)
    saved = Replica(cfg, torch.device("cpu"), target, [1, 3], 63, 0).drafter.state_dict()
    saved = {key: value + 1.0 for key, value in saved.items()}  # weights no initialisation draws
    drawn = []
    monkeypatch.setattr(DFlashDrafter, "reset_parameters", lambda self, std=0.02: drawn.append(self))
    rng = torch.get_rng_state()
    resumed = Replica(cfg, torch.device("cpu"), target, [1, 3], 63, 0, weights=saved)
    mine = resumed.drafter.state_dict()
    assert mine.keys() == saved.keys() and all(torch.equal(mine[key], saved[key]) for key in saved)
    assert drawn == [] and torch.equal(torch.get_rng_state(), rng)  # nothing drawn, on any generator


def test_step_loss_is_the_mean_over_every_replicas_weighted_sum():
    from trainer.parallel.replica import StepLoss

    loss = StepLoss([torch.tensor(3.0), torch.tensor(5.0)], weight_sum=4.0)
    assert float(loss) == 2.0
    assert float(StepLoss([torch.tensor(0.0)], weight_sum=0.0)) == 0.0  # no weight: no division by 0


# -- sharded optimizer update -----------------------------------------------------------------


def test_sharded_layout_pads_buckets_into_equal_aligned_slices():
    from trainer.parallel.exchange import plan_layout

    unsharded = plan_layout([2, 1, 0], [5, 7, 3], element_bytes=4, bucket_bytes=40)
    assert unsharded.starts == [0, 5, 12] and unsharded.spans == [(0, 12), (12, 15)]  # back to back
    layout = plan_layout([2, 1, 0], [5, 7, 3], element_bytes=4, bucket_bytes=40, parts=3, align=4)
    assert layout.starts == [0, 8, 24]  # each parameter starts aligned
    assert layout.spans == [(0, 24), (24, 36)]  # 5 + pad 3 + 7 + pad 9 -> 24 = 3 slices of 8
    assert [layout.owned(0, part) for part in range(3)] == [(0, 8), (8, 16), (16, 24)]
    assert [layout.owned(1, part) for part in range(3)] == [(24, 28), (28, 32), (32, 36)]


def _run_workers(work, count):
    errors = []

    def guarded(rank):
        try:
            work(rank)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(rank,)) for rank in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors


def _weights(count):
    return [float(rank + 2) for rank in range(count)]


def _unsharded_exchange_grads(devices, bucket_bytes) -> list[torch.Tensor]:
    """The gradients (on the CPU) the unsharded exchange gives every replica in one step."""
    replicas = _replicas(devices)
    exchange = GradientExchange(replicas, timeout_s=60, bucket_bytes=bucket_bytes)
    try:
        for rank in range(len(devices)):
            exchange.attach(rank)
        _step(exchange, replicas, _inputs(len(devices)), _weights(len(devices)))
        return [param.grad.cpu() for param in replicas[0].params]
    finally:
        exchange.close()


def _sharded_exchange_checks(devices, bucket_bytes, expected, exact):
    """Reduce-scatter (against the `expected` gradient sums), norm sum and gather of a sharded
    exchange, one step on the replicas of `devices`."""
    count = len(devices)
    replicas = _replicas(devices)
    inputs, weights = _inputs(count), _weights(count)
    exchange = GradientExchange(replicas, timeout_s=60, bucket_bytes=bucket_bytes, shard=True)
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, atol=1e-5)
    layout = exchange.layout
    try:
        for rank, replica in enumerate(replicas):
            before = [param.detach().clone() for param in replica.params]
            exchange.flatten_parameters(rank)
            exchange.attach(rank)
            for position, index in enumerate(layout.order):  # the same values, now in the buffer
                param = replica.params[index]
                assert param.data_ptr() == exchange.param_flats[rank][layout.starts[position]].data_ptr()
                assert torch.equal(param, before[index])
        _step(exchange, replicas, inputs, weights)
        want = torch.zeros(layout.total)  # the summed gradients, laid out like the buffers
        for position, index in enumerate(layout.order):
            want[slice(*layout.extent(position))] = expected[index].reshape(-1)
        for rank, replica in enumerate(replicas):
            for bucket in range(len(layout.buckets)):
                owned = slice(*layout.owned(bucket, rank))
                assert same(replica.grad_buffer[owned].cpu(), want[owned])
        sums = [None] * count

        def sum_then_update(rank):
            device = replicas[rank].device
            sums[rank] = exchange.sum_across_replicas(rank, torch.tensor(rank + 1.0, device=device))
            exchange.param_flats[rank][slice(*layout.owned(0, rank))] = rank + 1.0  # "the update"
            exchange.share_update(rank)
            exchange.wait_gathered(rank)

        _run_workers(sum_then_update, count)
        for rank, replica in enumerate(replicas):
            assert float(sums[rank]) == count * (count + 1) / 2
            begin, end = layout.spans[0]
            gathered = exchange.param_flats[rank][begin:end].cpu()
            width = (end - begin) // count
            assert torch.equal(gathered, torch.arange(1.0, count + 1).repeat_interleave(width))
            first, end = layout.extent(0)  # the module sees it: its parameters are views
            assert torch.equal(
                replica.params[layout.order[0]].detach().reshape(-1).cpu(), gathered[first:end]
            )
    finally:
        exchange.close()


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64])
def test_cpu_sharded_exchange_reduce_scatters_sums_and_gathers(count, bucket_bytes):
    devices = ["cpu"] * count
    expected = _expected_grads(_replicas(devices), _inputs(count), _weights(count))
    assert all(
        torch.equal(mine, theirs)
        for mine, theirs in zip(_unsharded_exchange_grads(devices, bucket_bytes), expected, strict=True)
    )
    _sharded_exchange_checks(devices, bucket_bytes, expected, exact=True)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL reduce-scatter and all-gather)"
)
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64])
def test_nccl_sharded_exchange_matches_the_unsharded_one(bucket_bytes):
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    expected = _unsharded_exchange_grads(devices, bucket_bytes)  # NCCL all-reduce
    _sharded_exchange_checks(devices, bucket_bytes, expected, exact=False)


def _tiny_topology(workers: int, shard: bool, grad_clip: float):
    """Real replicas of a small drafter (two 1 MiB buckets) on CPU worker threads, warmed up."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.config import load_config
    from trainer.parallel.replica import Replica
    from trainer.parallel.topology import ThreadedTopology

    settings = [
        "drafter.num_layers=2", "drafter.block_size=4", "drafter.num_anchors=4", "train.batch_size=2",
        "train.seq_len=32", f"train.grad_clip={grad_clip}", "parallel.devices=cpu",
        "parallel.bucket_mb=1", f"parallel.shard_optimizer={str(shard).lower()}",
    ]  # fmt: skip
    cfg = load_config("eager", sets=settings)
    shape = Qwen3Config(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(shape).eval().requires_grad_(False)
    replicas = []
    for rank in range(workers):
        first = replicas[0] if replicas else None
        replicas.append(Replica(cfg, torch.device("cpu"), target, [1, 3], 63, rank, copy_of=first))
    topology = ThreadedTopology(replicas, 60, log=lambda line: None)
    topology.launch()
    assert topology.wait_ready(lambda: False)
    return topology


def _batches(workers: int, steps: int, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 60, (2 * workers, 32), generator=generator)
        mask = torch.ones_like(ids)
        mask[:, :4] = 0  # no loss on a prompt
        yield ids, mask


def _train(topology, batches) -> list[tuple[float, float]]:
    """(loss, gradient norm) per step; the parameters are gathered at the end."""
    from trainer.parallel.sharding import wait_for_parameters

    history = []
    for ids, mask in batches:
        loss, _, norm = topology.step(ids, mask)
        history.append((float(loss), float(norm)))
    wait_for_parameters(topology.replicas)
    return history


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("grad_clip", [0.0, 0.05])  # 0: no clipping, the arithmetic is the same
def test_sharded_update_matches_the_unsharded_one(workers, grad_clip):
    unsharded = _tiny_topology(workers, shard=False, grad_clip=grad_clip)
    sharded = _tiny_topology(workers, shard=True, grad_clip=grad_clip)
    try:
        assert len(sharded.exchange.layout.buckets) == 2
        want = _train(unsharded, _batches(workers, 3))
        got = _train(sharded, _batches(workers, 3))
        assert [norm for _, norm in got] == pytest.approx([norm for _, norm in want], rel=1e-6)
        assert got[0][0] == want[0][0]  # the first loss: the same start
        assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in want], rel=1e-6)
        reference = unsharded.replicas[0].params
        for replica in sharded.replicas:
            for mine, first in zip(replica.params, sharded.replicas[0].params, strict=True):
                assert torch.equal(mine, first)  # every replica has every update
            for mine, theirs in zip(replica.params, reference, strict=True):
                if grad_clip == 0.0:
                    assert torch.equal(mine, theirs)
                else:  # the global norm is summed in another order: the clip factor differs in the last bit
                    assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    finally:
        unsharded.close()
        sharded.close()


@pytest.mark.parametrize("shard", [False, True])
def test_a_closed_topology_lets_its_replicas_go(shard):
    topology = _tiny_topology(2, shard=shard, grad_clip=0.0)
    try:
        _train(topology, _batches(2, 2))
    finally:
        topology.close()
    replicas = [weakref.ref(replica) for replica in topology.replicas]
    del topology
    gc.collect()
    assert [replica() for replica in replicas] == [None, None]  # the models' memory can be given back


def _checkpoint_into(source, destination, directory):
    """source's state at this step, through a checkpoint file, restored into destination."""
    from trainer.run.checkpoint import load_checkpoint, save_checkpoint
    from trainer.run.resume import checkpoint_state, restore

    loader = SimpleNamespace(state_dict=dict, load_state_dict=lambda state: None)
    state = checkpoint_state(2, source.replicas[0].cfg, source, loader, tau0=None)
    restore(load_checkpoint(save_checkpoint(directory, 2, state)), destination, loader)


def _same_optimizer_states(mine: dict, theirs: dict) -> bool:
    if mine["param_groups"] != theirs["param_groups"] or mine["state"].keys() != theirs["state"].keys():
        return False
    return all(
        mine["state"][index].keys() == entry.keys()
        and all(torch.equal(mine["state"][index][key].cpu(), value.cpu()) for key, value in entry.items())
        for index, entry in theirs["state"].items()
    )


@pytest.mark.parametrize("saved_sharded", [True, False])
def test_a_checkpoint_resumes_with_sharding_switched(saved_sharded, tmp_path):
    from trainer.parallel.sharding import optimizer_state

    source = _tiny_topology(2, shard=saved_sharded, grad_clip=0.0)
    resumed = _tiny_topology(2, shard=not saved_sharded, grad_clip=0.0)
    try:
        batches = list(_batches(2, 3))
        _train(source, batches[:2])
        _checkpoint_into(source, resumed, tmp_path)
        assert _same_optimizer_states(optimizer_state(resumed.replicas), optimizer_state(source.replicas))
        want, got = _train(source, batches[2:]), _train(resumed, batches[2:])
        assert got[0][0] == want[0][0] and got[0][1] == pytest.approx(want[0][1], rel=1e-6)
        for replica in resumed.replicas:
            for mine, theirs in zip(replica.params, source.replicas[0].params, strict=True):
                assert torch.equal(mine, theirs)  # the same next step
        assert _same_optimizer_states(optimizer_state(resumed.replicas), optimizer_state(source.replicas))
    finally:
        source.close()
        resumed.close()


def test_an_optimizer_state_cut_into_shards_and_assembled_again_is_unchanged():
    from trainer.parallel.sharding import load_optimizer_state, optimizer_state

    unsharded = _tiny_topology(2, shard=False, grad_clip=1.0)
    sharded = _tiny_topology(3, shard=True, grad_clip=1.0)  # another worker count
    try:
        assert optimizer_state(sharded.replicas)["state"] == {}  # before any step: nothing yet
        _train(unsharded, _batches(2, 2))
        full = optimizer_state(unsharded.replicas)
        load_optimizer_state(sharded.replicas, full)
        assert _same_optimizer_states(optimizer_state(sharded.replicas), full)
        for replica in sharded.replicas:
            for entry in replica.optimizer.state.values():
                assert entry["exp_avg"].ndim == 1 and float(entry["step"]) == 2.0
    finally:
        unsharded.close()
        sharded.close()


class SlowCompile:
    """A replica whose compile lasts until `done` is set: a stop comes while it compiles."""

    def __init__(self):
        compile_settings = SimpleNamespace(mode="default", uses_cudagraphs=False)
        self.cfg = SimpleNamespace(compile=compile_settings, parallel=SimpleNamespace(shard_optimizer=False))
        self.device = torch.device("cpu")
        self.compiling, self.done = threading.Event(), threading.Event()

    def compile(self):
        self.compiling.set()
        assert self.done.wait(30)

    def warm_up(self):
        pass


def test_a_stop_during_compilation_logs_no_compile_line_after_the_run_s_stop():
    from trainer.parallel.topology import ThreadedTopology

    replica = SlowCompile()
    lines: list[str] = []
    topology = ThreadedTopology([replica], 60, log=lines.append)
    topology.launch()
    try:
        assert replica.compiling.wait(30)
        assert not topology.wait_ready(lambda: True)  # the stop
        lines.append("stopped at step 0")
        replica.done.set()  # the compile ends after the stop
        assert topology.outbox.get(timeout=30)[0] == "ready"  # its last line would have come before this
    finally:
        replica.done.set()
        topology.close()
    assert lines == ["drafter on cpu: compiling forward (cudagraphs=False)", "stopped at step 0"]


def test_a_worker_out_of_gpu_memory_ends_the_run_naming_the_rows_and_the_way_out(tmp_path, capsys):
    """The run's end says what ran out and what to lower, not only a traceback."""
    from trainer.exits import guarded
    from trainer.parallel.topology import WorkerFailed
    from trainer.run import runrecord

    trace = (
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in call\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.12 GiB.\n"
    )

    def failing() -> int:
        raise WorkerFailed(0, torch.device("cuda:0"), trace, rows=6)

    runrecord.write_record(tmp_path, {"run_id": "r-1", "pid": os.getpid(), "state": "running"})
    assert guarded(tmp_path, failing) == 1
    said = capsys.readouterr().err
    assert "torch.OutOfMemoryError" in said, "the traceback is kept"
    assert "error: cuda:0 ran out of memory in the training step at train.batch_size=6: lower" in said
    assert "lower train.batch_size" in runrecord.read_record(tmp_path)["exit_reason"]
    other = WorkerFailed(0, torch.device("cuda:0"), "Traceback...\nRuntimeError: injected failure\n", rows=6)
    assert other.hint is None
