"""Fixtures for the worker-engine tests: a tiny random Llama, PEFT adapters, and the
transformers + peft reference that every output is checked against."""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from adaptermesh.worker.engine import Engine, EngineConfig
from adaptermesh.worker.types import GenerationRequest, SamplingParams, TokenEvent
from adaptermesh_testkit.checkpoints import make_adapter, make_tiny_model

# name -> (rank, target modules, seed, use_rslora)
ADAPTERS: dict[str, tuple[int, tuple[str, ...], int, bool]] = {
    "alpha": (4, ("q_proj", "v_proj", "down_proj"), 1, False),
    "beta": (8, ("k_proj", "o_proj", "gate_proj", "up_proj"), 2, True),
    "gamma": (
        16,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        3,
        False,
    ),
    "delta": (2, ("o_proj",), 4, False),
}
PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy",
    "Adapters let one base model serve many fine-tuned tasks at once. A service mesh",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            # peft/transformers emit deprecation chatter that the strict warning filter turns
            # into errors; it is not about our code.
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning"))


class Reference:
    """transformers + peft, one request at a time."""

    def __init__(self, model_dir: Path, root: Path, names: list[str]) -> None:
        import peft
        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = transformers.AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32
            )
            self.model: Any = peft.PeftModel.from_pretrained(
                base, str(root / names[0]), adapter_name=names[0]
            )
            for n in names[1:]:
                self.model.load_adapter(str(root / n), adapter_name=n)
        self.model.eval()

    def logits(self, ids: list[int], adapter: str | None) -> torch.Tensor:
        x = torch.tensor([ids])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if adapter is None:
                with self.model.disable_adapter():
                    return self.model(input_ids=x).logits[0].float()
            self.model.set_adapter(adapter)
            return self.model(input_ids=x).logits[0].float()

    def greedy(self, prompt: list[int], adapter: str | None, n: int) -> list[int]:
        ids = list(prompt)
        out = []
        for _ in range(n):
            tok = int(self.logits(ids, adapter)[-1].argmax())
            out.append(tok)
            ids.append(tok)
        return out


@dataclass
class Tiny:
    model_dir: Path
    root: Path
    ref: Reference
    tokenizer: Any
    extra: dict[str, Any] = field(default_factory=dict)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text)["input_ids"])


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    import transformers

    base = tmp_path_factory.mktemp("wk_tiny")
    model_dir = make_tiny_model(base / "model")
    root = base / "adapters"
    for name, (rank, targets, seed, rs) in ADAPTERS.items():
        make_adapter(root, model_dir, name, rank, targets, seed, use_rslora=rs)
    ref = Reference(model_dir, root, list(ADAPTERS))
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return Tiny(model_dir, root, ref, tok)


@pytest.fixture
async def make_engine(tiny: Tiny, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """Builds engines over the tiny model; a test that also asks for ``logit_log`` gets its
    engines' sampled logits recorded there."""
    engines: list[Engine] = []
    observer = request.getfixturevalue("logit_log") if "logit_log" in request.fixturenames else None

    def build(**kw: Any) -> Engine:
        root = kw.pop("root", tiny.root)
        model_dir = kw.pop("model_dir", tiny.model_dir)
        cfg = EngineConfig(**{"max_num_seqs": 8, "max_loras": 4, "max_lora_rank": 16, **kw})
        eng = Engine(model_dir, root, config=cfg, model_name="tiny", sample_observer=observer)
        engines.append(eng)
        return eng

    yield build
    for eng in engines:
        await eng.shutdown()


async def collect(stream: Any) -> list[TokenEvent]:
    return [e async for e in stream]


def request(
    rid: str, ids: tuple[int, ...], adapter: str | None = None, **sampling: Any
) -> GenerationRequest:
    return GenerationRequest(rid, ids, adapter, SamplingParams(**{"max_tokens": 8, **sampling}))


def tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


async def aiter_events(stream: Any) -> AsyncIterator[TokenEvent]:
    async for e in stream:
        yield e


class LogitLog(dict[str, list[torch.Tensor]]):
    """Per request id, the logits row each token was sampled from: an engine's
    ``sample_observer`` (CPU engines sample eagerly on every step; graphs would report only
    at capture, with no rows)."""

    def __call__(self, logits: torch.Tensor, rows: list[Any]) -> None:
        for i, row in enumerate(rows):
            if row is not None:
                self.setdefault(row.request_id, []).append(logits[i].detach().cpu().clone())


@pytest.fixture
def logit_log() -> LogitLog:
    """A ``LogitLog`` that ``make_engine`` hands to the engines it builds."""
    return LogitLog()
