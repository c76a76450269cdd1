"""Checkpoints: atomic files, verified on load; corrupt and partial ones are rejected."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from trainer.cli import main
from trainer.run import checkpoint as ckpt
from trainer.run.checkpoint import (
    LEGACY_MAGIC,
    SEAL_BYTES,
    SEAL_MAGIC,
    CheckpointError,
    HostStaging,
    available_host_memory,
    checkpoint_from_bytes,
    list_checkpoints,
    load_checkpoint,
    map_device_tensors,
    prune_checkpoints,
    read_verified,
    recorded_digest,
    save_checkpoint,
)

from .conftest import fill_disk_when

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)


def _state():
    return {"step": 7, "weights": torch.arange(1000, dtype=torch.float32), "rng": torch.get_rng_state()}


def test_round_trip(tmp_path):
    path = save_checkpoint(tmp_path, 7, _state())
    assert path.name == "step_00000007.pt"
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and torch.equal(loaded["weights"], _state()["weights"])
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000007.pt"]  # no temporary file left


def test_bytes_received_from_another_rank_are_verified_like_a_file(tmp_path):
    """What rank 0 sends on --resume: the file's bytes, checked against the digest it announced."""
    path = save_checkpoint(tmp_path, 3, _state())
    raw = path.read_bytes()
    digest = recorded_digest(path)
    assert digest == _pieces_digest(raw[:-SEAL_BYTES], ckpt.PIECE_BYTES), "the seal names the payload"
    assert checkpoint_from_bytes(raw, "received", digest)["step"] == 7
    other = save_checkpoint(tmp_path, 4, {**_state(), "step": 8})
    with pytest.raises(CheckpointError, match="is another checkpoint"):
        checkpoint_from_bytes(other.read_bytes(), "received", digest)
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint_from_bytes(raw[:-10], "received", digest)
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint_from_bytes(raw[:100] + raw[200:], "received", digest)
    assert recorded_digest(tmp_path / "step_00000099.pt") is None
    (tmp_path / "foreign.pt").write_bytes(b"not a checkpoint at all")
    assert recorded_digest(tmp_path / "foreign.pt") is None


def _pieces_digest(payload: bytes, piece: int) -> str:
    """The seal's digest computed here on its own: SHA-256 over each piece's SHA-256, in order."""
    pieces = [hashlib.sha256(payload[at : at + piece]).digest() for at in range(0, len(payload), piece)]
    return hashlib.sha256(b"".join(pieces)).hexdigest()


@pytest.mark.parametrize("write_threads", [0, 2])
def test_the_payload_starts_the_file_and_its_seal_ends_it(tmp_path, monkeypatch, write_threads):
    """Pieces of 1,000 bytes, so that a tensor's storage spans many and torch.save's small records
    fall across their edges: the digest is the same whether pieces are hashed on threads or in line,
    and equals one computed from the file alone; the payload is a plain torch file."""
    monkeypatch.setattr(ckpt, "PIECE_BYTES", 1000)
    monkeypatch.setattr(ckpt, "WRITE_HASH_THREADS", write_threads)
    path = save_checkpoint(tmp_path, 5, _state())
    raw = path.read_bytes()
    seal = raw[-SEAL_BYTES:]
    assert seal.startswith(SEAL_MAGIC) and seal.endswith(b"\n")
    digest, length, piece = seal[len(SEAL_MAGIC) :].split(b"\n")[:3]
    assert (int(length), int(piece)) == (len(raw) - SEAL_BYTES, 1000)
    assert digest.decode() == _pieces_digest(raw[:-SEAL_BYTES], 1000) == recorded_digest(path)
    assert len(raw) // 1000 > 4, "the state spans several pieces"
    plain = tmp_path / "plain.pt"
    plain.write_bytes(raw[:-SEAL_BYTES])
    assert torch.equal(torch.load(plain, weights_only=True)["weights"], _state()["weights"])


def test_a_checkpoint_s_tensors_outlive_its_file(tmp_path):
    """The payload is mapped, not copied: the state stays whole when the file is pruned after it
    was read (a resume's state, the run's next checkpoints removing the one it came from)."""
    path = save_checkpoint(tmp_path, 1, _state())
    loaded = read_verified(path)
    save_checkpoint(tmp_path, 2, _state())
    assert prune_checkpoints(tmp_path, 1, set()) == [1] and not path.exists()
    assert torch.equal(loaded.state["weights"], torch.arange(1000, dtype=torch.float32))
    assert loaded.threads >= 1 and "read and checksummed in" in loaded.cost()


def _format_1_file(path, state) -> bytes:
    """A checkpoint as format 1 wrote it: the header (magic, the payload's SHA-256, its length
    zero-padded to 20 digits), then the payload."""
    payload_path = path.with_suffix(".payload")
    torch.save(state, payload_path)
    payload = payload_path.read_bytes()
    payload_path.unlink()
    digest = hashlib.sha256(payload).hexdigest().encode()
    path.write_bytes(LEGACY_MAGIC + digest + b"\n" + str(len(payload)).zfill(20).encode() + b"\n" + payload)
    return payload


def test_a_checkpoint_of_format_1_still_loads_and_is_still_verified(tmp_path):
    path = tmp_path / "step_00000004.pt"
    payload = _format_1_file(path, _state())
    loaded = read_verified(path)
    assert loaded.legacy and loaded.digest == hashlib.sha256(payload).hexdigest() == recorded_digest(path)
    assert torch.equal(loaded.state["weights"], _state()["weights"]) and "(format 1)" in loaded.cost()
    assert checkpoint_from_bytes(path.read_bytes(), "received", loaded.digest)["step"] == 7
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load_checkpoint(path)
    path.write_bytes(bytes(raw[:-10]))
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


def test_truncated_checkpoint_rejected(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state())
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


@pytest.mark.parametrize("where", ["the archive's directory", "a tensor's bytes"])
def test_flipped_byte_rejected(tmp_path, where):
    """Bytes that do not unpack, and bytes that unpack into other values, are both refused by the
    checksum, and no state is handed over."""
    path = save_checkpoint(tmp_path, 1, _state())
    raw = bytearray(path.read_bytes())
    if where == "a tensor's bytes":
        at = raw.index(torch.arange(1000, dtype=torch.float32)[500:502].numpy().tobytes())
        raw[at] ^= 0x01
        flipped = tmp_path / "flipped.pt"
        flipped.write_bytes(bytes(raw[:-SEAL_BYTES]))
        assert torch.load(flipped, weights_only=True)["weights"][500] != 500.0  # it unpacks, wrong
    else:
        raw[-SEAL_BYTES - 100] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load_checkpoint(path)


def test_foreign_file_rejected(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save(_state(), path)  # a plain torch file, not ours
    with pytest.raises(CheckpointError, match="no seal at its end: it is truncated, or not a checkpoint"):
        load_checkpoint(path)


def test_partial_write_is_never_listed(tmp_path):
    """A kill -9 mid-write leaves only a temporary file, which is ignored."""
    save_checkpoint(tmp_path, 10, _state())
    (tmp_path / ".step_00000020.pt.4242.tmp").write_bytes(b"DFLASH-CKPT 1\nhalf")
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10]


def test_resume_from_corrupt_checkpoint_refused(tmp_path, capsys):
    out = tmp_path / "out"
    path = save_checkpoint(out / "checkpoints", 5, _state())
    path.write_bytes(path.read_bytes()[:-10])
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    code = main(
        ["--run", "eager", "--out", str(out), "--resume", "--set", f"data.cache_dir={tmp_path / 'c'}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "truncated" in err[0] and "move it aside" in err[0]
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def _setup(*sets: str):
    from trainer.config import load_config

    return load_config("eager", None, list(sets), None, None)


def test_another_worker_count_or_topology_resumes_another_batch_is_refused(tmp_path):
    from trainer.run.resume import BadInput, check_resumable

    saved = _setup("parallel.cpu_workers=8")
    state = {"format": 1, "config": saved.to_dict(), "rng": {"workers": [torch.get_rng_state()] * 8}}
    check_resumable(state, _setup("parallel.cpu_workers=7", "run.topology=process"), tmp_path)
    with pytest.raises(BadInput, match=r"\(train.batch_size: checkpoint \d+, now 3\); resume with the same"):
        check_resumable(state, _setup("train.batch_size=3"), tmp_path)


def test_a_resume_may_change_how_fast_the_data_is_made_not_what_it_is(tmp_path):
    """The regeneration's speed settings (batches, compile, attention) are left out of its key: a
    resume with other values, e.g. a smaller KV budget after an upgrade changed the default, goes
    on; one that changes the answers (their length) is refused, naming the key."""
    from trainer.run.resume import BadInput, check_resumable

    state = {"format": 1, "config": _setup("data.regen_batch_tokens=131072").to_dict()}
    faster = [
        "data.regen_batch_tokens=262144", "data.regen_batch_size=512", "data.regen_min_width=128",
        "data.regen_compile=false", "data.regen_compile_scope=layers", "data.regen_compile_dynamic=true",
        "data.regen_attention=sdpa",
    ]  # fmt: skip
    check_resumable(state, _setup(*faster), tmp_path)
    with pytest.raises(BadInput, match=r"\(data.regen_max_new_tokens: checkpoint \d+, now 7\)"):
        check_resumable(state, _setup("data.regen_max_new_tokens=7"), tmp_path)


def test_stretches_count_each_shape_of_the_run_once():
    from trainer.run.resume import Shape, saved_shape, stretches_after

    two, one = Shape(2, "threaded"), Shape(1, "threaded")
    ranks = Shape(4, "process", 2)
    first = stretches_after(None, two, 0, "t0")
    assert first == [{"from_step": 0, "workers": 2, "topology": "threaded", "hosts": 1, "started_at": "t0"}]
    assert stretches_after({"stretches": first}, two, 40, "t1") == first  # same shape: one stretch
    second = stretches_after({"stretches": first}, one, 40, "t1")
    assert [(s["from_step"], s["workers"]) for s in second] == [(0, 2), (40, 1)]
    assert saved_shape({"stretches": second}) == one
    # A start that stopped before its first step leaves no stretch of its own.
    third = stretches_after({"stretches": second}, ranks, 40, "t2")
    assert [(s["from_step"], s["workers"], s["hosts"]) for s in third] == [(0, 2, 1), (40, 4, 2)]
    assert stretches_after({"stretches": second}, two, 40, "t2") == first
    assert ranks.text() == "4 torchrun ranks on 2 hosts" and one.text() == "1 worker thread"
    # A checkpoint from before stretches were kept: its workers and topology are the first stretch.
    old = {"config": _setup().to_dict(), "rng": {"workers": [torch.get_rng_state()] * 3}}
    assert saved_shape(old) == Shape(3, "threaded", 0)  # its hosts were not recorded
    assert [(s["from_step"], s["workers"]) for s in stretches_after(old, one, 9, "t")] == [(0, 3), (9, 1)]
    assert saved_shape(old).same_as(Shape(3, "threaded")) and not saved_shape(old).same_as(one)
    assert stretches_after(old, Shape(3, "threaded"), 9, "t")[0]["hosts"] == 1
    # Stretches that are not what this trainer writes are left out, never a crash.
    bad = {**old, "stretches": ["x", {"from_step": 0, "workers": "2", "topology": "threaded"}]}
    assert saved_shape(bad) == Shape(3, "threaded", 0)
    assert saved_shape({**old, "stretches": "garbage"}) == Shape(3, "threaded", 0)
    assert [(s["from_step"], s["workers"]) for s in stretches_after(bad, one, 9, "t")] == [(0, 3), (9, 1)]


def test_re_derived_anchor_streams_are_new_and_reproducible():
    from trainer.run.resume import worker_generator_state

    def draws(state):
        generator = torch.Generator()
        generator.set_state(state)
        return torch.randint(0, 1 << 30, (4,), generator=generator).tolist()

    assert draws(worker_generator_state(3, 0, 40)) == draws(worker_generator_state(3, 0, 40))
    streams = {tuple(draws(worker_generator_state(3, rank, step))) for rank in (0, 1) for step in (40, 41)}
    original = torch.Generator().manual_seed(3 * 1000 + 1).get_state()  # worker 0's at step 0
    assert len(streams) == 4 and tuple(draws(original)) not in streams


@pytest.mark.parametrize("resume", [True, False])
def test_a_resumed_launch_records_the_stretches_so_far_from_its_start(tmp_path, resume):
    """trainer.launch's new record keeps the earlier record's stretches on --resume (status shows
    them while a data stage runs, before the trainer writes them anew), not on a new start."""
    import subprocess
    import sys

    from trainer.run.runrecord import read_record, write_record

    from .conftest import REPO

    out = tmp_path / "out"
    stretches = [{"from_step": 0, "workers": 2, "topology": "threaded", "hosts": 1, "started_at": "t"}]
    write_record(out, {"run": "eager", "state": "stopped", "stretches": stretches})
    code = (
        "import argparse, pathlib, sys; from trainer.config import load_config; "
        "from trainer.launch import take_output; "
        "take_output(pathlib.Path(sys.argv[1]), load_config('eager', None, [], None, None), "
        "argparse.Namespace(resume=sys.argv[2] == 'True'), ['trainer'])"
    )
    argv = [sys.executable, "-c", code, str(out), str(resume)]
    started = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    record = read_record(out)
    assert record["state"] == "running"
    assert record.get("stretches") == (stretches if resume else None)


def _large_state():
    """Tensors of 4 MiB: torch.save writes each in one piece."""
    return {"step": 9, "weights": [torch.arange(1 << 20, dtype=torch.float32) + i for i in range(3)]}


def test_whole_pieces_of_large_writes_are_hashed_on_threads_and_the_seal_names_their_digest(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(ckpt, "PIECE_BYTES", 1 << 20)
    on_threads = []
    real_digest = ckpt.piece_digest

    def digest_noting_its_thread(data):
        on_threads.append(threading.current_thread().name)
        return real_digest(data)

    monkeypatch.setattr(ckpt, "piece_digest", digest_noting_its_thread)
    path = save_checkpoint(tmp_path, 9, _large_state())
    payload = path.read_bytes()[:-SEAL_BYTES]
    assert len(payload) > 12 << 20
    assert recorded_digest(path) == _pieces_digest(payload, 1 << 20)
    # each storage of 4 MiB holds three whole pieces at least (its first and last parts go in line)
    assert sum(name.startswith("checkpoint-hash") for name in on_threads) >= 9
    loaded = load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(loaded["weights"], _large_state()["weights"], strict=True))


def test_a_full_disk_during_a_large_write_leaves_no_file_and_no_hashing_thread(tmp_path, monkeypatch):
    import threading

    from trainer.run.checkpoint import CheckpointWriteError

    fill_disk_when(monkeypatch, lambda data, written: written + len(data) > 4 << 20)
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        save_checkpoint(tmp_path, 9, _large_state())
    assert list(tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-hash")]


def test_a_format_1_header_with_an_unpadded_length_reads_as_before(tmp_path):
    """Early checkpoints gave the payload length without leading zeros: they load the same."""
    path = tmp_path / "step_00000007.pt"
    _format_1_file(path, _state())
    magic, digest, length, payload = path.read_bytes().split(b"\n", 3)
    assert length.startswith(b"0")
    path.write_bytes(b"\n".join([magic, digest, str(int(length)).encode(), payload]))
    assert torch.equal(load_checkpoint(path)["weights"], _state()["weights"])
    assert recorded_digest(path) == digest.decode()


def test_host_staging_leaves_a_host_state_as_it_is():
    state = {"step": 3, "weights": [torch.ones(4)], "moments": (torch.zeros(2),)}
    staged = HostStaging().to_host(state)
    assert staged["step"] == 3 and staged["weights"][0] is state["weights"][0]
    assert isinstance(staged["moments"], tuple) and staged["moments"][0] is state["moments"][0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
@pytest.mark.parametrize("pin", [True, False])
def test_host_staging_copies_device_tensors_into_buffers_the_next_checkpoint_reuses(tmp_path, pin):
    staging = HostStaging(pin=pin)
    weights = torch.randn(64, 32, device="cuda")
    state = {"step": 1, "drafter": {"w": weights, "b": torch.arange(5, device="cuda")}, "cpu": torch.ones(2)}
    first = staging.to_host(state)
    assert first["drafter"]["w"].device.type == "cpu" and torch.equal(first["drafter"]["w"], weights.cpu())
    assert first["drafter"]["w"].is_pinned() == pin and first["cpu"] is state["cpu"]
    weights.add_(1)  # the next checkpoint's values go into the same buffers
    second = staging.to_host(state)
    assert second["drafter"]["w"].data_ptr() == first["drafter"]["w"].data_ptr()
    assert torch.equal(second["drafter"]["w"], weights.cpu())
    loaded = load_checkpoint(save_checkpoint(tmp_path, 2, second))
    assert torch.equal(loaded["drafter"]["w"], weights.cpu())
    assert torch.equal(loaded["drafter"]["b"], torch.arange(5))
    other = staging.to_host({"drafter": {"w": torch.zeros(3, device="cuda")}})  # another shape: a new buffer
    assert torch.equal(other["drafter"]["w"], torch.zeros(3)) and len(staging.buffers) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_host_staging_copies_into_the_buffers_it_prepared():
    staging = HostStaging()
    state = {"step": 1, "drafter": {"w": torch.randn(64, 32, device="cuda")}, "rng": torch.get_rng_state()}
    staging.prepare(state)
    staging.preparing.join(30)
    prepared = staging.buffers[0]
    assert prepared.is_pinned() and prepared.shape == (64, 32)
    staged = staging.to_host(state)
    assert staged["drafter"]["w"].data_ptr() == prepared.data_ptr()
    assert torch.equal(staged["drafter"]["w"], state["drafter"]["w"].cpu())


def test_host_staging_prepares_its_buffers_on_a_thread_before_the_first_copy(monkeypatch):
    """The buffers of a state's device tensors are allocated ahead, on a thread of their own (meta
    tensors stand in for the GPU's: their buffers are plain host memory); the first copy waits for
    them; host tensors need none; a second prepare, or one without room, allocates nothing."""
    allocating = threading.Event()
    real_empty = torch.empty

    def slow_empty(*args, **kwargs):
        allocating.wait(5)  # held until the test has seen the thread at work
        return real_empty(*args, **kwargs)

    tensors = [
        torch.empty(4, 3, device="meta"),
        torch.ones(2),
        torch.empty(5, dtype=torch.bfloat16, device="meta"),
    ]
    later, too_big = torch.empty(7, device="meta"), torch.empty(2**20, device="meta")
    monkeypatch.setattr(torch, "empty", slow_empty)
    staging = HostStaging(available=lambda: None)
    staging.prepare(tensors)
    assert staging.preparing is not None and staging.preparing.is_alive() and staging.buffers == []
    allocating.set()
    staging.preparing.join(5)
    assert [(b.shape, b.dtype, b.device.type) for b in staging.buffers] == [
        ((4, 3), torch.float32, "cpu"),
        ((5,), torch.bfloat16, "cpu"),
    ]
    prepared = list(staging.buffers)
    staging.prepare([later])  # buffers held: nothing new
    assert staging.buffers == prepared
    tight = HostStaging(available=lambda: 2**10)
    tight.prepare([too_big])
    assert tight.preparing is None and tight.buffers == []


def test_a_checkpoint_during_the_preparation_waits_for_its_buffers(monkeypatch):
    """A stop right after the first step: the copy waits for the thread, never races it."""
    allocating = threading.Event()
    real_empty = torch.empty

    def slow_empty(*args, **kwargs):
        allocating.wait(30)
        return real_empty(*args, **kwargs)

    meta = torch.empty(3, device="meta")
    monkeypatch.setattr(torch, "empty", slow_empty)
    staging = HostStaging(available=lambda: None)
    staging.prepare([meta])
    thread = staging.preparing
    threading.Timer(0.2, allocating.set).start()
    assert staging.to_host({"step": 1}) == {"step": 1}
    assert allocating.is_set() and not thread.is_alive() and staging.preparing is None


def test_host_staging_whose_preparation_failed_holds_no_buffers(monkeypatch):
    def refused(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (pinned host memory)")

    staging = HostStaging(available=lambda: None)
    meta = torch.ones(3, device="meta")
    monkeypatch.setattr(torch, "empty", refused)
    staging.prepare([meta])
    staging.preparing.join(5)
    assert staging.buffers == []
    monkeypatch.undo()
    assert staging.to_host({"step": 1}) == {"step": 1} and staging.preparing is None


def test_host_staging_without_room_for_the_copy_hands_back_the_state_as_it_is(monkeypatch):
    def no_room(self, index, like):
        raise RuntimeError("CUDA error: out of memory (pinned host memory)")

    monkeypatch.setattr(HostStaging, "buffer", no_room)
    staging = HostStaging()
    staging.buffers.append(torch.zeros(1))  # the last checkpoint's: let go, so the host gets it back
    state = {"drafter": {"w": torch.empty(4, device="meta")}, "step": 2}
    assert staging.to_host(state) is state and staging.buffers == []
    assert staging.declined.startswith("the host copy failed (CUDA error: out of memory")


def test_host_staging_writes_unstaged_where_the_host_has_not_twice_the_copy_available():
    state = {"drafter": [torch.empty(2**20, device="meta"), torch.empty(2**20, device="meta")]}  # 8 MiB
    tight = HostStaging(available=lambda: 12 * 2**20)
    assert tight.to_host(state) is state
    assert tight.declined == "0.0 GiB to copy to the host, 0.0 GiB of host memory available"
    held = HostStaging(available=lambda: 12 * 2**20)
    held.buffers = [torch.empty(2**20), torch.empty(2**20)]  # the last checkpoint's copy: room already
    assert held.no_room(state["drafter"]) is None
    unknown = HostStaging(available=lambda: None)  # no meminfo, no cgroup limit: try, as before
    assert unknown.no_room(state["drafter"]) is None


def test_the_host_memory_available_is_read_from_this_machine():
    available = available_host_memory()  # /proc/meminfo: every Linux machine the tests run on
    assert available is not None and 0 < available < 2**50


def test_the_device_tensors_of_a_state_are_replaced_in_order_and_the_rest_kept():
    host = torch.ones(2)
    state = {"a": torch.empty(3, device="meta"), "b": [host, (torch.empty(1, device="meta"), 7)], "c": "x"}
    seen = []
    mapped = map_device_tensors(state, lambda tensor: seen.append(tensor.shape[0]) or len(seen))
    assert seen == [3, 1] and mapped == {"a": 1, "b": [host, (2, 7)], "c": "x"}
    assert mapped["b"][0] is host and isinstance(mapped["b"][1], tuple)


@pytest.mark.parametrize(
    ("field", "value"),
    [("digest", b"z" * 64), ("length", b"x".zfill(20)), ("piece size", b"0".zfill(20))],
)
def test_a_damaged_seal_is_refused_by_name(tmp_path, field, value):
    path = save_checkpoint(tmp_path, 1, _state())
    raw = path.read_bytes()
    seal = raw[-SEAL_BYTES:]
    fields = seal[len(SEAL_MAGIC) :].split(b"\n")
    fields[["digest", "length", "piece size"].index(field)] = value
    path.write_bytes(raw[:-SEAL_BYTES] + SEAL_MAGIC + b"\n".join(fields))
    with pytest.raises(CheckpointError, match="has a damaged seal"):
        load_checkpoint(path)
    assert recorded_digest(path) is None


def test_a_disk_that_fills_as_the_seal_is_written_leaves_no_file_and_names_the_last_intact_one(
    tmp_path, monkeypatch
):
    """The payload fits, its seal does not: nothing of the new checkpoint stays, the earlier one does."""
    from trainer.run.checkpoint import CheckpointWriteError

    save_checkpoint(tmp_path, 1, _state())
    fill_disk_when(monkeypatch, lambda data, written: bytes(data[: len(SEAL_MAGIC)]) == SEAL_MAGIC)
    said = r"No space left on device; the last intact checkpoint is .*step_00000001\.pt \(step 1\)"
    with pytest.raises(CheckpointWriteError, match=said):
        save_checkpoint(tmp_path, 2, _state())
    monkeypatch.undo()
    assert [path.name for path in tmp_path.iterdir()] == ["step_00000001.pt"]
    assert load_checkpoint(tmp_path / "step_00000001.pt")["step"] == 7


def test_the_file_mapped_is_the_file_hashed_even_when_its_name_is_replaced_meanwhile(tmp_path, monkeypatch):
    """A run resumed before step 1 writes step 1 again while an export reads the old one: the
    export gets the bytes it verified, never the new file's unverified ones."""
    path = save_checkpoint(tmp_path, 1, _state())
    newer = save_checkpoint(tmp_path / "newer", 1, {**_state(), "step": 99})
    real_digest = ckpt.pieces_digest

    def hash_then_replace(*args):
        found = real_digest(*args)
        if newer.exists():  # once: what os.replace does when the trainer saves the same step again
            newer.replace(path)
        return found

    monkeypatch.setattr(ckpt, "pieces_digest", hash_then_replace)
    loaded = read_verified(path)
    assert loaded.state["step"] == 7
    assert load_checkpoint(path)["step"] == 99  # the name now holds the newer checkpoint
