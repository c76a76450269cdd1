"""dflash.ct200 passthrough filters: the NVIDIA device nodes of a GPU list, their numbers from
`stat`, the wanted devN/mpN entries and the `pct set` that makes a container's config match."""

from __future__ import annotations

from ansible_collections.dflash.ct200.plugins.filter import passthrough
from ansible_collections.dflash.ct200.plugins.filter.passthrough import (
    device_numbers,
    nvidia_devices,
    passthrough_entries,
    passthrough_mounts,
    pct_changes,
    pct_entries,
)

CONTROL = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
MOUNTS = [
    {"host": "/tank/datasets", "path": "/data", "readonly": True, "create": False},
    {"host": "/tank/ct200-workspace", "path": "/workspace", "readonly": False, "create": True},
]


def test_each_gpu_gets_its_node_then_the_control_devices_once() -> None:
    assert nvidia_devices([0, 3]) == ["/dev/nvidia0", "/dev/nvidia3", *CONTROL]
    assert nvidia_devices(["1"]) == ["/dev/nvidia1", *CONTROL], "indices from YAML strings too"


def test_a_cpu_container_gets_no_device_nodes() -> None:
    assert nvidia_devices([]) == []
    assert nvidia_devices(None) == []


def test_device_numbers_are_read_in_hex_and_only_for_character_devices() -> None:
    lines = [
        "/dev/nvidia0 character special file c3 0",
        "/dev/nvidia-uvm character special file 1fd 1",
        "/dev/nvidia1 regular empty file 0 0",
    ]
    assert device_numbers(lines) == {
        "/dev/nvidia0": {"major": 0xC3, "minor": 0},
        "/dev/nvidia-uvm": {"major": 0x1FD, "minor": 1},
    }
    assert device_numbers([]) == {}


def test_wanted_entries_number_devices_and_mounts_in_order() -> None:
    assert passthrough_entries([0], MOUNTS, "0660") == {
        "dev0": "/dev/nvidia0,mode=0660",
        "dev1": "/dev/nvidiactl,mode=0660",
        "dev2": "/dev/nvidia-uvm,mode=0660",
        "dev3": "/dev/nvidia-uvm-tools,mode=0660",
        "mp0": "/tank/datasets,mp=/data,ro=1",
        "mp1": "/tank/ct200-workspace,mp=/workspace",
    }


def test_mounts_get_their_documented_defaults() -> None:
    assert passthrough_mounts(
        [{"host": "/a", "path": "/b"}, {"host": "/c", "path": "/d", "create": True}]
    ) == [
        {"host": "/a", "path": "/b", "readonly": False, "create": False},
        {"host": "/c", "path": "/d", "readonly": False, "create": True},
    ]
    assert passthrough_mounts(None) == []


def test_no_gpus_and_no_mounts_want_nothing() -> None:
    assert passthrough_entries([], []) == {}


def test_only_dev_and_mp_lines_of_pct_config_are_ours() -> None:
    config = [
        "arch: amd64",
        "dev0: /dev/nvidia0,mode=0666",
        "mp0: /tank/datasets,mp=/data,ro=1",
        "rootfs: local-lvm:vm-200-disk-0,size=64G",
        "devices: not an entry",
        "net0: name=eth0,bridge=vmbr0",
    ]
    assert pct_entries(config) == {"dev0": "/dev/nvidia0,mode=0666", "mp0": "/tank/datasets,mp=/data,ro=1"}


def test_a_config_that_matches_needs_no_pct_set() -> None:
    wanted = passthrough_entries([0], MOUNTS[:1])
    config = [f"{key}: {value}" for key, value in wanted.items()]
    assert pct_changes(config, wanted, 200) == {"set": {}, "delete": [], "argv": []}


def test_only_what_differs_is_set_and_what_is_no_longer_wanted_is_deleted() -> None:
    wanted = passthrough_entries([0], [])
    config = [
        "dev0: /dev/nvidia0,mode=0666",  # as wanted: left alone
        "dev1: /dev/nvidiactl,mode=0600",  # another mode: set
        "dev5: /dev/nvidia5,mode=0666",  # a GPU dropped from the list: deleted
        "mp1: /old,mp=/old",  # a mount dropped: deleted
    ]
    changes = pct_changes(config, wanted, 200)
    assert changes["set"] == {
        "dev1": "/dev/nvidiactl,mode=0666",
        "dev2": "/dev/nvidia-uvm,mode=0666",
        "dev3": "/dev/nvidia-uvm-tools,mode=0666",
    }
    assert changes["delete"] == ["dev5", "mp1"]
    assert changes["argv"] == [
        "pct", "set", "200",
        "--dev1", "/dev/nvidiactl,mode=0666",
        "--dev2", "/dev/nvidia-uvm,mode=0666",
        "--dev3", "/dev/nvidia-uvm-tools,mode=0666",
        "--delete", "dev5,mp1",
    ]  # fmt: skip


def test_a_container_that_does_not_exist_yet_gets_every_entry() -> None:
    """Check mode before the container exists: `pct config` printed nothing."""
    wanted = passthrough_entries([], MOUNTS)
    changes = pct_changes([], wanted, "200")
    assert changes["set"] == wanted and changes["delete"] == []
    assert changes["argv"][:3] == ["pct", "set", "200"]


def test_the_filters_are_registered_under_their_names() -> None:
    from ansible.plugins.loader import filter_loader

    assert set(passthrough.FilterModule().filters()) == {
        "nvidia_devices",
        "device_numbers",
        "passthrough_mounts",
        "passthrough_entries",
        "pct_changes",
    }
    assert filter_loader.get("dflash.ct200.pct_changes") is not None
