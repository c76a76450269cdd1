"""The paged engine's decode step compiled (one shape for a whole run, no graph break) gives the eager
step's answers; flex attention over the pool in place gives greedy `generate`'s, eagerly and
compiled; on a GPU, both ways compiled and replayed as a CUDA graph, plain greedy `generate`'s in
float32. Slower than the unit lane: a compile of the embedded target's step takes 15-60 s on a
CPU, flex attention runs eagerly 10-20 s."""

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


def paged(target, compile: bool, attention: str = "gather", compile_scope: str = "step",
          tail: tuple[int, ...] = (), compile_prefill: bool = False) -> PagedEngine:  # fmt: skip
    settings = PagedSettings(slots=3, page_size=4, pages=26, max_tokens=64, chunk=8, compile=compile,
                             attention=attention, compile_scope=compile_scope, tail_slots=tail,
                             compile_prefill=compile_prefill)  # fmt: skip
    return PagedEngine(target, settings)


def end_token_and_answers(target, prompts) -> tuple[int, list[list[int]]]:
    """An end token that ends some answers early (the commonest early token), and the answers."""
    free_running = [greedy(target, p, end_id=-1) for p in prompts]
    early = [token for answer in free_running for token in answer[:6]]
    end_id = max(set(early), key=early.count)
    return end_id, [greedy(target, p, end_id) for p in prompts]


@pytest.mark.parametrize("scope", ["step", "layers"])
def test_the_compiled_decode_step_compiles_once_and_gives_the_eager_answers(embedded, scope):
    """One graph either way: the whole step, or one decoder layer that every layer shares (the
    layer's pages are its own pools, so nothing guards on which layer it is)."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    target = load_target(embedded[0], "cpu", "float32")
    chat = ChatFormat(load_tokenizer(embedded[0]))
    requests = list(enumerate(prompts_of(embedded, chat)))
    eager = paged(target, compile=False).generate(requests, NEW_TOKENS, chat.end_id)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    compiled = paged(target, compile=True, compile_scope=scope)
    assert compiled.generate(requests, NEW_TOKENS, chat.end_id) == eager
    assert compiled.preemptions > 0  # slots refilled and sequences recomputed around the one shape
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert sum(counters["graph_break"].values()) == breaks


def test_flex_attention_over_the_pool_in_place_gives_greedy_generate_s_answers(embedded):
    torch.set_num_threads(1)
    target = load_target(embedded[0], "cpu", "float32")
    prompts = prompts_of(embedded, ChatFormat(load_tokenizer(embedded[0])))
    end_id, reference = end_token_and_answers(target, prompts)
    engine = paged(target, compile=False, attention="flex")
    answers = engine.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    assert [answers[i] for i in range(len(prompts))] == reference
    assert engine.preemptions > 0
    assert target.config._attn_implementation == "sdpa"  # the target's own again


@pytest.mark.parametrize(("scope", "tail"), [("step", ()), ("layers", ()), ("layers", (2, 1))])
def test_flex_attention_compiled_with_its_block_mask_made_outside_the_step_gives_greedy_generate_s_answers(
    embedded, scope, tail
):
    """The step takes its block mask as an input (made and loaded outside the compiled step): one
    graph, no graph break, and the answers of greedy `generate`, preemptions included (Inductor's
    CPU code here; the GPU's kernels in the CUDA-graph test below); with narrower steps at the tail,
    one graph a width."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the layer compiled once a process: each case counts its own graphs
    torch.set_num_threads(1)
    target = load_target(embedded[0], "cpu", "float32")
    prompts = prompts_of(embedded, ChatFormat(load_tokenizer(embedded[0])))
    end_id, reference = end_token_and_answers(target, prompts)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    engine = paged(target, compile=True, attention="flex", compile_scope=scope, tail=tail)
    answers = engine.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    assert [answers[i] for i in range(len(prompts))] == reference
    assert engine.preemptions > 0 and engine.attention == "flex"
    assert sorted(engine.widths) == sorted({3, *tail})
    assert counters["stats"]["unique_graphs"] - graphs == len(engine.widths)
    assert sum(counters["graph_break"].values()) == breaks


def test_the_compiled_prefill_serves_every_chunk_s_shape_and_gives_greedy_generate_s_answers(embedded):
    """The prefill's layer compiled at dynamic shapes: chunks of 1 to 8 tokens over 1 to 16 pages
    of keys, preemptions' recomputed prompts among them, in two graphs at most (a chunk of one
    token is specialized), no graph break; the answers of greedy `generate`."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.set_num_threads(1)
    target = load_target(embedded[0], "cpu", "float32")
    prompts = prompts_of(embedded, ChatFormat(load_tokenizer(embedded[0])))
    end_id, reference = end_token_and_answers(target, prompts)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    engine = paged(target, compile=False, compile_prefill=True)
    answers = engine.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    assert [answers[i] for i in range(len(prompts))] == reference
    assert engine.preemptions > 0 and engine.prefill_chunks > 10
    assert 1 <= counters["stats"]["unique_graphs"] - graphs <= 2
    assert sum(counters["graph_break"].values()) == breaks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
@pytest.mark.parametrize(
    ("attention", "page_size", "scope", "tail"),
    [("gather", 4, "step", ()), ("flex", 16, "step", ()), ("flex", 64, "step", ()),
     ("flex", 64, "layers", ()), ("flex", 16, "layers", (2, 1))],
)  # fmt: skip
def test_the_decode_step_replayed_as_a_cuda_graph_gives_greedy_generate_s_answers(
    embedded, attention, page_size, scope, tail
):
    target = load_target(embedded[0], "cuda", "float32")
    prompts = prompts_of(embedded, ChatFormat(load_tokenizer(embedded[0])))
    end_id, reference = end_token_and_answers(target, prompts)
    pages = 26 * 4 // page_size + 1 if page_size < 64 else 4  # a pool that preempts
    settings = PagedSettings(slots=3, page_size=page_size, pages=pages, max_tokens=64, chunk=8, compile=True,
                             attention=attention, compile_scope=scope, tail_slots=tail,
                             compile_prefill=scope == "layers")  # fmt: skip
    engine = PagedEngine(target, settings)
    answers = engine.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    assert engine.steps.graph is not None  # the steps after the first two replayed the graph
    assert sorted(engine.widths) == sorted({3, *tail})
    assert [answers[i] for i in range(len(prompts))] == reference
