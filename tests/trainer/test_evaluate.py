"""tau by real greedy verification against the target."""

from __future__ import annotations

import pytest
import torch

from trainer.model.drafter import DFlashDrafter, DrafterShape, target_layer_ids
from trainer.model.evaluate import acceptance_length, speculative_generate
from trainer.model.target import shared_parts

VOCAB, BLOCK, MASK_ID, NO_EOS = 60, 4, 59, -1
pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config).eval()


def greedy(target, prompt, count):
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


class OracleDrafter(torch.nn.Module):
    """Knows the target's greedy continuation of one prompt; right for the first `correct` drafts."""

    def __init__(self, prompt_len: int, continuation: list[int], correct: int):
        super().__init__()
        self.fc = torch.nn.Linear(1, 1)
        self.prompt_len, self.continuation, self.correct = prompt_len, continuation, correct

    def hidden(self, context, block, positions, allowed):
        return positions

    def logits(self, positions):
        logits = torch.zeros(*positions.shape, VOCAB)
        for row in range(positions.shape[0]):
            for k, position in enumerate(positions[row].tolist()):
                index = min(position - self.prompt_len, len(self.continuation) - 1)
                token = self.continuation[index]
                logits[row, k, token if k <= self.correct else (token + 1) % VOCAB] = 1.0
        return logits


@pytest.mark.parametrize(("correct", "expected_tau"), [(BLOCK - 1, 4.0), (2, 3.0), (0, 1.0)])
def test_tau_counts_accepted_drafts(target, correct, expected_tau):
    prompt, new_tokens = [3, 4, 5, 6], 13  # the first token, then 12: whole steps of 4, 3 or 1
    continuation = greedy(target, prompt, new_tokens + BLOCK)
    oracle = OracleDrafter(len(prompt), continuation, correct)
    layers = target_layer_ids(5, 2)
    generated, per_step = speculative_generate(
        oracle, target, [prompt], layers, BLOCK, MASK_ID, new_tokens, NO_EOS, CPU
    )
    assert per_step[0] and set(per_step[0]) == {int(expected_tau)}
    assert generated[0] == continuation[: len(generated[0])]  # speculation never changes the output
    assert acceptance_length(oracle, target, [prompt], layers, BLOCK, MASK_ID, new_tokens, NO_EOS, CPU) == (
        expected_tau
    )


def test_batched_verification_equals_one_prompt_at_a_time(target):
    layers = target_layer_ids(5, 2)
    drafter = DFlashDrafter(DrafterShape.from_target(target.config, 1, len(layers)), shared_parts(target))
    drafter.reset_parameters(std=0.3)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23]]
    args = (layers, BLOCK, MASK_ID, 12, NO_EOS, CPU)
    generated, per_step = speculative_generate(drafter, target, prompts, *args)
    for i, prompt in enumerate(prompts):
        alone_generated, alone_steps = speculative_generate(drafter, target, [prompt], *args)
        assert alone_generated[0] == generated[i]
        assert alone_steps[0] == per_step[i]
        assert generated[i] == greedy(target, prompt, len(generated[i]))


def test_tau_counts_no_token_past_the_budget_or_the_end_of_turn(target):
    prompt = [3, 4, 5, 6]
    continuation = greedy(target, prompt, 24)
    oracle = OracleDrafter(len(prompt), continuation, BLOCK - 1)  # every draft right
    layers = target_layer_ids(5, 2)
    args = (layers, BLOCK, MASK_ID)
    generated, per_step = speculative_generate(oracle, target, [prompt], *args, 6, NO_EOS, CPU)
    assert per_step[0] == [4, 1] and len(generated[0]) == 6  # 1 + 4 + 1: the budget cuts the last step
    end_of_turn = continuation[2]
    first = continuation.index(end_of_turn)
    generated, per_step = speculative_generate(oracle, target, [prompt], *args, 20, end_of_turn, CPU)
    assert generated[0] == continuation[: first + 1]
    assert sum(per_step[0]) == first  # the tokens after the first one, up to and with end-of-turn


def compiled_drafter(target, layers):
    drafter = DFlashDrafter(DrafterShape.from_target(target.config, 2, len(layers)), shared_parts(target))
    drafter.reset_parameters(std=0.3)
    for layer in drafter.layers:
        layer.compile(dynamic=False, backend="eager")  # Dynamo's guards and recompiles, no codegen
    return drafter


def compiles() -> int:
    from torch._dynamo.utils import get_compilation_metrics

    return len(get_compilation_metrics())


def test_evaluation_runs_compiled_layers_without_compiling(target):
    layers = target_layer_ids(5, 2)
    drafter = compiled_drafter(target, layers)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23]]
    torch._dynamo.reset()
    from torch._dynamo.utils import clear_compilation_metrics

    clear_compilation_metrics()
    args = (target, prompts, layers, BLOCK, MASK_ID, 30, NO_EOS, CPU)
    eager_tau = acceptance_length(drafter, *args)
    assert compiles() == 0
    bucket_tau = acceptance_length(drafter, *args, pad_buckets=True)
    assert 1 <= compiles() <= 2  # context lengths up to 64, then up to 128: one shape each
    assert bucket_tau == eager_tau


def test_bucketed_padding_changes_no_result(target):
    layers = target_layer_ids(5, 2)
    drafter = DFlashDrafter(DrafterShape.from_target(target.config, 2, len(layers)), shared_parts(target))
    drafter.reset_parameters(std=0.3)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23]]
    args = (drafter, target, prompts, layers, BLOCK, MASK_ID, 40, NO_EOS, CPU)
    assert speculative_generate(*args, pad_buckets=True) == speculative_generate(*args)


def test_a_target_on_flex_attention_verifies_on_sdpa_and_gets_flex_back(target):
    """Evaluation runs uncompiled, where flex attention would materialise every row's whole score
    matrix: the target verifies on SDPA (the same tau), then has flex attention again, also when
    the evaluation ends in an error."""
    layers = target_layer_ids(5, 2)
    drafter = DFlashDrafter(DrafterShape.from_target(target.config, 1, len(layers)), shared_parts(target))
    drafter.reset_parameters(std=0.3)
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12, 13]]
    args = (target, prompts, layers, BLOCK, MASK_ID, 12, NO_EOS, CPU)
    own = target.config._attn_implementation
    plain_tau = acceptance_length(drafter, *args)
    seen = []
    hook = target.register_forward_pre_hook(lambda *_: seen.append(target.config._attn_implementation))
    target.set_attn_implementation("flex_attention")
    try:
        assert acceptance_length(drafter, *args) == plain_tau
        assert seen and set(seen) == {"sdpa"}
        assert target.config._attn_implementation == "flex_attention"

        def stop_with_an_error():
            raise RuntimeError("a stop that fails")

        with pytest.raises(RuntimeError, match="a stop that fails"):
            acceptance_length(drafter, *args, should_stop=stop_with_an_error)
        assert target.config._attn_implementation == "flex_attention"
    finally:
        hook.remove()
        target.set_attn_implementation(own)
