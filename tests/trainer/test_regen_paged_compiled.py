"""The paged engine's decode step compiled (one shape for a whole run, no graph break) gives the eager
step's answers; on a GPU, replayed as a CUDA graph, plain greedy `generate`'s in float32. Slower
than the unit lane: a compile of the embedded target's step takes about 15 s on a CPU."""

from __future__ import annotations

import pytest
import torch

from trainer.data.chat import ChatFormat, iter_conversations
from trainer.data.engine import PagedEngine, PagedSettings
from trainer.model.target import load_target, load_tokenizer

NEW_TOKENS = 16


def prompts_of(embedded, chat) -> list[list[int]]:
    texts = [" ".join(m["content"] for m in messages) for _, messages in iter_conversations(embedded[1])]
    return [(chat.text(texts[i]) * 8)[: 3 + 5 * i] for i in range(10)]


def greedy(target, prompt: list[int], end_id: int) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    output = target.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
        eos_token_id=end_id, pad_token_id=0,
    )[0, len(prompt) :].tolist()  # fmt: skip
    return output[: output.index(end_id)] if end_id in output else output


def paged(target, compile: bool) -> PagedEngine:
    settings = PagedSettings(slots=3, page_size=4, pages=26, max_tokens=64, chunk=8, compile=compile)
    return PagedEngine(target, settings)


def test_the_compiled_decode_step_compiles_once_and_gives_the_eager_answers(embedded):
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    target = load_target(embedded[0], "cpu", "float32")
    chat = ChatFormat(load_tokenizer(embedded[0]))
    requests = list(enumerate(prompts_of(embedded, chat)))
    eager = paged(target, compile=False).generate(requests, NEW_TOKENS, chat.end_id)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled = paged(target, compile=True)
    assert compiled.generate(requests, NEW_TOKENS, chat.end_id) == eager
    assert compiled.preemptions > 0  # slots refilled and sequences recomputed around the one shape
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert sum(counters["graph_break"].values()) == breaks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_the_decode_step_replayed_as_a_cuda_graph_gives_greedy_generate_s_answers(embedded):
    target = load_target(embedded[0], "cuda", "float32")
    chat = ChatFormat(load_tokenizer(embedded[0]))
    prompts = prompts_of(embedded, chat)
    free_running = [greedy(target, p, end_id=-1) for p in prompts]
    early = [token for answer in free_running for token in answer[:6]]
    end_id = max(set(early), key=early.count)  # some answers end early
    engine = paged(target, compile=True)
    answers = engine.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    assert engine.steps.graph is not None  # the steps after the first two replayed the graph
    assert [answers[i] for i in range(len(prompts))] == [greedy(target, p, end_id) for p in prompts]
