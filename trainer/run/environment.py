"""Checks of the config against this machine (paths, devices, the out directory): every problem
found, before anything is written."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import Config
from .checkpoint import list_checkpoints


def resolve_devices(spec: str) -> list[torch.device]:
    """'auto' -> every CUDA device (else cpu); 'cpu'; 'cuda:0,cuda:1'. Raises ValueError."""
    spec = spec.strip()
    if spec == "auto":
        count = torch.cuda.device_count()
        return [torch.device(f"cuda:{i}") for i in range(count)] if count else [torch.device("cpu")]
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise ValueError("parallel.devices is empty; use auto, cpu or a list like cuda:0,cuda:1")
    devices = []
    for name in names:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"parallel.devices: {name!r} is not a device name (use cpu or cuda:N)") from None
        if device.type == "cuda":
            if device.index is None:
                raise ValueError(f"parallel.devices: name the GPU as cuda:N, not {name!r}")
            count = torch.cuda.device_count()
            if device.index >= count:
                raise ValueError(
                    f"parallel.devices: {name} is not usable here (torch sees {count} CUDA device(s)); "
                    "use parallel.devices=auto or cpu, or a GPU that exists"
                )
        elif device.type != "cpu":
            raise ValueError(f"parallel.devices: {name!r} is not supported (use cpu or cuda:N)")
        devices.append(device)
    if len(set(devices)) != len(devices):
        raise ValueError(f"parallel.devices lists a device twice: {spec}")
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"parallel.devices mixes cpu and cuda: {spec}; use one kind")
    if devices[0].type == "cpu" and len(devices) > 1:
        raise ValueError("on CPU the threaded topology runs one worker: use parallel.devices=cpu")
    return devices


def check_machine(cfg: Config, out_dir: Path | None, resume: bool) -> list[str]:
    problems = []
    try:
        resolve_devices(cfg.parallel.devices)
    except ValueError as exc:
        problems.append(str(exc))
    if cfg.model.dtype == "bfloat16" and cfg.parallel.devices == "cpu":
        problems.append("model.dtype=bfloat16 is for GPUs; use model.dtype=float32 on cpu")
    if cfg.model.target_path:
        target = Path(cfg.model.target_path).expanduser()
        if not target.joinpath("config.json").is_file():
            problems.append(
                f"model.target_path {target} is not a Hugging Face model directory (no config.json); "
                "point it at a local model, or leave it empty for the embedded tiny target"
            )
        else:
            problems.extend(_check_target(cfg, target))
    if cfg.model.tokenizer_path and not Path(cfg.model.tokenizer_path).expanduser().is_dir():
        problems.append(f"model.tokenizer_path {cfg.model.tokenizer_path} does not exist")
    if cfg.data.train_file and not Path(cfg.data.train_file).expanduser().is_file():
        problems.append(
            f"data.train_file {cfg.data.train_file} does not exist; give a JSONL chat file, "
            "or leave it empty for the embedded data set"
        )
    if cfg.data.train_file and not cfg.model.target_path:
        problems.append(
            "data.train_file is set but model.target_path is not: the data needs its target's tokenizer"
        )
    cache = Path(cfg.data.cache_dir).expanduser()
    existing = next((p for p in [cache, *cache.parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        problems.append(f"data.cache_dir {cache}: {existing} is not a directory")
    if out_dir is not None:
        if out_dir.exists() and not out_dir.is_dir():
            problems.append(f"--out {out_dir} exists and is not a directory")
        checkpoints = list_checkpoints(out_dir / "checkpoints")
        if checkpoints and not resume:
            problems.append(
                f"--out {out_dir} already holds a run (checkpoint at step {checkpoints[-1][0]}); "
                "pass --resume to continue it, or choose another --out"
            )
    if cfg.run.topology == "threaded" and cfg.compile.uses_cudagraphs:
        pass  # reported by the compile guard in Config.problems()
    return problems


def _check_target(cfg: Config, target: Path) -> list[str]:
    from ..model.drafter import target_layer_ids
    from ..model.target import load_target_config, num_target_layers

    try:
        config = load_target_config(target)
    except (OSError, ValueError) as exc:
        return [f"model.target_path {target}: cannot read its config ({exc})".replace("\n", " ")]
    try:
        target_layer_ids(num_target_layers(config), cfg.drafter.num_context_layers)
    except ValueError as exc:
        return [f"drafter.num_context_layers: {exc}"]
    return []
