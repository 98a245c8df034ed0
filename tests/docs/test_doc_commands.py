"""Every command README.md and docs/*.md show is run, or at least parsed, here.

The documents tag each fenced block with what it is (the first word of the info string):

- ``sh``: commands a user pastes on one machine. They run, in document order, in one bash
  session per document (so ``export`` and ``cd`` carry over, as in a terminal), against the
  mesh of ``adaptermesh dev up`` (two shards, so overrides, pins and rollouts run), with ``AMDEV`` (its work directory),
  ``ADAPTERMESH_TOKEN_FILE`` and ``ADMIN_TOKEN`` set as ``up`` prints them. Each block must
  exit 0 (``set -e -o pipefail``).
- ``sh by-hand``: docs/operator-guide.md's "One machine, by hand": run the same way, but in a
  network namespace of their own (they start the processes ``dev up`` would).
- ``sh cluster``: commands for a cluster, a GPU host or another machine. Not run: ``bash -n``
  parses them, and every ``adapterctl``/``adaptermesh`` command's subcommand must exist and its
  ``--flags`` must be in that subcommand's ``--help``.
- ``console``: ``$ `` lines are commands (run as ``sh``); the other lines are output, and each
  must appear in what the commands printed (see :func:`output_has`). ``console cluster``: the
  commands are only checked as ``sh cluster``.
- ``yaml file=NAME``: saved as NAME in the session's current directory.
- ``python run``: run with the virtualenv's Python in the session.
- ``text output``: what the runnable block just before it printed; each line must appear in
  that output (see :func:`output_has`).
- ``text``, ``yaml``, ``json``, ``python``, ``promql``: shown, not run.

A block with no tag, or a tag outside this list, fails :func:`test_every_block_is_tagged`.
The mesh starts once per module (about 11 s on two cores), in a network namespace of its own
so its 127.0.0.1 ports never meet the host's. The documents run against that one mesh in any
order, so a document clears the overrides and pins it sets.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
KINDS = {
    ("sh",),
    ("sh", "by-hand"),
    ("sh", "cluster"),
    ("console",),
    ("console", "cluster"),
    ("yaml",),
    ("python",),
    ("python", "run"),
    ("text",),
    ("text", "output"),
    ("json",),
    ("promql",),
}
BLOCK_TIMEOUT_S = 120.0

FENCE = re.compile(r"^(\s*)```(.*)$")


@dataclass
class Block:
    path: Path
    line: int
    info: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def kind(self) -> tuple[str, ...]:
        return tuple(word for word in self.info if "=" not in word)

    def option(self, name: str) -> str | None:
        for word in self.info:
            key, _, value = word.partition("=")
            if key == name and value:
                return value
        return None


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.relative_to(REPO)}:{i + 1}: unterminated code block")
        body = "\n".join(line[indent:] for line in lines[i + 1 : j])
        found.append(Block(path, i + 1, tuple(m.group(2).split()), body + "\n"))
        i = j + 1
    return found


def console_commands(block: Block) -> tuple[str, list[str]]:
    """The ``$ `` commands (continuation lines kept) and the expected output lines."""
    commands: list[str] = []
    expected: list[str] = []
    continuing = False
    for line in block.text.splitlines():
        if line.startswith("$ ") or continuing:
            text = line[2:] if line.startswith("$ ") and not continuing else line
            commands.append(text)
            continuing = text.rstrip().endswith("\\")
        elif line.strip():
            expected.append(line)
    return "\n".join(commands) + "\n", expected


BOX = re.compile(r"[\u2500-\u257f]")  # the box-drawing characters of adapterctl's tables


def _squash(text: str) -> str:
    return " ".join(BOX.sub(" ", text).split())


def output_has(expected: str, output: str) -> bool:
    """Whether ``expected`` (one line a document shows as output) is in ``output``.

    Spaces are collapsed and tables' box-drawing characters count as spaces, on both sides, so
    a document may show a table row with or without its borders. A line with ``...`` matches
    one output line that has the parts between the ``...`` in order (for figures that differ
    from run to run); a line without it must appear as it is (across line breaks too).
    """
    want = _squash(expected)
    if "..." not in want:
        return want in _squash(output)
    parts = [re.escape(part.strip()) for part in want.split("...")]
    pattern = re.compile(r".*?".join(parts))
    return any(pattern.search(_squash(line)) for line in output.splitlines())


# ---- the checks of commands that are not run -------------------------------------------------


_HELP_CACHE: dict[tuple[str, ...], str | None] = {}


def _help(words: tuple[str, ...]) -> str | None:
    if words not in _HELP_CACHE:
        proc = subprocess.run(
            [str(BIN / words[0]), *words[1:], "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "400"},
            check=False,
        )
        _HELP_CACHE[words] = proc.stdout + proc.stderr if proc.returncode == 0 else None
    return _HELP_CACHE[words]


def simple_commands(script: str) -> list[list[str]]:
    """The words of each simple command (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", script)
    out: list[list[str]] = []
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # bash -n judges the syntax
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|", "&"):
                if command:
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def check_cluster_commands(block: Block, script: str) -> list[str]:
    problems: list[str] = []
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    if syntax.returncode != 0:
        problems.append(f"{block.where}: bash -n: {syntax.stderr.strip()}")
    for words in simple_commands(script):
        while words and re.match(r"^[A-Z_]+=", words[0]):
            words = words[1:]  # VAR=value prefixes
        if not words or words[0] not in ("adapterctl", "adaptermesh"):
            continue
        path = [words[0]]
        for word in words[1:]:
            if word.startswith("-"):
                break
            path.append(word)
        named_subcommand = len(path) > 1
        # The longest prefix of the positional words that is a command with a --help.
        help_text = None
        while path:
            help_text = _help(tuple(path))
            if help_text is not None and (len(path) > 1 or words[0] == "adapterctl"):
                break
            path.pop()
        if not path or help_text is None or (named_subcommand and len(path) == 1):
            problems.append(f"{block.where}: {' '.join(words[:3])}: no such command")
            continue
        for word in words[1:]:
            if word.startswith("--") and len(word) > 2:
                flag = word.split("=", 1)[0]
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):
                    problems.append(f"{block.where}: {' '.join(path)}: unknown flag {flag}")
    return problems


# ---- the shell session -----------------------------------------------------------------------


class Session:
    """One bash process, fed block after block, in a network namespace; stops on a failure."""

    def __init__(self, netns: str, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{netns}", "bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.count = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, block: Block, script: str, timeout: float = BLOCK_TIMEOUT_S) -> str:
        """Run ``script``; its output, or AssertionError with the output when it fails."""
        self.count += 1
        script_path = self.cwd / f".block-{self.count}.sh"
        out_path = self.cwd / f".block-{self.count}.out"
        script_path.write_text(script)
        marker = f"__block_done_{self.count}__"
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            f"set -e -o pipefail; . {script_path} > {out_path} 2>&1 < /dev/null; set +e\n"
            f"echo {marker}\n"
        )
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            output = out_path.read_text(errors="replace") if out_path.exists() else ""
            if line is None:
                raise AssertionError(f"{block.where}: failed:\n{script}\n--- output:\n{output}")
            if line.strip() == marker:
                return output
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{block.where}: still running after {timeout:g}s:\n{script}\n"
                    f"--- output:\n{output}"
                )

    def close(self) -> None:
        # The session's process group: the shell and whatever a block left in the background.
        for sig in ("TERM", "KILL"):
            subprocess.run(["kill", f"-{sig}", "--", f"-{self.proc.pid}"], capture_output=True)
            try:
                self.proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue


def run_document(blocks_: list[Block], session: Session, wanted: set[tuple[str, ...]]) -> None:
    problems: list[str] = []
    last_output: str | None = None  # of the block just before, when it ran
    for block in blocks_:
        if block.kind == ("text", "output"):
            if last_output is not None:
                for line in block.text.splitlines():
                    if line.strip() and not output_has(line, last_output):
                        problems.append(
                            f"{block.where}: output lacks {line!r}; got:\n{last_output}"
                        )
            last_output = None
            continue
        last_output = None
        name = block.option("file")
        if block.kind == ("yaml",) and name:
            # Saved in the session's current directory, as a user would.
            session.run(block, f"cat > {shlex.quote(name)} <<'__YAML__'\n{block.text}__YAML__\n")
            continue
        if block.kind not in wanted:
            continue
        if block.kind[0] == "console":
            script, expected = console_commands(block)
        elif block.kind == ("python", "run"):
            script = f"{BIN / 'python'} - <<'__PYTHON__'\n{block.text}__PYTHON__\n"
            expected = []
        else:
            script, expected = block.text, []
        output = last_output = session.run(block, script)
        for line in expected:
            if not output_has(line, output):
                problems.append(f"{block.where}: output lacks {line!r}; got:\n{output}")
    assert not problems, "\n".join(problems)


# ---- fixtures and tests ----------------------------------------------------------------------


def _netns(name: str) -> None:
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)


@pytest.fixture(scope="module")
def dev_mesh(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, dict[str, str], str]]:
    """``adaptermesh dev up`` in a network namespace; yields (namespace, session env, what
    ``up`` printed)."""
    suffix = secrets.token_hex(2)
    netns, prefix = f"amdoc{suffix}", f"amdoc{suffix}"
    workdir = tmp_path_factory.mktemp("dev")
    _netns(netns)
    log = workdir.parent / f"dev-up-{suffix}.log"
    with open(log, "w") as fh:
        up = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{netns}",
                str(BIN / "adaptermesh"),
                "dev",
                "up",
                "--workdir",
                str(workdir),
                "--prefix",
                prefix,
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while "The mesh is up" not in log.read_text():
            assert up.poll() is None, f"adaptermesh dev up exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"dev up not ready:\n{log.read_text()}"
            time.sleep(0.5)
        env = {
            **os.environ,
            "AMDEV": str(workdir),
            "ADAPTERMESH_TOKEN_FILE": str(workdir / "operator.token"),
            "ADMIN_TOKEN": (workdir / "worker-admin.token").read_text().strip(),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "COLUMNS": "200",
        }
        for key in ("ADAPTERMESH_TOKEN", "ADAPTERMESH_SERVER", "AM"):
            env.pop(key, None)
        yield netns, env, log.read_text()
    finally:
        up.send_signal(2)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)
        subprocess.run(["ip", "netns", "del", netns], check=False)
        print(log.read_text()[-3000:])
        assert not Path(f"/sys/fs/bpf/{prefix}").exists(), "dev up left its pins"


def test_every_block_is_tagged() -> None:
    problems = [
        f"{block.where}: ```{' '.join(block.info)}: tag it one of "
        f"{sorted(' '.join(kind) for kind in KINDS)}"
        for path in DOCS
        for block in blocks(path)
        if block.kind not in KINDS
    ]
    for path in DOCS:
        found = blocks(path)
        for before, block in itertools.pairwise(found):
            if block.kind == ("text", "output") and before.kind not in RUN_KINDS:
                problems.append(
                    f"{block.where}: ```text output follows a block that does not run "
                    f"(```{' '.join(before.info)})"
                )
    assert not problems, "\n".join(problems)


def test_output_lines_match_with_spaces_borders_and_ellipses() -> None:
    output = (
        "rollout support (unversioned) -> 2.0.0 started at 50% (id 31acda6ada9fc245)\n"
        "│ support │ 2.0.0 │ 3.0.0 │ ROLLED_BACK │ 1/2  │ 0%    │ error rate 30.0% > 1.0% over 9 │\n"
    )
    assert output_has("rollout support (unversioned) -> 2.0.0 started at 50%", output)
    assert output_has("support  2.0.0  3.0.0  ROLLED_BACK  1/2  0%", output)
    assert output_has("│ support │ 2.0.0 │ 3.0.0 │ ROLLED_BACK │", output)
    assert output_has("support 2.0.0 3.0.0 ROLLED_BACK ... error rate ... > 1.0% over", output)
    assert not output_has("support 2.0.0 3.0.0 COMPLETED", output)
    assert not output_has("ROLLED_BACK ... started at 50%", output)  # parts on two lines
    assert not output_has("error rate ... ROLLED_BACK", output)  # parts out of order


@given(
    st.lists(
        st.text(
            alphabet=st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zl", "Zp")),
            max_size=40,
        ),
        min_size=1,
        max_size=6,
    ),
    st.data(),
)
def test_every_printed_line_matches_and_a_foreign_word_does_not(
    lines: list[str], data: st.DataObject
) -> None:
    output = "\n".join(lines) + "\n"
    line = data.draw(st.sampled_from(lines))
    assert output_has(line, output)
    assert output_has(line.replace("...", " ") + " ... ", output) or "..." in line
    assert not output_has(f"{line} zq-not-printed-qz", output) or "zq-not-printed-qz" in output


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_cluster_commands_parse(path: Path) -> None:
    problems: list[str] = []
    for block in blocks(path):
        if block.kind == ("sh", "cluster"):
            problems += check_cluster_commands(block, block.text)
        elif block.kind == ("console", "cluster"):
            problems += check_cluster_commands(block, console_commands(block)[0])
    assert not problems, "\n".join(problems)


RUNNABLE = {("sh",), ("console",), ("python", "run")}
RUN_KINDS = RUNNABLE | {("sh", "by-hand")}


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    [p for p in DOCS if any(b.kind in RUNNABLE for b in blocks(p))],
    ids=lambda p: p.name,
)
def test_commands_run(
    path: Path, dev_mesh: tuple[str, dict[str, str], str], tmp_path: Path
) -> None:
    netns, env, _printed = dev_mesh
    session = Session(netns, tmp_path, env)
    try:
        run_document(blocks(path), session, RUNNABLE)
    finally:
        session.close()


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.slow
def test_dev_up_prints_commands_that_work(
    dev_mesh: tuple[str, dict[str, str], str], tmp_path: Path
) -> None:
    """What ``adaptermesh dev up`` prints to paste (its indented lines) runs as printed, in a
    shell without the test's variables; every curl must get a 2xx."""
    netns, env, printed = dev_mesh
    text = printed[printed.index("The mesh is up") :]
    commands = [line[2:] for line in text.splitlines() if line.startswith("  ")]
    assert any("ADAPTERMESH_TOKEN_FILE=" in c for c in commands), text
    script = "\n".join(commands).replace("curl -s ", "curl -s --fail-with-body ") + "\n"
    clean = {
        k: v for k, v in env.items() if k not in ("AMDEV", "ADAPTERMESH_TOKEN_FILE", "ADMIN_TOKEN")
    }
    session = Session(netns, tmp_path, clean)
    try:
        session.run(Block(REPO / "src/adaptermesh/cli/dev.py", 0, ("sh",), script), script)
    finally:
        session.close()


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.slow
def test_one_machine_by_hand(tmp_path: Path) -> None:
    """The operator guide's by-hand setup, in a network namespace of its own, then the
    guide's runnable commands against it."""
    suffix = secrets.token_hex(2)
    netns = f"amhand{suffix}"
    _netns(netns)
    env = {
        **os.environ,
        "AM": f"amh{suffix}",
        "AMDEV": str(tmp_path / "mesh"),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "COLUMNS": "200",
    }
    for key in ("ADAPTERMESH_TOKEN", "ADAPTERMESH_TOKEN_FILE", "ADAPTERMESH_SERVER"):
        env.pop(key, None)
    work = tmp_path / "session"
    work.mkdir()
    session = Session(netns, work, env)
    try:
        guide = blocks(REPO / "docs" / "operator-guide.md")
        assert any(b.kind == ("sh", "by-hand") for b in guide)
        run_document(guide, session, {("sh", "by-hand")})
    finally:
        session.close()
        subprocess.run(["ip", "netns", "del", netns], check=False)
        shutil.rmtree(f"/sys/fs/bpf/amh{suffix}", ignore_errors=True)


def _in_mesh(netns: str, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/{netns}", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def _served_by(netns: str, env: dict[str, str], source: str) -> str:
    r = _in_mesh(
        netns, env, str(BIN / "adaptermesh"), "dev", "exec", "--", "curl", "-s", "-D", "-",
        "-o", "/dev/null", "--interface", source, "10.213.0.1:8080/v1/models",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    found = re.search(r"^x-adaptermesh-served-by: (\S+)", r.stdout, re.M)
    assert found, r.stdout
    return found.group(1)


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.slow
def test_dev_exec_requests_cross_the_classifier(
    dev_mesh: tuple[str, dict[str, str], str],
) -> None:
    """A pin moves the client namespace's requests from one shard's Envoy to the other's,
    and a connection that did not cross the classifier (no mark) reaches no shard."""
    netns, env, _printed = dev_mesh
    ctl = str(BIN / "adapterctl")
    source = "10.213.0.6"
    try:
        for shard in ("s0", "s1", "s0"):
            assert _in_mesh(netns, env, ctl, "pin", f"{source}/32", shard).returncode == 0
            assert _served_by(netns, env, source) == shard
            assert _in_mesh(netns, env, ctl, "unpin", f"{source}/32").returncode == 0
    finally:
        _in_mesh(netns, env, ctl, "unpin", f"{source}/32")
    bypass = _in_mesh(netns, env, "curl", "-s", "-m", "5", "10.213.0.1:8080/v1/models")
    assert bypass.returncode != 0
    assert bypass.stdout == ""


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.slow
def test_a_second_up_leaves_the_first_serving_with_its_state(
    dev_mesh: tuple[str, dict[str, str], str], tmp_path: Path
) -> None:
    netns, env, _printed = dev_mesh
    ctl = str(BIN / "adapterctl")
    workdir = env["AMDEV"]
    prefix = json.loads((Path(workdir) / "mesh.json").read_text())["prefix"]
    source = "10.213.0.7"
    assert _in_mesh(netns, env, ctl, "pin", f"{source}/32", "s1").returncode == 0
    try:
        before = json.loads(_in_mesh(netns, env, ctl, "status", "-o", "json").stdout)
        up = str(BIN / "adaptermesh")
        attempts = {
            "same workdir": [up, "dev", "up", "--workdir", workdir, "--prefix", prefix],
            "other workdir": [up, "dev", "up", "--workdir", str(tmp_path / "w2"), "--prefix",
                              prefix],
            "other workdir and prefix": [up, "dev", "up", "--workdir", str(tmp_path / "w3"),
                                         "--prefix", "amsecond"],
        }  # fmt: skip
        for what, argv in attempts.items():
            r = _in_mesh(netns, env, *argv)
            assert r.returncode == 1, (what, r.stdout, r.stderr)
            assert r.stderr.count("\n") == 1, (what, r.stderr)
            if what == "other workdir and prefix":
                assert "127.0.0.1:7400 is in use, probably by pid " in r.stderr, r.stderr
                assert "control-plane" in r.stderr, r.stderr
            else:
                assert "a dev mesh is already running" in r.stderr, r.stderr
                assert f"workdir {workdir}" in r.stderr
        assert not (tmp_path / "w2").exists()
        assert not (tmp_path / "w3").exists()
        assert _in_mesh(netns, env, "ip", "link", "show", "amsecond0").returncode != 0
        after = json.loads(_in_mesh(netns, env, ctl, "status", "-o", "json").stdout)
        assert after["assignment"]["version"] >= before["assignment"]["version"]
        agent = json.loads(_in_mesh(netns, env, "curl", "-s", "127.0.0.1:9464/status").stdout)
        assert {"cidr": f"{source}/32", "shard_id": "s1"} in agent["pins"], agent["pins"]
        assert agent["applied_version"] >= before["assignment"]["version"]
        assert _served_by(netns, env, source) == "s1"
        r = _in_mesh(
            netns, env, "curl", "-s", "--fail-with-body", "127.0.0.1:8080/v1/completions",
            "-H", "content-type: application/json",
            "-d", '{"model": "support", "prompt": "hi", "max_tokens": 2}',
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        _in_mesh(netns, env, ctl, "unpin", f"{source}/32")
