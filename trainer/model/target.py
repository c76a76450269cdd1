"""Loading the frozen target (any Hugging Face causal LM on local disk) and reading its features."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Never reach the hub: every model and tokenizer comes from a local path.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_target(path: str | Path, device: torch.device | str, dtype: str):
    """The target, frozen, in eval mode, on `device`."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=True)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    _quiet_transformers()
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_target_config(path: str | Path):
    from transformers import AutoConfig

    _quiet_transformers()
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def num_target_layers(config) -> int:
    text = getattr(config, "text_config", None) or config
    return int(text.num_hidden_layers)


def shared_parts(target):
    """The target's input embedding and LM head (frozen), shared with the drafter."""
    from .drafter import SharedTargetParts

    return SharedTargetParts(target.get_input_embeddings(), target.get_output_embeddings())


@torch.no_grad()
def target_features(
    target, input_ids: torch.Tensor, layer_ids: list[int], position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Outputs of the given target layers, concatenated: [b, L, K*H].

    hidden_states[0] is the embedding output, so layer i's output is hidden_states[i + 1].
    position_ids that restart at 0 mark packed conversations: with no attention mask, transformers
    then lets each token attend only within its own conversation
    (transformers.masking_utils.find_packed_sequence_indices), as if each ran alone.
    """
    out = target.base_model(
        input_ids=input_ids, position_ids=position_ids, output_hidden_states=True, use_cache=False
    )
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def target_features_and_next(target, input_ids: torch.Tensor, layer_ids: list[int]):
    """Features as above plus the target's greedy next token at every position: ([b,L,K*H], [b,L])."""
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return features, out.logits.argmax(dim=-1)
