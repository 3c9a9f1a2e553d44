"""``pie-media serve`` flags of the replicas: refused combinations and an unreachable state
database end the start with a message and exit status 2 (no traceback, no Ray started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.cli import main


def test_replicas_need_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replicas", "2", "--state-dir", str(tmp_path)]) == 2
    assert "--replicas N (N >= 1) goes with --ray" in capsys.readouterr().err


def test_state_db_must_be_postgresql(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--state-db", "mysql://x/y", "--state-dir", str(tmp_path)]) == 2
    assert "--state-db must be a postgresql:// URL" in capsys.readouterr().err


def test_unreachable_state_db_is_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("psycopg", reason="pip install 'pie-media[replicas]'")
    url = "postgresql://pm:secret@127.0.0.1:1/none"  # port 1: nothing listens
    assert main(["serve", "--state-db", url, "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot connect to the state database" in err and "secret" not in err
