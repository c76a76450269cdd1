"""The target's features as the drafter reads them: the target run only up to the last layer the
drafter reads, equal to the whole target's hidden states; compiled, equal within rounding."""

import pytest
import torch

from trainer.model.target import (
    CAUSAL_ATTENTION,
    FeatureReader,
    attend_with,
    causal_attention,
    layers_up_to,
    load_target,
    target_features_and_next,
)


@pytest.fixture
def target(embedded):
    """A fresh target per test: what a model is asked first matters here."""
    return load_target(embedded[0], "cpu", "float32")


def whole_target_features(target, input_ids, layer_ids):
    out = target.base_model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def ids(target, rows=2, length=24):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(5, target.config.vocab_size, (rows, length), generator=generator)


@pytest.mark.unit
def test_reader_runs_only_the_layers_it_needs_and_equals_the_whole_target(target):
    layers = len(target.base_model.layers)
    layer_ids = [0, layers - 3]
    reader = FeatureReader(target, layer_ids)
    assert len(reader.base.layers) == layers - 2, "it stops after the last layer read"
    assert len(target.base_model.layers) == layers, "the target is untouched"
    assert reader.base.embed_tokens.weight is target.base_model.embed_tokens.weight, "weights are shared"
    calls = []
    hooks = [
        layer.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
        for i, layer in enumerate(target.base_model.layers)
    ]
    try:
        x = ids(target)
        features = reader(x)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == list(range(layers - 2))
    assert torch.equal(features, whole_target_features(target, x, layer_ids)), "bit-identical in float32"
    assert not features.requires_grad
    # The whole target, asked after the view (evaluation does), still reports every layer once.
    out = target(input_ids=x, output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == layers + 1


@pytest.mark.unit
def test_a_reader_of_the_last_layer_is_the_whole_model(target):
    layers = len(target.base_model.layers)
    assert layers_up_to(target, layers - 1) is target.base_model


@pytest.mark.unit
def test_compile_target_setting():
    from trainer.config import CompileConfig

    assert CompileConfig(target="auto").compiles_target("cuda")
    assert not CompileConfig(target="auto").compiles_target("cpu")
    assert CompileConfig(target="on").compiles_target("cpu")
    assert not CompileConfig(target="off").compiles_target("cuda")
    assert not CompileConfig(mode="none", target="on").compiles_target("cuda")


@pytest.mark.slow
def test_compiled_reader_matches_eager(target):
    layer_ids = [0, 2]
    reader = FeatureReader(target, layer_ids)
    compiled = torch.compile(reader, dynamic=False, options={"triton.cudagraphs": False})
    x = ids(target)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reader(x), rtol=1e-5, atol=1e-5)


def compiled_layer_by_layer(target, layer_ids, x):
    """(eager features, compiled features, graphs Dynamo compiled) of a reader of these layers."""
    from torch._dynamo.utils import counters

    reader = FeatureReader(target, layer_ids)
    with torch.no_grad():
        eager = reader(x)
        torch._dynamo.reset()
        counters.clear()
        reader.compile_layers(dynamic=False, options={"triton.cudagraphs": False})
        compiled = [reader(x), reader(x)]  # the second call runs the compiled code again
    assert all(isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in reader.base.layers)
    return eager, compiled, counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_a_reader_compiled_layer_by_layer_matches_eager_and_leaves_the_target_as_it_was(target):
    """compile.scope layers: one compiled region per layer, in the reader's own view. Dynamo
    compiles as many graphs for the whole target as for two of its layers (the layers share
    them); the target's own layers (the regeneration decodes with them) stay uncompiled."""
    layers = len(target.base_model.layers)
    x = ids(target)
    graphs = {}
    for name, layer_ids in {"two layers": [0, 1], "whole": [0, layers - 1]}.items():
        eager, compiled, graphs[name] = compiled_layer_by_layer(target, layer_ids, x)
        for features in compiled:
            torch.testing.assert_close(features, eager, rtol=1e-5, atol=1e-5)
    assert graphs["whole"] == graphs["two layers"] > 0
    assert not any(
        isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in target.base_model.layers
    )
    out = target(input_ids=x, output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == layers + 1  # still every layer once
    assert torch.equal(out.hidden_states[-1], whole_target_features(target, x, [layers - 1]))


@pytest.mark.unit
def test_causal_attention_gives_the_features_and_greedy_tokens_of_the_targets_own(embedded):
    """Rows of one conversation each, right-padded as evaluation pads them: the causal attention
    (no mask built) reads the same features and next tokens as the target's own SDPA."""
    own = load_target(embedded[0], "cpu", "float32")
    causal = load_target(embedded[0], "cpu", "float32")
    attend_with(causal, "causal")
    assert causal.config._attn_implementation == CAUSAL_ATTENTION
    layer_ids = [0, len(own.base_model.layers) - 2]
    x = ids(own, rows=3, length=40)
    x[1, 30:] = 0  # a shorter conversation, padded at its end
    with torch.no_grad():
        torch.testing.assert_close(FeatureReader(causal, layer_ids)(x), FeatureReader(own, layer_ids)(x))
        expected, expected_next = target_features_and_next(own, x, layer_ids)
        features, next_tokens = target_features_and_next(causal, x, layer_ids)
    torch.testing.assert_close(features, expected)
    assert torch.equal(next_tokens, expected_next)


@pytest.mark.unit
def test_causal_attention_refuses_a_mask():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="takes no mask"):
        causal_attention(None, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))


@pytest.mark.unit
def test_causal_attention_with_grouped_key_heads_is_causal_softmax_attention():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=generator)
    k, v = torch.randn(2, 2, 16, 8, generator=generator), torch.randn(2, 2, 16, 8, generator=generator)
    out, _ = causal_attention(None, q, k, v, None, scaling=0.5)
    assert out.shape == (2, 16, 4, 8)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.5
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    by_hand = (scores.softmax(-1) @ v.repeat_interleave(2, dim=1)).transpose(1, 2)
    torch.testing.assert_close(out, by_hand)
