"""The graph runner on its own: it imports and constructs without CUDA, a failed capture
switches graphs (or only solo graphs) off and the step runs eagerly, solo graphs of dead
expert sets are pruned, and (on a GPU) a replay repeats the captured device work with the
static buffers' new contents."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptermesh.worker.graph_runner import GraphRunner, StepGraph
from adaptermesh.worker.sampling import GREEDY, RowParams, SamplerMode, SamplingBuffers, sample
from adaptermesh.worker.step_layout import StepBuffers, StepLayout

SRC = Path(__file__).resolve().parents[2] / "src" / "adaptermesh" / "worker"
VOCAB = 17


def toy_step(
    buffers: StepBuffers,
    layout: StepLayout,
    splits: int,
    lora: bool,
    sampling_buffers: SamplingBuffers,
    mode: SamplerMode,
    gated: Any,
    destination: torch.Tensor,
    *,
    sample: bool = True,
) -> torch.Tensor:
    """Device work shaped like a step: logits from the staged ids and positions, sampled."""
    views = buffers.views
    ids = views.ids[: layout.num_entries].to(torch.float32)
    positions = views.positions[: layout.num_entries].to(torch.float32)
    columns = torch.arange(VOCAB, device=ids.device, dtype=torch.float32)
    logits = torch.cos(ids[:, None] * 0.37 + columns[None, :] * 0.11 + positions[:, None])
    if sample:
        tokens = _sample(logits, sampling_buffers, mode)
        destination[: tokens.shape[0]].copy_(tokens)
    return logits


def _sample(logits: torch.Tensor, buffers: SamplingBuffers, mode: SamplerMode) -> torch.Tensor:
    return sample(logits, buffers, mode=mode)


def runner(device: torch.device, enabled: bool = True) -> GraphRunner:
    return GraphRunner(
        device=device,
        enabled=enabled,
        model_config=None,  # type: ignore[arg-type]  # read only by solo expert-set graphs
        pad_row=3,
        bitmask_words=1,
        max_model_len=64,
        last_tokens=torch.zeros(8, dtype=torch.int64, device=device),
        step=toy_step,
        splits=lambda seqs, length: 1,
    )


def layout(entries: int = 4) -> StepLayout:
    return StepLayout(entries, entries, entries, 0, [None] * entries, ("d", entries), None)


def test_the_launcher_and_the_runner_are_separate_rooms() -> None:
    """step_launch holds no capture code and imports neither the scheduler nor the adapter
    manager; the runner does not import the launcher."""

    def imports(name: str) -> set[str]:
        tree = ast.parse((SRC / name).read_text())
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        return found

    launch = imports("step_launch.py")
    assert not launch & {"adaptermesh.worker.scheduler", "adaptermesh.worker.adapters"}
    text = (SRC / "step_launch.py").read_text()
    for banned in (
        "CUDAGraph",
        "torch.cuda.graph(",
        "graph_pool_handle",
        ".launched(",
        "last_entry",
    ):
        assert banned not in text, banned
    assert "adaptermesh.worker.step_launch" not in imports("graph_runner.py")


def test_without_cuda_the_runner_is_off() -> None:
    graphs = runner(torch.device("cpu"))
    assert not graphs.enabled
    assert not graphs.usable(solo=False)
    assert not graphs.usable(solo=True)
    assert not graphs.active


def test_a_failed_capture_switches_graphs_off_and_the_step_runs_eagerly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    graphs = runner(torch.device("cpu"))
    graphs.enabled = graphs.solo_enabled = True  # as on a GPU; the capture itself fails here
    assert graphs.get(layout(), False, GREEDY, None, False) is None
    assert "capture failed" in caplog.text
    assert not graphs.enabled
    assert graphs.graphs == {}


def test_a_failed_solo_capture_switches_only_solo_graphs_off() -> None:
    graphs = runner(torch.device("cpu"))
    graphs.enabled = graphs.solo_enabled = True
    assert graphs.get(layout(), False, GREEDY, object(), False) is None  # type: ignore[arg-type]
    assert graphs.enabled
    assert not graphs.solo_enabled
    assert graphs.usable(solo=False)
    assert not graphs.usable(solo=True)


def test_solo_graphs_of_dead_expert_sets_are_pruned() -> None:
    graphs = runner(torch.device("cpu"))
    alive, dead = object(), object()
    fake: Any = object()
    graphs.graphs = {
        ("d", 1, True, False, alive, False, False, None): fake,
        ("d", 1, True, False, dead, False, False, None): fake,
        ("d", 4, True, False, None, False, False, None): fake,
        ("m", 32, True, False, False, False, None): fake,
    }
    assert graphs.solo_count() == 2
    graphs.prune_solo({id(alive)})
    assert graphs.solo_count() == 1
    assert len(graphs.graphs) == 3
    assert ("d", 1, True, False, alive, False, False, None) in graphs.graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replay_repeats_the_captured_work_with_new_inputs() -> None:
    device = torch.device("cuda")
    graphs = runner(device)
    assert graphs.usable(solo=False)
    shape = layout(4)
    graph = graphs.get(shape, False, GREEDY, None, False)
    assert isinstance(graph, StepGraph)
    assert graphs.get(shape, False, GREEDY, None, False) is graph  # captured once
    for trial in range(3):
        ids = torch.tensor([3 + trial, 5, 7, 11 * trial], device=device)
        graph.buffers.views.ids[:4].copy_(ids)
        graph.buffers.views.positions[:4].copy_(torch.arange(4, device=device) + trial)
        graphs.replay(graph, [RowParams(0.0)] * 4, None)
        torch.cuda.synchronize()
        eager = torch.zeros(8, dtype=torch.int64, device=device)
        buffers = SamplingBuffers.allocate(4, device)
        logits = toy_step(graph.buffers, shape, 1, False, buffers, GREEDY, None, eager)
        assert graph.logits is not None
        torch.testing.assert_close(graph.logits, logits)
        assert graphs.last_tokens[:4].tolist() == eager[:4].tolist()
    assert graphs.replays == 3
    assert graphs.active
