"""Where the CPU kernel library is built: the cache folder's location, a folder that cannot be
written, and the removal of stale builds (engine.kernels.cpu.build)."""
from __future__ import annotations

import ctypes
import logging
import os
import time

from engine.kernels.cpu import build


def test_cache_folder_follows_tokenmill_cache_dir_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "tm"))
    assert build.cache_dir() == tmp_path / "tm" / "kernels"
    monkeypatch.delenv("TOKENMILL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == tmp_path / "xdg" / "tokenmill" / "kernels"
    # the switch that turns the derived-data caches off leaves the kernels' folder where it is
    monkeypatch.setenv("TOKENMILL_NO_DISK_CACHE", "1")
    assert build.cache_dir() == tmp_path / "xdg" / "tokenmill" / "kernels"


def test_unwritable_cache_folder_builds_into_a_private_folder(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        out = build._build("generic")
    assert out.is_file()
    assert not str(out).startswith(str(blocker))
    assert out.parent == build._private_dir()
    assert any(str(blocker / "cache" / "kernels") in r.getMessage() for r in caplog.records)
    lib = ctypes.CDLL(str(out))
    assert lib.tm_isa() == 0  # the plain-C build, loadable from there


def test_a_new_build_removes_the_variants_stale_libraries(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "kernels"
    folder.mkdir()
    old = time.time() - build.STALE_S - 3600
    stale, recent, other = (folder / n for n in ("tm_cpu_generic_0000000000000000.so",
                                                  "tm_cpu_generic_1111111111111111.so",
                                                  "tm_cpu_native_2222222222222222.so"))
    for f in (stale, recent, other):
        f.write_bytes(b"x")
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    out = build._build("generic")
    assert out.parent == folder and out.is_file()
    assert not stale.exists()
    assert recent.exists() and other.exists()  # younger than 30 days; another variant's
    assert build._build("generic") == out  # found, not built again
