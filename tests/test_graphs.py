"""The CUDA-graph path's shape discipline, on CPU: one capture per grid shape, all during
warm-up, static input buffers reused, and the tokens of eager decoding. The capture itself is
replaced by `replay_in_place`, which keeps a graph's contract (static inputs in, static output
out); a stale input or output buffer would change the tokens."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_for, varied_prompts

from generation import runner as runner_module
from generation.graphs import GraphedForward, replay_in_place
from schemas import DraftSpec, ModelSpec, SamplingParams


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    monkeypatch.setattr(runner_module, "graph_capture", lambda device: replay_in_place)


def static_buffers(runner) -> dict:
    return {
        key: [buffer.data_ptr() for buffer in static.values()]
        for key, (static, _, _) in runner._forward.graphs.items()
    }


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_graphs_are_captured_once_per_shape_in_warmup_and_keep_the_tokens(
    temperature, graphs_on_cpu, tiny_llama_dir, tiny_llama_other_dir
):
    draft = DraftSpec(kind="model", model=ModelSpec(path=str(tiny_llama_other_dir)))
    graphed = engine_for(tiny_llama_dir, draft=draft, num_draft_tokens=4, cuda_graphs=True)
    assert isinstance(graphed.target._forward, GraphedForward)
    graphed.warmup()
    captured = graphed.stats.graph_captures
    assert captured == graphed.stats.distinct_shapes > 10
    buffers = [static_buffers(runner) for runner in graphed._runners]
    prompts = varied_prompts(10)
    params = SamplingParams(max_new_tokens=20, temperature=temperature, seed=3)
    eager = engine_for(tiny_llama_dir, draft=draft, num_draft_tokens=4).generate(prompts, params)
    replayed = graphed.generate(prompts, params)
    assert [c.token_ids for c in replayed] == [c.token_ids for c in eager]
    assert graphed.stats.graph_captures == captured
    assert [static_buffers(runner) for runner in graphed._runners] == buffers
    assert graphed.stats.rounds > 20  # verify and draft shapes were replayed


def test_a_shape_first_met_while_generating_returns_its_own_logits(graphs_on_cpu, tiny_llama_dir):
    """Without a warm-up every shape is captured mid-generation. A capture runs no kernel into
    its output (the stand-in leaves NaN there), so the capturing call must replay as well."""
    prompts, params = varied_prompts(5), SamplingParams(max_new_tokens=12)
    eager = engine_for(tiny_llama_dir).generate(prompts, params)
    graphed = engine_for(tiny_llama_dir, cuda_graphs=True)
    replayed = graphed.generate(prompts, params)
    assert graphed.stats.graph_captures == graphed.stats.distinct_shapes > 2
    assert [c.token_ids for c in replayed] == [c.token_ids for c in eager]


def test_a_replay_returns_the_graphs_static_output(graphs_on_cpu, tiny_llama_dir):
    runner = engine_for(tiny_llama_dir, cuda_graphs=True).target
    first = runner.decode(torch.tensor([[5]]), torch.tensor([3]), 1)
    second = runner.decode(torch.tensor([[8]]), torch.tensor([2]), 1)
    assert first.data_ptr() == second.data_ptr() and runner.graph_captures == 1


def test_cuda_graphs_leave_a_cpu_runner_eager(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, cuda_graphs=True)
    engine.generate(["the cat"], SamplingParams(max_new_tokens=4))
    assert engine.stats.graph_captures == 0
