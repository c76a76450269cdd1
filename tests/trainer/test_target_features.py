"""The target's features as the drafter reads them: the target run only up to the last layer the
drafter reads, equal to the whole target's hidden states; compiled, equal within rounding."""

import pytest
import torch

from trainer.model.target import FeatureReader, layers_up_to, load_target


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
