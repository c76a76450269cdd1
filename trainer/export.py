"""python -m trainer.export RUN_OUT EXPORT_DIR [--step N] [--dtype D] [--force]: a checkpoint of a
run -> a DFlash drafter directory that SGLang, vLLM and the reference `dflash` package load.

The directory holds:
- config.json: the target's Qwen3 fields with the drafter's layer count, `architectures:
  ["DFlashDraftModel"]`, `num_target_layers`, `block_size` and `dflash_config: {mask_token_id,
  target_layer_ids}` (the values the run trained with);
- model.safetensors: the drafter's weights under the names the reference model uses (`layers.N.*`,
  `norm`, `fc`, `hidden_norm`); the embedding and the LM head stay the target's;
- README.md: target, run, step, tau at that step and the serve commands;
- export.json: where the export came from (run, step, checkpoint SHA-256, dtype), so a second
  export of the same checkpoint is recognised and an earlier export can be replaced with --force.

Every check happens before anything is written; the directory is built beside EXPORT_DIR and
renamed into place, so an interrupted or failed export leaves EXPORT_DIR as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .config import Config, config_from_dict
from .data.embedded import embedded_dir
from .run.checkpoint import (
    CheckpointError,
    checkpoint_path,
    list_checkpoints,
    read_verified,
)
from .run.runrecord import jsonl_rows

MANIFEST = "export.json"
EXPORT_FORMAT = 1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SERVE_DRAFT_TOKENS = 16  # SGLang counts the anchor, vLLM counts only the drafts (15)


class ExportError(Exception):
    """Bad input: names the problem and the way out; nothing has been written."""


@dataclass
class Source:
    """A verified checkpoint of a run and what the export needs from it."""

    step: int
    path: Path
    digest: str
    config: Config
    weights: dict[str, torch.Tensor]


def pick_checkpoint(run_out: Path, step: int | None) -> Source:
    """The newest checkpoint that verifies (or exactly step N), with its config and weights."""
    directory = run_out / "checkpoints"
    if not run_out.is_dir():
        raise ExportError(
            f"{run_out} is not a directory; give the run's output directory (--out of the trainer)"
        )
    found = list_checkpoints(directory)
    if not found:
        raise ExportError(
            f"no checkpoint in {directory}; a run writes one every train.checkpoint_every steps, "
            "on a stop signal and at the end"
        )
    if step is not None:
        wanted = checkpoint_path(directory, step)
        if (step, wanted) not in found:
            steps = ", ".join(str(s) for s, _ in found)
            raise ExportError(f"no checkpoint of step {step} in {directory} (steps there: {steps})")
        return read_source(step, wanted)
    skipped = []
    for candidate_step, path in reversed(found):
        try:
            return read_source(candidate_step, path)
        except ExportError as exc:
            skipped.append(str(exc))
    raise ExportError("no usable checkpoint: " + "; ".join(skipped))


def read_source(step: int, path: Path) -> Source:
    from .run.resume import CHECKPOINT_FORMAT

    try:
        loaded = read_verified(path)
        digest, state = loaded.digest, loaded.state
    except CheckpointError as exc:
        raise ExportError(f"{exc}; pick another step with --step") from None
    except Exception as exc:  # torch.load of a payload that is not a trainer state
        raise ExportError(f"checkpoint {path} is not a trainer checkpoint ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ExportError(
            f"checkpoint {path} has format {found!r}; this exporter reads format {CHECKPOINT_FORMAT} "
            "(export it with the trainer version that wrote it)"
        )
    if not isinstance(state.get("drafter"), dict) or not isinstance(state.get("config"), dict):
        raise ExportError(
            f"checkpoint {path} holds no drafter weights or no config; it is not a drafter checkpoint"
        )
    try:
        config = config_from_dict(state["config"])
    except TypeError as exc:
        raise ExportError(f"checkpoint {path} carries a config this trainer does not know ({exc})") from None
    return Source(step, path, digest, config, state["drafter"])


def target_dir(cfg: Config) -> Path:
    """The target the run trained against: model.target_path, or the embedded default in the cache."""
    if cfg.model.target_path:
        path = Path(cfg.model.target_path).expanduser()
    else:
        path = embedded_dir(cfg.data.cache_dir) / "target"
    if not (path / "config.json").is_file():
        raise ExportError(
            f"the run's target {path} has no config.json here; export on the machine that trained the run "
            "(the target's config and tokenizer are read from where the run read them)"
        )
    return path


def tokenizer_dir(cfg: Config, target: Path) -> Path:
    return Path(cfg.model.tokenizer_path).expanduser() if cfg.model.tokenizer_path else target


def resolve_mask_token_id(cfg: Config, target: Path) -> int:
    """The mask token the run trained with: drafter.mask_token_id, or the tokenizer's (as train.py)."""
    if cfg.drafter.mask_token_id >= 0:
        return cfg.drafter.mask_token_id
    directory = tokenizer_dir(cfg, target)
    mask_id = mask_token_id_in_files(directory)
    if mask_id is None:
        from .model.target import load_tokenizer

        mask_id = load_tokenizer(directory).mask_token_id
    if mask_id is None:
        raise ExportError(
            f"the run recorded no mask token id (drafter.mask_token_id=-1) and the tokenizer at "
            f"{directory} has no mask token; a drafter cannot be served without the id it "
            "was trained with"
        )
    return int(mask_id)


def mask_token_id_in_files(directory: Path) -> int | None:
    """The tokenizer's mask token id read from its tokenizer_config.json and tokenizer.json, as
    the tokenizer resolves it (the token named mask_token, among the added tokens, else in the
    vocabulary); None where these files do not say, and the tokenizer itself must be loaded
    (3.6 s on a CPU, more than half an export, against milliseconds)."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        token = config.get("mask_token")
        if isinstance(token, dict):
            token = token.get("content")
        if not isinstance(token, str):
            return None
        for key, added in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(added, dict) and added.get("content") == token:
                return int(key)
        tokens = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        for added in tokens.get("added_tokens") or []:
            if added.get("content") == token:
                return int(added["id"])
        vocab = (tokens.get("model") or {}).get("vocab")
        found = vocab.get(token) if isinstance(vocab, dict) else None
        return int(found) if isinstance(found, int) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def text_config(target_config: dict[str, Any]) -> dict[str, Any]:
    return dict(target_config.get("text_config") or target_config)


def check_weights(
    weights: dict[str, torch.Tensor], cfg: Config, target_config: dict, path: Path
) -> list[int]:
    """The checkpoint's weights against the drafter the run's config describes: same names, same
    shapes (a checkpoint of another run or target is refused). Returns the target layer ids."""
    from .model.drafter import DFlashDrafter, DrafterShape, target_layer_ids
    from .model.target import num_target_layers

    hf_config = SimpleNamespace(**text_config(target_config))
    try:
        layer_ids = target_layer_ids(num_target_layers(hf_config), cfg.drafter.num_context_layers)
    except ValueError as exc:
        raise ExportError(f"checkpoint {path}: {exc}") from None
    shape = DrafterShape.from_target(hf_config, cfg.drafter.num_layers, len(layer_ids))
    with torch.device("meta"):
        drafter = DFlashDrafter(shape, None, initialize=False)
        expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in weights.items()}
    if found != expected:
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(set(found) - set(expected))
        wrong = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
        detail = "; ".join(
            f"{label}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("other shape", wrong))
            if names
        )
        raise ExportError(
            f"checkpoint {path} does not match a drafter of its own config over target "
            f"{cfg.model.target_path or '(embedded)'} ({detail}); is it another run's checkpoint?"
        )
    return layer_ids


def drafter_config(target_config: dict, cfg: Config, layer_ids: list[int], mask_id: int, dtype: str) -> dict:
    """config.json: the target's Qwen3 fields, the drafter's layers and the DFlash fields."""
    text = text_config(target_config)
    n_layers = cfg.drafter.num_layers
    drop = ("auto_map", "transformers_version", "_name_or_path", "quantization_config", "text_config")
    config = {key: value for key, value in text.items() if key not in drop}
    config.update(
        {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "num_hidden_layers": n_layers,
            "num_target_layers": int(text["num_hidden_layers"]),
            "layer_types": ["full_attention"] * n_layers,
            "max_window_layers": n_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "block_size": cfg.drafter.block_size,
            "dtype": dtype,
            "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(layer_ids)},
        }
    )
    return dict(sorted(config.items()))


def tau_at(run_out: Path, step: int) -> tuple[float | None, str]:
    """tau at `step` from <run>/metrics.jsonl, and a sentence saying where it comes from."""
    evals = [
        row
        for row in jsonl_rows(run_out / "metrics.jsonl")
        if row.get("kind") == "eval" and isinstance(row.get("tau"), (int, float))
    ]
    at_step = [row for row in evals if row.get("step") == step]
    if at_step:
        row = at_step[-1]
        return float(
            row["tau"]
        ), f"{row['tau']:.3f} on {row.get('prompts', '?')} held-out prompts at step {step}"
    before = [row for row in evals if isinstance(row.get("step"), int) and row["step"] <= step]
    if before:
        row = before[-1]
        return None, f"not evaluated at step {step}; {row['tau']:.3f} at step {row['step']}"
    return None, f"not evaluated at step {step} (no evaluation in {run_out / 'metrics.jsonl'})"


def serve_commands(target: str, export_dir: str) -> dict[str, str]:
    """The serve commands for this drafter (flags as documented by SGLang and vLLM)."""
    vllm_config = json.dumps(
        {"method": "dflash", "model": export_dir, "num_speculative_tokens": SERVE_DRAFT_TOKENS - 1}
    )
    return {
        "sglang": (
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {export_dir} --speculative-num-draft-tokens {SERVE_DRAFT_TOKENS}"
        ),
        "vllm": f"vllm serve {target} --speculative-config '{vllm_config}'",
    }


def readme(manifest: dict, commands: dict[str, str]) -> str:
    return "\n".join(
        [
            f"# DFlash drafter: run {manifest['run']}, step {manifest['step']}",
            "",
            f"- Target model: `{manifest['target']}`",
            f"- Run: `{manifest['run']}` (output `{manifest['run_out']}`), "
            f"checkpoint of step {manifest['step']}",
            f"- Acceptance length tau: {manifest['tau_note']}",
            f"- Drafter: {manifest['num_layers']} layers, block size {manifest['block_size']}, "
            f"target layers {manifest['target_layer_ids']}, mask token id {manifest['mask_token_id']}, "
            f"weights in {manifest['dtype']}",
            "",
            "The embedding and the LM head are the target's: serve this directory next to that target.",
            "Replace the paths with where the target and this directory are on the serving machine.",
            "",
            "SGLang:",
            "",
            "```",
            commands["sglang"],
            "```",
            "",
            "vLLM:",
            "",
            "```",
            commands["vllm"],
            "```",
            "",
            "Python, with the reference `dflash` package:",
            "",
            "```",
            "from dflash.model import DFlashDraftModel",
            f"drafter = DFlashDraftModel.from_pretrained({manifest['export_dir']!r})",
            "```",
            "",
        ]
    )


def existing_export(export_dir: Path) -> dict | None:
    """The manifest of an earlier export in export_dir, or None."""
    try:
        data = json.loads((export_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == EXPORT_FORMAT else None


def export(
    run_out: Path,
    export_dir: Path,
    step: int | None = None,
    dtype: str = "bfloat16",
    force: bool = False,
    keep_same: bool = False,
    dry_run: bool = False,
) -> dict:
    """Export one checkpoint; returns the manifest plus `changed` and the serve commands."""
    run_out, export_dir = run_out.expanduser().absolute(), export_dir.expanduser().absolute()
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if export_dir == run_out or run_out / "checkpoints" in (export_dir, *export_dir.parents):
        raise ExportError(
            f"{export_dir} is the run's output or inside its checkpoints; choose another EXPORT_DIR"
        )
    source = pick_checkpoint(run_out, step)
    target_config = json.loads((target_dir(source.config) / "config.json").read_text())
    manifest = describe_export(run_out, export_dir, source, target_config, dtype)
    commands = serve_commands(manifest["target"], str(export_dir))
    result = {
        **manifest,
        "serve": commands,
        "files": ["config.json", "model.safetensors", "README.md", MANIFEST],
    }
    if same_export_there(export_dir, manifest, force, keep_same):
        return {**result, "changed": False}
    if not dry_run:
        write_export(export_dir, source, target_config, manifest, commands)
    return {**result, "changed": True}


def describe_export(run_out: Path, export_dir: Path, source, target_config: dict, dtype: str) -> dict:
    """The export's manifest: where it comes from and the DFlash settings it was trained with."""
    cfg = source.config
    target = target_dir(cfg)
    layer_ids = check_weights(source.weights, cfg, target_config, source.path)
    tau, tau_note = tau_at(run_out, source.step)
    return {
        "format": EXPORT_FORMAT,
        "run": cfg.run.name,
        "run_out": str(run_out),
        "step": source.step,
        "checkpoint": str(source.path),
        "checkpoint_sha256": source.digest,
        "dtype": dtype,
        "target": cfg.model.target_path or str(target),
        "tau": tau,
        "tau_note": tau_note,
        "num_layers": cfg.drafter.num_layers,
        "block_size": cfg.drafter.block_size,
        "target_layer_ids": layer_ids,
        "mask_token_id": resolve_mask_token_id(cfg, target),
        "export_dir": str(export_dir),
    }


def same_export_there(export_dir: Path, manifest: dict, force: bool, keep_same: bool) -> bool:
    """True when EXPORT_DIR already holds this very export (and keep_same asks to keep it); refuses
    an occupied EXPORT_DIR unless --force and it holds an earlier export."""
    earlier = existing_export(export_dir)
    occupied = export_dir.exists() and (not export_dir.is_dir() or any(export_dir.iterdir()))
    if not occupied:
        return False
    keys = ("checkpoint_sha256", "dtype", "mask_token_id")
    if keep_same and earlier is not None and all(earlier.get(key) == manifest[key] for key in keys):
        return True
    if not force:
        raise ExportError(
            f"{export_dir} exists and is not empty; choose another EXPORT_DIR, or --force to replace "
            "an earlier export there"
        )
    if earlier is None:
        raise ExportError(
            f"{export_dir} is not empty and holds no earlier export ({MANIFEST} missing): it is never "
            "replaced, even with --force; choose another EXPORT_DIR"
        )
    return False


def write_export(export_dir: Path, source, target_config: dict, manifest: dict, commands: dict) -> None:
    """Build the export beside EXPORT_DIR and rename it into place: a failed write (a full disk)
    leaves any earlier export there intact."""
    from safetensors.torch import save_file

    dtype = manifest["dtype"]
    weights = {name: tensor.to(DTYPES[dtype]).contiguous() for name, tensor in source.weights.items()}
    staging = None
    try:
        export_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{export_dir.name}.", dir=export_dir.parent))
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = drafter_config(
            target_config, source.config, manifest["target_layer_ids"], manifest["mask_token_id"], dtype
        )
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "README.md").write_text(readme(manifest, commands))
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for item in staging.iterdir():
            item.chmod(0o644)
            with item.open("rb") as handle:
                os.fsync(handle.fileno())
        os.chmod(staging, 0o755)
        if export_dir.exists():
            # An earlier export (checked above) or an empty directory: set aside, then dropped once
            # the new one is in place, so a failure in between never leaves neither.
            aside = Path(tempfile.mkdtemp(prefix=f".{export_dir.name}.old.", dir=export_dir.parent))
            os.replace(export_dir, aside / "export")
            os.replace(staging, export_dir)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(staging, export_dir)
    except OSError as exc:
        raise ExportError(
            f"writing the export beside {export_dir} failed ({exc}); {export_dir} is unchanged"
        ) from None
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.export",
        description="Export a run's checkpoint as a DFlash drafter directory (SGLang, vLLM, dflash).",
    )
    parser.add_argument("run_out", type=Path, help="the run's output directory (holds checkpoints/)")
    parser.add_argument("export_dir", type=Path, help="the directory to write (new or empty)")
    parser.add_argument(
        "--step", type=int, help="the checkpoint of this step (default: the newest valid one)"
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=list(DTYPES), help="weights dtype (default bfloat16)"
    )
    parser.add_argument("--force", action="store_true", help="replace an earlier export in EXPORT_DIR")
    parser.add_argument(
        "--keep-same",
        action="store_true",
        help="leave EXPORT_DIR as it is when it already holds this export (same checkpoint and dtype)",
    )
    parser.add_argument("--dry-run", action="store_true", help="check everything, write nothing")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = export(
            args.run_out, args.export_dir, args.step, args.dtype, args.force, args.keep_same, args.dry_run
        )
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.json:
        print(json.dumps(result), flush=True)
        return 0
    verb = "would export" if args.dry_run else ("exported" if result["changed"] else "unchanged:")
    print(
        f"{verb} step {result['step']} of run {result['run']} to {result['export_dir']} ({result['dtype']})"
    )
    print(f"tau: {result['tau_note']}")
    print(f"serve with SGLang:\n  {result['serve']['sglang']}\nserve with vLLM:\n  {result['serve']['vllm']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
