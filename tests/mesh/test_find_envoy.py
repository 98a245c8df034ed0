"""find_envoy names the variable the user set when it points nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptermesh.mesh.bootstrap import EnvoyError, find_envoy


def test_an_adaptermesh_envoy_that_is_not_a_program_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "no-envoy"
    monkeypatch.setenv("ADAPTERMESH_ENVOY", str(missing))
    with pytest.raises(EnvoyError, match=rf"ADAPTERMESH_ENVOY={missing}: not an executable file"):
        find_envoy()
    program = tmp_path / "envoy"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv("ADAPTERMESH_ENVOY", str(program))
    assert find_envoy() == str(program)
