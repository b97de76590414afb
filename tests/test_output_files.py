"""fp4gen.outputs: files are written whole (temporary name, fsync, rename) or not at all, never
through a symbolic link, and the files replaced are reported."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import BinaryIO

import pytest

from fp4gen import outputs
from fp4gen.errors import FP4GenError
from fp4gen.outputs import OutputError, OutputFiles


def full_disk_after(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """Make every write through fp4gen.outputs stop with ENOSPC after ``limit`` bytes of it."""

    def write(file: BinaryIO, data: bytes) -> None:
        file.write(data[:limit])
        if len(data) > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outputs, "_write_data", write)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.tmp"))


def test_writes_whole_files_and_reports_what_it_replaced(tmp_path: Path) -> None:
    (tmp_path / "old.txt").write_text("theirs")
    files = OutputFiles(tmp_path / ".")
    files.write_text("old.txt", "ours")
    files.write_text("new.txt", "new")
    files.write_text("old.txt", "ours again")  # written here before: not "replaced" again
    files.write_text("runs/a.json", "{}")  # a subfolder is made
    assert (tmp_path / "old.txt").read_text() == "ours again"
    assert (tmp_path / "runs" / "a.json").read_text() == "{}"
    assert files.replaced == [tmp_path / "old.txt"]
    assert files.replaced_text() == f"replaced 1 existing file(s) in {tmp_path}: old.txt"
    assert leftovers(tmp_path) == []
    assert oct((tmp_path / "new.txt").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_identical_file_is_kept_with_its_mtime(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("same")
    os.utime(path, (1000, 1000))
    files = OutputFiles(tmp_path)
    files.write_text("m.json", "same", keep_same=True)
    assert path.stat().st_mtime == 1000 and files.replaced == []
    again = OutputFiles(tmp_path)
    again.write_text("m.json", "other", keep_same=True)
    assert path.read_text() == "other" and again.replaced == [path]


def test_a_link_at_the_name_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "users-file.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").symlink_to(victim)
    (out / "dangling.json").symlink_to(tmp_path / "nowhere")
    files = OutputFiles(out)
    with pytest.raises(OutputError, match=r"config.json is a symbolic link \(to .*users-file"):
        files.write_text("config.json", "{}")
    with pytest.raises(OutputError, match="dangling.json is a symbolic link"):
        files.write_text("dangling.json", "{}")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "nowhere").exists()
    assert leftovers(out) == []


def test_a_folder_leading_out_through_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "runs").symlink_to(elsewhere)
    with pytest.raises(OutputError, match="leads out of .* through a symbolic link"):
        OutputFiles(out).write_text("runs/a.json", "{}")
    assert list(elsewhere.iterdir()) == []
    with pytest.raises(OutputError, match=r"not empty, '\.' or '\.\.'"):
        OutputFiles(out).write_text("../escape.txt", "x")
    assert not (tmp_path / "escape.txt").exists()


def test_the_output_folder_itself_may_be_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    OutputFiles(tmp_path / "link").write_text("a.txt", "ok")
    assert (real / "a.txt").read_text() == "ok"


def test_a_full_disk_leaves_the_old_file_and_no_partial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "big.bin").write_bytes(b"old")
    full_disk_after(monkeypatch, 100)
    files = OutputFiles(tmp_path)
    with pytest.raises(OutputError) as err:
        files.write_bytes("big.bin", b"x" * 1000)
    message = str(err.value)
    assert "\n" not in message and f"{tmp_path / 'big.bin'}" in message
    assert "No space left on device" in message and "previous file is unchanged" in message
    assert (tmp_path / "big.bin").read_bytes() == b"old"
    with pytest.raises(OutputError, match="nothing was written"):
        files.write_bytes("new.bin", b"x" * 1000)
    assert not (tmp_path / "new.bin").exists()
    assert leftovers(tmp_path) == [] and files.replaced == []


def test_a_transaction_publishes_all_files_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.txt").write_text("old a")
    (tmp_path / "stale.txt").write_text("stale")
    files = OutputFiles(tmp_path)
    full_disk_after(monkeypatch, 10)
    with pytest.raises(OutputError), files.transaction():
        files.write_text("a.txt", "new a")  # short: fits
        files.remove("stale.txt")
        files.write_text("b.txt", "b" * 50)  # the disk fills up here
    assert (tmp_path / "a.txt").read_text() == "old a"
    assert (tmp_path / "stale.txt").read_text() == "stale"
    assert not (tmp_path / "b.txt").exists() and leftovers(tmp_path) == []
    monkeypatch.undo()
    with files.transaction():
        files.write_text("a.txt", "new a")
        files.remove("stale.txt")
        files.write_text("b.txt", "b")
    assert (tmp_path / "a.txt").read_text() == "new a" and (tmp_path / "b.txt").read_text() == "b"
    assert not (tmp_path / "stale.txt").exists()
    assert files.replaced == [tmp_path / "a.txt"]


def test_without_overwrite_existing_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    files = OutputFiles(tmp_path, overwrite=False)
    with pytest.raises(OutputError, match="already holds config.json; pass --overwrite"):
        files.refuse_existing(["model.safetensors", "config.json"])
    with pytest.raises(OutputError, match="already holds config.json"):
        files.write_text("config.json", "{}")
    files.write_text("new.json", "1")
    files.write_text("new.json", "2")  # its own file: no refusal
    assert (tmp_path / "config.json").read_text() == "{}"
    assert (tmp_path / "new.json").read_text() == "2"


def test_write_with_a_library_that_writes_by_name(tmp_path: Path) -> None:
    files = OutputFiles(tmp_path)

    def fails(path: Path) -> None:
        path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError, match="No space left"):
        files.write_with("w.safetensors", fails)
    assert list(tmp_path.iterdir()) == []
    files.write_with("w.safetensors", lambda p: p.write_bytes(b"whole"))
    assert (tmp_path / "w.safetensors").read_bytes() == b"whole"


def test_a_file_in_the_way_of_the_folder(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(FP4GenError, match="is a file, not a folder"):
        OutputFiles(tmp_path / "f" / "sub").write_text("a.txt", "x")
