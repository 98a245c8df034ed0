"""The engine sizes itself where ``EngineConfig.auto_size`` says (worker/sizing.py), and the
worker's command line asks it to for every size whose flag was not given."""

from __future__ import annotations

import argparse
import types
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from adaptermesh.worker import cli
from adaptermesh.worker.engine_config import SIZING_FIELDS, EngineConfig, size_config
from adaptermesh.worker.sizing import CPU_DEFAULTS, GIB
from adaptermesh.worker.types import InvalidRequestError

pytestmark = pytest.mark.asyncio


async def test_a_cpu_engine_that_sizes_itself_keeps_the_small_defaults(make_engine: Any) -> None:
    eng = make_engine(max_num_seqs=3, auto_size=SIZING_FIELDS - {"max_num_seqs"})
    assert eng.config.max_num_seqs == 3  # the "flag" stays
    assert eng.config.max_loras == CPU_DEFAULTS.max_loras
    # The adapter arena holds that many adapters on every module (more on fewer).
    assert eng.pool.arena.fits(eng.pool.arena.grids) == CPU_DEFAULTS.max_loras
    assert eng.config.max_num_batched_tokens == CPU_DEFAULTS.max_num_batched_tokens
    assert 0 < eng.config.cpu_cache_bytes <= 2 * GIB
    assert eng.adapters.cpu_cache_bytes == eng.config.cpu_cache_bytes
    sizes = eng.describe()["sizes"]
    assert sizes["max_num_seqs"] == "flag"
    assert sizes["max_loras"] == "cpu default"


async def test_without_auto_size_nothing_moves(make_engine: Any) -> None:
    eng = make_engine(max_num_seqs=5, max_loras=3)
    assert (eng.config.max_num_seqs, eng.pool.arena.fits(eng.pool.arena.grids)) == (5, 3)
    assert eng.describe()["sizes"] is None


def test_an_unknown_size_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequestError) as err:
        size_config(
            EngineConfig(auto_size=frozenset({"max_tokens"})),
            device=torch.device("cpu"),
            kv_bytes_per_token=1,
            slot_bytes=1,
            max_model_len=16,
        )
    assert err.value.field == "auto_size"


def test_on_a_gpu_the_sizes_follow_its_memory() -> None:
    # An H200 with a 7B model loaded: what the sizing sees through torch.cuda.mem_get_info.
    total = 141 * GIB
    with mock.patch.object(torch.cuda, "mem_get_info", return_value=(total - 14 * GIB, total)):
        sized, sizing = size_config(
            EngineConfig(max_loras=64, auto_size=SIZING_FIELDS - {"max_loras"}),
            device=torch.device("cuda"),
            kv_bytes_per_token=512 * 1024,
            slot_bytes=320 << 20,
            max_model_len=4096,
        )
    assert sizing is not None
    assert sized.max_num_seqs == 256
    assert sized.max_loras == 64
    assert sized.kv_cache_bytes is not None
    assert sized.kv_cache_bytes > 80 * GIB
    assert sizing.origin["max_loras"] == "flag"


def _args(tmp_path: Path, **flags: Any) -> argparse.Namespace:
    return cli.build_parser().parse_args(
        [
            "--model",
            str(tmp_path),
            "--adapter-root",
            str(tmp_path),
            "--device",
            "cpu",
            *[
                part
                for key, value in flags.items()
                for part in (f"--{key.replace('_', '-')}", str(value))
            ],
        ]
    )


@pytest.mark.parametrize(
    ("flags", "auto"),
    [
        ({}, SIZING_FIELDS),
        ({"max_num_seqs": 128, "max_loras": 64}, SIZING_FIELDS - {"max_num_seqs", "max_loras"}),
        (
            {"kv_cache_bytes": 1 << 30, "cpu_cache_bytes": 1 << 30},
            SIZING_FIELDS - {"kv_cache_bytes", "cpu_cache_bytes"},
        ),
    ],
)
def test_the_command_line_leaves_unflagged_sizes_to_the_worker(
    tmp_path: Path, flags: dict[str, int], auto: frozenset[str]
) -> None:
    seen: dict[str, EngineConfig] = {}

    class Capture:
        def __init__(self, *args: Any, config: EngineConfig, **kwargs: Any) -> None:
            seen["config"] = config
            self.adapters = types.SimpleNamespace(stores=None)  # the command line sets stores

    with mock.patch("adaptermesh.worker.engine.Engine", Capture):
        cli._build_engine(_args(tmp_path, **flags))
    config = seen["config"]
    assert config.auto_size == auto
    for name, value in flags.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        (None, EngineConfig().lora_density_configs),
        ("--lora-density-configs", True),
        ("--no-lora-density-configs", False),
    ],
)
def test_the_density_configs_flag_reaches_the_engine_config(
    tmp_path: Path, flag: str | None, expected: bool
) -> None:
    seen: dict[str, EngineConfig] = {}

    class Capture:
        def __init__(self, *args: Any, config: EngineConfig, **kwargs: Any) -> None:
            seen["config"] = config
            self.adapters = types.SimpleNamespace(stores=None)

    argv = ["--model", str(tmp_path), "--adapter-root", str(tmp_path), "--device", "cpu"]
    with mock.patch("adaptermesh.worker.engine.Engine", Capture):
        cli._build_engine(cli.build_parser().parse_args(argv + ([flag] if flag else [])))
    assert seen["config"].lora_density_configs is expected
