"""A real PostgreSQL server for the tests, on 127.0.0.1 and a unix socket in a temp folder:
Debian's ``postgresql`` package (``initdb`` + ``pg_ctl``), started once per test session.

As root the server runs as the ``postgres`` user (PostgreSQL refuses root). Where no
server can be started the caller skips with :data:`HOW_TO_GET_ONE`.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

HOW_TO_GET_ONE = (
    "no PostgreSQL server could be started for the shared-index tests: install Debian's "
    "package (apt-get install postgresql; .ci/run does) and psycopg (pip install 'pie-media[replicas]')"
)


class NoPostgres(RuntimeError):
    """Why no server could be started."""


def _bin_dir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    for d in sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True
    ):
        if (Path(d) / "initdb").exists():
            return Path(d)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    data_dir: Path
    port: int
    _run_as: list[str]
    _bin: Path

    @property
    def url(self) -> str:
        return f"postgresql://pm@127.0.0.1:{self.port}/postgres"

    def fresh_schema_url(self) -> str:
        """A URL whose connections see only a new, empty schema (one per test: fast)."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url, autocommit=True) as c:
            c.execute(f"CREATE SCHEMA {name}")
        return f"{self.url}?options=-csearch_path%3D{name}"

    def stop(self) -> None:
        subprocess.run(
            [*self._run_as, str(self._bin / "pg_ctl"), "-D", str(self.data_dir), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=30,
        )
        shutil.rmtree(self.data_dir.parent, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """initdb into a temp folder and start the server; :class:`NoPostgres` when impossible."""
    try:
        import psycopg  # noqa: F401
    except ImportError as e:
        raise NoPostgres(f"psycopg is not installed ({e})") from e
    bin_dir = _bin_dir()
    if bin_dir is None:
        raise NoPostgres("no initdb on PATH or under /usr/lib/postgresql/*/bin")
    run_as: list[str] = []
    top = Path(tempfile.mkdtemp(prefix="pie-media-pg-"))
    data = top / "data"
    if os.geteuid() == 0:
        try:
            import pwd

            pw = pwd.getpwnam("postgres")
        except KeyError as e:
            shutil.rmtree(top, ignore_errors=True)
            raise NoPostgres("running as root and there is no 'postgres' user to run the server as") from e
        os.chown(top, pw.pw_uid, pw.pw_gid)
        os.chmod(top, 0o755)
        run_as = [shutil.which("runuser") or "runuser", "-u", "postgres", "--"]
    port = _free_port()
    try:
        subprocess.run(
            [*run_as, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "pm", "-E", "UTF8"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        opts = f"-k {top} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        subprocess.run(
            [
                *run_as,
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-o",
                opts,
                "-l",
                str(top / "log"),
                "-w",
                "start",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        err = getattr(e, "stderr", b"") or b""
        shutil.rmtree(top, ignore_errors=True)
        raise NoPostgres(f"{e}: {err.decode(errors='replace')[-400:]}") from e
    return PostgresServer(data, port, run_as, bin_dir)
