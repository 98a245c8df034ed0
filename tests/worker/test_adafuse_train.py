"""AdaFuse training on the tiny model: the loss falls, the balance loss keeps every expert in
use, and the written set is served by the engine with the training-time forward's output."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptermesh.worker.adafuse import read_expert_set
from adaptermesh.worker.adafuse_train import (
    TextDataset,
    TrainConfig,
    TrainingError,
    balance_loss,
    load_base,
    train,
    write_expert_set,
)
from adaptermesh.worker.adafuse_train_cli import main as cli_main
from adaptermesh.worker.model import ModelConfig

from .conftest import Tiny, collect, request, tokens

WORDS = [
    "mesh",
    "adapter",
    "shard",
    "token",
    "kernel",
    "router",
    "expert",
    "weight",
    "queue",
    "batch",
]


def write_corpus(folder: Path, files: int = 3, sentences: int = 120, seed: int = 0) -> Path:
    """Patterned text a small model can learn: each file repeats its own short phrases."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        phrases = [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(3)]
        body = ". ".join(rng.choice(phrases) for _ in range(sentences))
        (folder / f"doc{f}.txt").write_text(body + ".\n")
    return folder


@pytest.fixture(scope="module")
def trained(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("adafuse_train")
    data_dir = write_corpus(tmp / "data")
    base, tok = load_base(tiny.model_dir, "cpu", torch.float32)
    cfg = TrainConfig(
        num_experts=4,
        top_k=2,
        rank=4,
        target_modules=("q_proj", "v_proj", "o_proj", "down_proj"),
        steps=40,
        batch_size=4,
        seq_len=32,
        lr=5e-3,
        warmup_steps=4,
        balance_coef=0.05,
        eval_every=10,
        seed=1,
    )
    data = TextDataset(data_dir, tok, cfg.seq_len, cfg.eval_fraction)
    result = train(base, data, cfg)
    root = tmp / "adapters"
    out = write_expert_set(result.model, tiny.model_dir, root / "trained")  # type: ignore[arg-type]
    return {"result": result, "root": root, "out": out, "data": data, "tok": tok, "cfg": cfg}


def test_loss_falls(trained: dict[str, Any]) -> None:
    r = trained["result"]
    first = sum(x.lm_loss for x in r.records[:5]) / 5
    last = sum(x.lm_loss for x in r.records[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert r.final_eval_loss < r.base_eval_loss


def test_balance_loss_keeps_every_expert_used(tiny: Tiny, tmp_path: Path) -> None:
    """Top-1 routing of skewed text starves an expert; the balance term feeds it again."""
    data_dir = write_corpus(tmp_path / "data")
    usage = {}
    for coef in (0.0, 0.5):
        base, tok = load_base(tiny.model_dir, "cpu", torch.float32)
        cfg = TrainConfig(
            num_experts=4,
            top_k=1,
            rank=4,
            target_modules=("q_proj", "v_proj"),
            steps=30,
            batch_size=4,
            seq_len=32,
            lr=5e-3,
            router_lr=5e-2,
            warmup_steps=2,
            balance_coef=coef,
            eval_every=10,
            seed=1,
            router_init=4.0,
        )
        r = train(base, TextDataset(data_dir, tok, cfg.seq_len, cfg.eval_fraction), cfg)
        usage[coef] = torch.tensor([x.usage for x in r.records[-5:]]).mean(0)
    # Without the balance loss one expert gets about a tenth of the tokens (uniform: 1/4).
    assert float(usage[0.0].min()) < 0.15, usage
    assert float(usage[0.5].min()) > 0.18, usage


def test_balance_loss_is_one_when_uniform_and_grows_on_collapse() -> None:
    n, e = 64, 4
    logits = torch.zeros(n, e)
    experts = torch.arange(n).remainder(e).view(n, 1)
    assert float(balance_loss(logits, experts, e)) == pytest.approx(1.0)
    collapsed = torch.zeros(n, e)
    collapsed[:, 0] = 10.0
    assert float(balance_loss(collapsed, torch.zeros(n, 1, dtype=torch.long), e)) > 3.5


def test_written_set_is_valid_and_names_the_training(trained: dict[str, Any], tiny: Tiny) -> None:
    out: Path = trained["out"]
    meta = json.loads((out / "adaptermesh_adafuse.json").read_text())
    assert meta["num_experts"] == 4
    assert meta["top_k"] == 2
    assert meta["r"] == 4
    cpu = read_expert_set(
        "trained", out, out.parent, ModelConfig.from_dir(tiny.model_dir), 16, torch.float32
    )
    # Training moved B away from zero in every expert.
    for b in cpu.b.values():
        assert (b.abs().amax(dim=(1, 2)) > 0).all()
    assert not list(out.parent.glob(".*tmp*"))


async def test_engine_serves_the_trained_set_like_the_training_forward(
    trained: dict[str, Any], tiny: Tiny, make_engine: Any
) -> None:
    model = trained["result"].model
    model.eval()
    prompt = list(tiny.encode("the shard router picks an expert"))
    n = 8
    ids = list(prompt)
    ref: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0][0, -1]
            ref.append(int(logits.argmax()))
            ids.append(ref[-1])
        base_tokens = tiny.ref.greedy(prompt, None, n)
    eng = make_engine(root=trained["root"])
    got = tokens(await collect(eng.submit(request("t", tuple(prompt), "trained", max_tokens=n))))
    assert got == ref
    # The trained experts change the output: the comparison is not vacuous.
    assert ref != base_tokens


def test_existing_output_is_refused_and_kept(trained: dict[str, Any], tiny: Tiny) -> None:
    out: Path = trained["out"]
    before = (out / "router.safetensors").read_bytes()
    with pytest.raises(TrainingError, match="output"):
        write_expert_set(trained["result"].model, tiny.model_dir, out)
    assert (out / "router.safetensors").read_bytes() == before


def test_bad_data_names_the_field(tmp_path: Path, trained: dict[str, Any]) -> None:
    tok = trained["tok"]
    with pytest.raises(TrainingError, match=r"^data: .*not a directory"):
        TextDataset(tmp_path / "missing", tok, 16, 0.1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainingError, match=r"^data: no text files"):
        TextDataset(tmp_path / "empty", tok, 16, 0.1)
    short = tmp_path / "short"
    short.mkdir()
    (short / "a.txt").write_text("hi")
    with pytest.raises(TrainingError, match=r"^data: .* tokens"):
        TextDataset(short, tok, 16, 0.1)
    (short / "b.txt").write_bytes(b"\xff\xfe bad")
    with pytest.raises(TrainingError, match="not UTF-8"):
        TextDataset(short, tok, 16, 0.1)


@settings(max_examples=40, deadline=None)
@given(
    experts=st.integers(-2, 80),
    top_k=st.integers(-1, 80),
    rank=st.integers(-1, 200),
    targets=st.lists(st.sampled_from(["q_proj", "v_proj", "down_proj", "lm_head", ""]), max_size=3),
    lr=st.floats(allow_nan=True, allow_infinity=True),
)
def test_config_validation_names_the_field(
    experts: int, top_k: int, rank: int, targets: list[str], lr: float
) -> None:
    cfg = TrainConfig(
        num_experts=experts, top_k=top_k, rank=rank, target_modules=tuple(targets), lr=lr
    )
    ok = (
        1 <= experts <= 64
        and 1 <= top_k <= experts
        and 1 <= rank <= 128
        and targets
        and all(t in ("q_proj", "v_proj", "down_proj") for t in targets)
        and len(set(targets)) == len(targets)
        and lr > 0
        and lr != float("inf")
    )
    if ok:
        cfg.validate()
    else:
        with pytest.raises(TrainingError) as info:
            cfg.validate()
        assert str(info.value).split(":")[0] in {
            "num_experts",
            "top_k",
            "rank",
            "target_modules",
            "lr",
        }


def test_cli_trains_and_writes_set_and_curve(tiny: Tiny, tmp_path: Path) -> None:
    data = write_corpus(tmp_path / "data", files=2, sentences=60)
    out = tmp_path / "adapters" / "cli_set"
    curve = tmp_path / "curve.json"
    rc = cli_main(
        [
            "--model",
            str(tiny.model_dir),
            "--data",
            str(data),
            "--out",
            str(out),
            "--experts",
            "2",
            "--top-k",
            "1",
            "--rank",
            "2",
            "--targets",
            "q_proj",
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--device",
            "cpu",
            "--curve",
            str(curve),
            "--log-level",
            "WARNING",
        ]
    )
    assert rc == 0
    assert (out / "adaptermesh_adafuse.json").is_file()
    body = json.loads(curve.read_text())
    assert len(body["steps"]) == 3
    assert body["config"]["num_experts"] == 2
    # A second run without --overwrite is refused before any training.
    rc = cli_main(
        ["--model", str(tiny.model_dir), "--data", str(data), "--out", str(out), "--device", "cpu"]
    )
    assert rc == 2
    rc = cli_main(
        [
            "--model",
            str(tiny.model_dir),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "x"),
            "--top-k",
            "9",
            "--device",
            "cpu",
        ]
    )
    assert rc == 2


# Each training flag and the TrainConfig field it sets, with a strategy for its value.
_FLAG_FIELDS: dict[str, tuple[str, st.SearchStrategy[Any]]] = {
    "--experts": ("num_experts", st.integers(1, 8)),
    "--top-k": ("top_k", st.integers(1, 8)),
    "--rank": ("rank", st.integers(1, 128)),
    "--alpha": ("lora_alpha", st.floats(0.5, 64.0)),
    "--steps": ("steps", st.integers(1, 10_000)),
    "--batch-size": ("batch_size", st.integers(1, 64)),
    "--seq-len": ("seq_len", st.integers(8, 4096)),
    "--lr": ("lr", st.floats(1e-6, 1.0)),
    "--router-lr": ("router_lr", st.floats(1e-6, 1.0)),
    "--warmup-steps": ("warmup_steps", st.integers(0, 100)),
    "--balance-coef": ("balance_coef", st.floats(0.0, 1.0)),
    "--eval-every": ("eval_every", st.integers(1, 100)),
    "--eval-fraction": ("eval_fraction", st.floats(0.05, 0.5)),
    "--seed": ("seed", st.integers(0, 2**31)),
}


@settings(max_examples=30, deadline=None)
@given(
    flags=st.sets(st.sampled_from(sorted(_FLAG_FIELDS))),
    data=st.data(),
    rslora=st.booleans(),
    no_bias=st.booleans(),
)
def test_cli_flags_set_their_config_fields(
    flags: set[str], data: st.DataObject, rslora: bool, no_bias: bool
) -> None:
    from adaptermesh.worker.adafuse_train_cli import build_parser, config_from_args

    given_values = {flag: data.draw(_FLAG_FIELDS[flag][1], label=flag) for flag in sorted(flags)}
    argv = ["--model", "m", "--data", "d", "--out", "o", "--targets", "q_proj,v_proj"]
    for flag, value in given_values.items():
        argv += [flag, repr(value)]
    if rslora:
        argv.append("--rslora")
    if no_bias:
        argv.append("--no-router-bias")
    args = build_parser().parse_args(argv)
    if given_values.get("--top-k", 2) > given_values.get("--experts", 4):
        with pytest.raises(TrainingError, match="top_k"):
            config_from_args(args)
        return
    cfg = config_from_args(args)
    default = TrainConfig()
    for flag, (field, _) in _FLAG_FIELDS.items():
        want = given_values.get(flag, getattr(default, field))
        assert getattr(cfg, field) == want, flag
    assert cfg.use_rslora is rslora
    assert cfg.router_bias is not no_bias
    assert cfg.target_modules == ("q_proj", "v_proj")
