"""WASI filesystem of a Pie-world run (inferlets/host/wasi/filesystem.py): a real Pie project
(stock componentize-py, CPython's open/read/write/os.* through the wasip1 adapter) writes,
appends, reads, lists, stats, renames and deletes files under ``/scratch``; every way out
(absolute paths, ``..``, links pointing out) is refused; the size cap holds; the sandbox
is gone after the run and no two runs see each other's files."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest

from inferlets.host.limits import RunLimits
from inferlets.host.pie_world import PieHost

MAIN = textwrap.dedent(
    """
    import asyncio
    import errno
    import json
    import os
    import stat


    def attempt(fn):
        try:
            r = fn()
            return ["ok", r if isinstance(r, (str, int, list)) else None]
        except OSError as e:
            return ["err", errno.errorcode.get(e.errno, str(e.errno))]
        except Exception as e:
            return ["exc", type(e).__name__]


    def read(path, mode="r"):
        with open(path, mode) as f:
            return f.read()


    def write(path, data, mode="wb"):
        with open(path, mode) as f:
            return f.write(data)


    def pwrite(path, data):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            return os.pwrite(fd, data, 0)
        finally:
            os.close(fd)


    def exercise(tag, out):
        write("/scratch/notes.txt", "hello ", "w")
        write("/scratch/notes.txt", "world", "a")
        out["read"] = read("/scratch/notes.txt")
        os.mkdir("/scratch/sub")
        blob = bytes(range(256)) * 64
        write(f"/scratch/sub/{tag}.bin", blob)
        with open(f"/scratch/sub/{tag}.bin", "r+b") as f:
            f.seek(10)
            f.write(b"XY")
            f.seek(-4, os.SEEK_END)
            out["tail"] = list(f.read())
            f.seek(8)
            out["patched"] = list(f.read(6))
        out["rest_ok"] = read(f"/scratch/sub/{tag}.bin", "rb")[12:] == blob[12:]
        s = os.stat(f"/scratch/sub/{tag}.bin")
        out["stat"] = [s.st_size, stat.S_ISREG(s.st_mode), stat.S_ISDIR(os.stat("/scratch/sub").st_mode)]
        out["missing"] = attempt(lambda: os.stat("/scratch/nope"))
        out["listing"] = [sorted(os.listdir("/scratch")), sorted(os.listdir("/scratch/sub"))]
        out["walk"] = sorted([d, sorted(fs)] for d, _, fs in os.walk("/scratch"))
        os.rename("/scratch/notes.txt", "/scratch/sub/renamed.txt")
        out["renamed"] = [os.path.exists("/scratch/notes.txt"), read("/scratch/sub/renamed.txt")]
        os.remove("/scratch/sub/renamed.txt")
        out["removed"] = sorted(os.listdir("/scratch/sub"))
        out["rmdir_full"] = attempt(lambda: os.rmdir("/scratch/sub"))
        os.mkdir("/scratch/empty")
        os.rmdir("/scratch/empty")
        # links: inside is fine, pointing out is refused
        out["symlink_in"] = attempt(lambda: os.symlink("sub", "/scratch/link"))
        out["via_link"] = attempt(lambda: sorted(os.listdir("/scratch/link")))
        out["readlink"] = attempt(lambda: os.readlink("/scratch/link"))
        out["symlink_abs"] = attempt(lambda: os.symlink("/etc/passwd", "/scratch/bad"))
        out["symlink_up"] = attempt(lambda: os.symlink("../../etc/passwd", "/scratch/sub/bad"))
        out["hardlink"] = attempt(lambda: os.link(f"/scratch/sub/{tag}.bin", "/scratch/hard.bin"))
        out["hard_size"] = os.stat("/scratch/hard.bin").st_size
        os.remove("/scratch/hard.bin")
        os.remove("/scratch/link")
        # ways out
        out["etc_passwd"] = attempt(lambda: read("/etc/passwd"))
        out["dotdot_write"] = attempt(lambda: write("/scratch/../x", b"x"))
        out["dotdot_read"] = attempt(lambda: read("/scratch/sub/../../etc/passwd"))
        out["listdir_root"] = attempt(lambda: os.listdir("/"))
        out["listdir_up"] = attempt(lambda: os.listdir("/scratch/.."))
        out["rmdir_scratch"] = attempt(lambda: os.rmdir("/scratch/sub/.."))


    def moved_link(out):
        # A link that stays inside where it was made points out once moved; a directory
        # descriptor whose directory is swapped for such a link must not follow it.
        os.makedirs("/scratch/a/b")
        os.mkdir("/scratch/d")
        write("/scratch/d/inside", b"i")
        out["link_deep"] = attempt(lambda: os.symlink("../..", "/scratch/a/b/up"))
        out["via_deep"] = attempt(lambda: sorted(os.listdir("/scratch/a/b/up")))
        fd = os.open("/scratch/d", os.O_RDONLY | os.O_DIRECTORY)
        out["fd_stat_before"] = attempt(lambda: os.stat("inside", dir_fd=fd).st_size)
        os.rename("/scratch/d", "/scratch/d_old")
        os.rename("/scratch/a/b/up", "/scratch/d")
        out["moved_list"] = attempt(lambda: os.listdir("/scratch/d"))
        out["moved_open"] = attempt(lambda: read("/scratch/d/etc/passwd"))
        out["moved_readlink"] = attempt(lambda: os.readlink("/scratch/d"))
        out["stale_fd_stat"] = attempt(lambda: os.stat("inside", dir_fd=fd).st_size)
        os.close(fd)
        os.remove("/scratch/d")
        os.remove("/scratch/d_old/inside")
        for d in ("/scratch/d_old", "/scratch/a/b", "/scratch/a"):
            os.rmdir(d)


    def cap(n, out):
        out["under_cap"] = attempt(lambda: write("/scratch/big", b"x" * (n // 2)))
        out["over_cap_stream"] = attempt(lambda: write("/scratch/big2", b"y" * n))
        out["over_cap_pwrite"] = attempt(lambda: pwrite("/scratch/big3", b"z" * n))
        out["over_cap_truncate"] = attempt(lambda: os.truncate("/scratch/big", 2 * n))
        for name in ("big", "big2", "big3"):
            os.remove("/scratch/" + name)
        out["after_free"] = attempt(lambda: write("/scratch/big4", b"w" * (n - 10)))
        os.remove("/scratch/big4")


    async def main(input: dict) -> str:
        tag = input["tag"]
        out = {"initial": sorted(os.listdir("/scratch"))}
        if input.get("exercise"):
            exercise(tag, out)
        if input.get("moved_link"):
            moved_link(out)
        if input.get("cap"):
            cap(input["cap"], out)
        write(f"/scratch/mine-{tag}", tag, "w")
        await asyncio.sleep(input.get("wait", 0))
        out["final"] = sorted(os.listdir("/scratch"))
        return json.dumps(out)
    """
)


@pytest.fixture(scope="module")
def fs_wasm(tmp_path_factory) -> Path:
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    project = tmp_path_factory.mktemp("fs-probe")
    (project / "Pie.toml").write_text('[package]\nname = "fs-probe"\nversion = "0.1.0"\n')
    (project / "main.py").write_text(MAIN)
    return build_pie_component(project, cache_root() / "pie-build")


@pytest.fixture(scope="module")
def fs_rt(model):
    from fixtures.paths import cache_root
    from inferlets import InferletRuntime

    return InferletRuntime({"tiny": model}, cache_root())


@pytest.fixture
def sandboxes(monkeypatch) -> list[Path]:
    """Every sandbox directory a run makes (PieHost.sandbox_dir, recorded)."""
    made: list[Path] = []
    original = PieHost.sandbox_dir

    def recorded(self: PieHost) -> Path:
        path = original.fget(self)
        if path not in made:
            made.append(path)
        return path

    monkeypatch.setattr(PieHost, "sandbox_dir", property(recorded))
    return made


def _run(rt, wasm, inp: dict, **kw) -> dict:
    return json.loads(asyncio.run(rt.run_async(wasm, [json.dumps(inp)], **kw)))


def test_files_under_scratch_and_no_way_out(fs_rt, fs_wasm, sandboxes) -> None:
    out = _run(fs_rt, fs_wasm, {"tag": "a", "exercise": True})
    assert out["initial"] == []
    assert out["read"] == "hello world"
    assert out["tail"] == [252, 253, 254, 255]
    assert out["patched"] == [8, 9, ord("X"), ord("Y"), 12, 13]
    assert out["rest_ok"] is True
    assert out["stat"] == [16384, True, True]
    assert out["missing"] == ["err", "ENOENT"]
    assert out["listing"] == [["notes.txt", "sub"], ["a.bin"]]
    assert out["walk"] == [["/scratch", ["notes.txt"]], ["/scratch/sub", ["a.bin"]]]
    assert out["renamed"] == [False, "hello world"]
    assert out["removed"] == ["a.bin"]
    assert out["rmdir_full"] == ["err", "ENOTEMPTY"]
    assert out["symlink_in"] == ["ok", None]
    assert out["via_link"] == ["ok", ["a.bin"]]
    assert out["readlink"] == ["ok", "sub"]
    assert out["hardlink"] == ["ok", None] and out["hard_size"] == 16384
    # links out of the sandbox are never made
    assert out["symlink_abs"] == ["err", "EPERM"]
    assert out["symlink_up"] == ["err", "EPERM"]
    # no path reaches the host: outside every preopen (wasi-libc) or refused by the host
    assert out["etc_passwd"][0] == "err" and out["etc_passwd"][1] in ("ENOENT", "ENOTCAPABLE", "EPERM")
    assert out["listdir_root"][0] == "err"
    assert out["dotdot_write"] == ["err", "EPERM"]
    assert out["dotdot_read"] == ["err", "EPERM"]
    assert out["listdir_up"] == ["err", "EPERM"]
    assert out["rmdir_scratch"] == ["err", "EPERM"]
    assert out["final"] == ["mine-a", "sub"]
    assert len(sandboxes) == 1
    assert not sandboxes[0].exists()  # removed with the run
    assert not (sandboxes[0].parent / "x").exists()  # "/scratch/../x" made nothing beside it


def test_moved_link_and_swapped_directory_stay_inside(fs_rt, fs_wasm, sandboxes) -> None:
    out = _run(fs_rt, fs_wasm, {"tag": "m", "moved_link": True})
    assert out["link_deep"] == ["ok", None]  # a/b/up -> ../.. is /scratch itself
    assert out["via_deep"] == ["ok", ["a", "d"]]
    assert out["fd_stat_before"] == ["ok", 1]  # stat-at below a directory descriptor
    assert out["moved_list"] == ["err", "EPERM"]  # moved to /scratch/d it would point out
    assert out["moved_open"] == ["err", "EPERM"]
    assert out["moved_readlink"] == ["err", "EPERM"]
    assert out["stale_fd_stat"] == ["err", "EPERM"]  # its directory is now that link
    assert out["final"] == ["mine-m"]


def test_scratch_size_cap(fs_rt, fs_wasm, sandboxes) -> None:
    n = 256 << 10
    out = _run(fs_rt, fs_wasm, {"tag": "c", "cap": n}, limits=RunLimits(max_scratch_bytes=n))
    assert out["under_cap"] == ["ok", n // 2]
    # descriptor.write and set-size answer insufficient-space; the wasip1 adapter makes any
    # failed stream write EIO (it does not ask filesystem-error-code)
    assert out["over_cap_pwrite"] == ["err", "ENOSPC"]
    assert out["over_cap_truncate"] == ["err", "ENOSPC"]
    assert out["over_cap_stream"][0] == "err" and out["over_cap_stream"][1] in ("ENOSPC", "EIO")
    assert out["after_free"] == ["ok", n - 10]  # removing files frees their bytes
    assert out["final"] == ["mine-c"]
    assert all(not p.exists() for p in sandboxes)


def test_runs_never_see_each_others_files(fs_rt, fs_wasm, sandboxes) -> None:
    async def both():
        return await asyncio.gather(
            *(fs_rt.run_async(fs_wasm, [json.dumps({"tag": t, "wait": 1.5})]) for t in ("p", "q"))
        )

    p, q = (json.loads(x) for x in asyncio.run(both()))
    assert p["initial"] == [] and q["initial"] == []
    assert p["final"] == ["mine-p"]
    assert q["final"] == ["mine-q"]
    later = _run(fs_rt, fs_wasm, {"tag": "r"})
    assert later["initial"] == [] and later["final"] == ["mine-r"]
    assert len(set(sandboxes)) == 3
    assert all(not p.exists() for p in sandboxes)
