"""Loading the frozen target (any Hugging Face causal LM on local disk) and reading its features."""

from __future__ import annotations

import contextlib
import copy
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


CAUSAL_ATTENTION = "causal_rows"
"""The name transformers knows causal_attention by (without "flash" in it: transformers takes such
names for flash attention kernels). It has no mask function registered, so transformers builds no
mask for it (and would drop one it was given: none is)."""


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function for rows of one conversation each, from position 0: SDPA
    with is_causal and no mask, on cuDNN's kernel where it takes the call (measured on an H200 at
    the Qwen3-8B shape: 1.6x flex attention with its causal block mask, 1.8x SDPA's flash kernel),
    else on the next kernel that does (cuDNN takes no float32, nor a single key).
    query [b, h, L, d], key and value [b, kv_heads, L, d]; returns ([b, L, h, d], None)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if attention_mask is not None:
        raise ValueError("causal attention takes no mask: its rows are causal, one conversation each")
    kernels = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    # Compiled, the kernel is chosen when the graph is made. Eager (evaluation), the choice is the
    # process's: a worker thread leaving this block while another is in it can only hand that one
    # a slower kernel of the same attention, never a wrong one (every kernel listed is causal SDPA).
    with sdpa_kernel([*kernels, SDPBackend.MATH], set_priority=True):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
    return out.transpose(1, 2).contiguous(), None


def attend_with(target, attention: str) -> None:
    """Set the whole target's attention: "flex", "causal" (causal_attention) or "sdpa" (as loaded).
    The whole target, because evaluation runs it too, on right-padded rows that are causal."""
    if attention == "flex":
        target.set_attn_implementation("flex_attention")
    elif attention == "causal":
        from transformers import AttentionInterface

        AttentionInterface.register(CAUSAL_ATTENTION, causal_attention)
        target.set_attn_implementation(CAUSAL_ATTENTION)


@contextlib.contextmanager
def attention_of(target, name: str | None):
    """The target runs this attention inside the block (None: its own), its own again after it."""
    before = target.config._attn_implementation
    if name is None or name == before:
        yield
        return
    target.set_attn_implementation(name)
    try:
        yield
    finally:
        target.set_attn_implementation(before)


def layers_up_to(target, last_layer: int):
    """The target's base model cut after layer `last_layer`: a view sharing every weight, whose
    forward runs only the layers up to that one (the drafter reads none beyond it)."""
    base = target.base_model
    if last_layer >= len(base.layers) - 1:
        return base
    # The model's last hidden state is reported after its final norm; in the whole target that is
    # the last layer's, which the cut model's last layer is not.
    return model_view(base, list(base.layers)[: last_layer + 1], norm=torch.nn.Identity())


def model_view(base, layers: list, norm=None):
    """A shallow copy of the base model running these layers (and this final norm; None: its own),
    sharing every weight, buffer and hook with it."""
    # Transformers records hidden states through hooks it installs on the layers the first time a
    # model is asked for them, and marks that model as hooked. Ask the whole model first, so the view
    # copies the mark and never installs a second set on the layers it shares (which would record
    # every layer twice, for the view and the whole target alike).
    device = next(base.parameters()).device
    with torch.no_grad():
        one_token = torch.zeros(1, 1, dtype=torch.long, device=device)
        base(input_ids=one_token, output_hidden_states=True, use_cache=False)
    view = copy.copy(base)  # a shallow copy: parameters, buffers and hooks are shared, not copied
    view._modules = dict(base._modules)
    view._modules["layers"] = torch.nn.ModuleList(layers)
    if norm is not None:
        view._modules["norm"] = norm
    return view


class FeatureReader(torch.nn.Module):
    """The hidden states of the given target layers, concatenated: [b, L, K*H].

    It runs the target only up to the last layer the drafter reads (layers_up_to), and compiled,
    Inductor fuses normalisation, rotary embedding and activation and writes each layer's output
    straight into its slice of the concatenated features (no separate concatenation). Never with
    CUDA graphs: the threaded topology refuses them, and the drafter's own graphs (process
    topology) take the features as an input of the step.
    """

    def __init__(self, target, layer_ids: list[int]):
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.base = layers_up_to(target, max(self.layer_ids))
        self.requires_grad_(False)

    def compile_layers(self, **settings) -> None:
        """Regional compilation: each layer compiled on its own. Every layer runs the same code, so
        Dynamo traces it once and the other layers reuse it: the cold start pays for one layer, not
        for the 30-odd of a whole target. The layers are wrapped in this reader's view only; the
        target's own stay as they were (the regeneration decodes with them)."""
        layers = [torch.compile(layer, **settings) for layer in self.base.layers]
        self.base = model_view(self.base, layers)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """position_ids that restart at 0 mark packed conversations: with no attention mask,
        transformers then lets each token attend only within its own conversation
        (transformers.masking_utils.find_packed_sequence_indices), as if each ran alone."""
        # hidden_states[0] is the embedding output, so layer i's output is hidden_states[i + 1].
        out = self.base(
            input_ids=input_ids, position_ids=position_ids, output_hidden_states=True, use_cache=False
        )
        return torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)


@torch.no_grad()
def target_features_and_next(target, input_ids: torch.Tensor, layer_ids: list[int]):
    """Features as above plus the target's greedy next token at every position: ([b,L,K*H], [b,L])."""
    out = target(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return features, out.logits.argmax(dim=-1)
