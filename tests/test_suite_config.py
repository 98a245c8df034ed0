"""The suite's own switches (tests/conftest.py), run on a small made-up suite: the test order
(shuffled or reversed inside each directory, never across, reproducible from its seed) and
REQUIRE_GPU=1, which turns the GPU skip into a failed run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makeini(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    gpu: needs a CUDA GPU\n    root: needs root\n"
    )
    for directory in ("a_first", "b_second"):
        for stem in ("test_one", "test_two"):
            body = "".join(f"def test_{i}():\n    pass\n\n\n" for i in range(4))
            body += "class TestGroup:\n" + "".join(
                f"    def test_m{i}(self):\n        pass\n\n" for i in range(3)
            )
            path = pytester.path / directory / f"{stem}_{directory[0]}.py"  # unique basenames
            path.parent.mkdir(exist_ok=True)
            path.write_text(body)
    return pytester


def collected(suite: pytest.Pytester, *args: str) -> list[str]:
    result = suite.runpytest("--collect-only", "-q", *args)
    assert result.ret == 0, result.stdout.str()
    return [line for line in result.outlines if "::" in line]


def ran(suite: pytest.Pytester, *args: str) -> tuple[str, list[str]]:
    """The header and the test ids in the order they ran."""
    result = suite.runpytest("-v", *args)
    assert result.ret == 0, result.stdout.str()
    return result.stdout.str(), [
        line.split(" ")[0] for line in result.outlines if line.endswith("%]") and " PASSED " in line
    ]


def test_file_order_is_the_default(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_ORDER", raising=False)
    ids = collected(suite)
    first = [n for n in ids if n.startswith("a_first/test_one_a.py::")]
    assert first == (
        [f"a_first/test_one_a.py::test_{i}" for i in range(4)]
        + [f"a_first/test_one_a.py::TestGroup::test_m{i}" for i in range(3)]
    )
    assert ids[: len(first)] == first


def test_shuffle_stays_inside_directories_files_and_classes(suite: pytest.Pytester) -> None:
    plain = collected(suite)
    orders = {
        tuple(collected(suite, "--order", "shuffle", "--order-seed", str(seed)))
        for seed in (1, 2, 3)
    }
    assert len(orders) > 1  # the seed decides
    for order in orders:
        assert sorted(order) == sorted(plain)
        # Every directory before the next, as collected; a file's and a class's tests together.
        dirs = [n.split("/")[0] for n in order]
        assert dirs == sorted(dirs)
        files = [n.split("::")[0] for n in order]
        runs = [f for k, f in enumerate(files) if k == 0 or files[k - 1] != f]
        assert len(runs) == len(set(runs)), order
        for cls in {n.rsplit("::", 1)[0] for n in order if "::TestGroup::" in n}:
            at = [k for k, n in enumerate(order) if n.startswith(cls + "::")]
            assert at == list(range(at[0], at[0] + len(at))), order
        assert list(order) != plain


def test_a_seed_repeats_its_order_and_the_header_names_it(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_flag = collected(suite, "--order", "shuffle", "--order-seed", "77")
    monkeypatch.setenv("TEST_ORDER", "shuffle")
    monkeypatch.setenv("TEST_ORDER_SEED", "77")
    assert collected(suite) == by_flag
    # A run without a seed picks one, prints it, and that seed gives the same order again.
    monkeypatch.delenv("TEST_ORDER_SEED")
    header, order = ran(suite)
    seed = re.search(r"test order: shuffle, seed (\d+) \(repeat: TEST_ORDER_SEED=\1\b", header)
    assert seed, header
    monkeypatch.setenv("TEST_ORDER_SEED", seed.group(1))
    assert ran(suite)[1] == order
    assert sorted(order) == sorted(by_flag)


def test_reverse_reverses_inside_each_directory(suite: pytest.Pytester) -> None:
    plain = collected(suite)
    backwards = collected(suite, "--order", "reverse")
    for directory in ("a_first", "b_second"):
        mine = [n for n in plain if n.startswith(directory)]
        theirs = [n for n in backwards if n.startswith(directory)]
        files = list(dict.fromkeys(n.split("::")[0] for n in mine))
        assert theirs[0].split("::")[0] == files[-1]
        assert theirs[-1] == mine[0]
    assert backwards[0].startswith("a_first/")


def test_a_bad_order_setting_is_refused(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_ORDER_SEED", "soon")
    result = suite.runpytest("--collect-only", "-q")
    assert result.ret != 0
    assert "TEST_ORDER_SEED='soon'" in result.stderr.str() + result.stdout.str()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run on a machine without CUDA")
def test_require_gpu_turns_the_gpu_skip_into_a_failed_run(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.makepyfile(
        test_gpu_only="import pytest\n\n\n@pytest.mark.gpu\ndef test_kernel():\n    pass\n"
    )
    monkeypatch.delenv("REQUIRE_GPU", raising=False)
    quiet = suite.runpytest("test_gpu_only.py")
    assert quiet.ret == 0
    quiet.assert_outcomes(skipped=1)
    monkeypatch.setenv("REQUIRE_GPU", "1")
    loud = suite.runpytest("test_gpu_only.py")
    assert loud.ret != 0
    assert "REQUIRE_GPU=1" in loud.stderr.str() + loud.stdout.str()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels compile")
def test_triton_runs_interpreted_from_the_first_import() -> None:
    # A kernel test fails with "Cannot call @triton.jit'd outside of the scope of a kernel"
    # when triton was first imported (by any module collected earlier) before the interpreter
    # was switched on: its own library functions then stay compiled-mode objects.
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(tl.zeros, InterpretedFunction)
    assert isinstance(tl.sum, InterpretedFunction)


def test_two_workers_run_the_host_tests_on_one_worker_first(suite: pytest.Pytester) -> None:
    """``make test``'s ``-n 2 --dist loadgroup``: every worker arranges the tests with the
    controller's seed (a different collection would stop the run), and the tests that use
    the host (root, e2e, tests/bpf) run on one worker, one at a time, before its others."""
    host = suite.path / "c_host"
    host.mkdir()
    host.joinpath("test_net_c.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.root\n\n\n"
        + "".join(f"def test_n{i}():\n    pass\n\n\n" for i in range(5))
    )
    result = suite.runpytest("-n", "2", "--dist", "loadgroup", "--order", "shuffle", "-v")
    assert result.ret == 0, result.stdout.str()
    ran = re.findall(r"\[(gw\d)\] \[\s*\d+%\] PASSED (\S+)", result.stdout.str())
    assert len(ran) == 2 * 2 * 7 + 5
    host_runs = [(gw, node) for gw, node in ran if node.startswith("c_host/")]
    assert len(host_runs) == 5
    assert all(node.endswith("@host") for _, node in host_runs)
    (worker,) = {gw for gw, _ in host_runs}
    # That worker began with them.
    mine = [node for gw, node in ran if gw == worker]
    assert all(node.startswith("c_host/") for node in mine[:5])
    # Outside xdist the same suite has no groups.
    plain = collected(suite, "--order", "shuffle", "--order-seed", "5")
    assert not any("@" in node for node in plain)


def test_each_worker_runs_torch_on_its_share_of_the_cpus(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two xdist workers on the CPUs this process sees: each worker's torch takes half of them
    (at least one), so the workers' OpenMP pools do not oversubscribe the cores; one process
    keeps torch's own default."""
    import os
    import subprocess
    import sys

    cpus = len(os.sched_getaffinity(0))
    default = int(
        subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            capture_output=True,
            text=True,
            check=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("OMP_")},
        ).stdout
    )
    suite.path.joinpath("a_first", "test_threads_a.py").write_text(
        "import os\nimport torch\n\n\n"
        "def test_threads():\n"
        "    workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT') or 0)\n"
        f"    want = max(1, {cpus} // workers) if workers > 1 else {default}\n"
        "    assert torch.get_num_threads() == want, (torch.get_num_threads(), want)\n"
    )
    # This test may itself run on an xdist worker: the runs below are not its workers.
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    for args in (("-n", "2"), ("-p", "no:xdist")):
        result = suite.runpytest_subprocess(*args, "-k", "test_threads")
        assert result.ret == 0, result.stdout.str()
