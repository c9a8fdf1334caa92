"""kernel.files: JSON is written atomically, and every file the product replaces goes through
the one writer."""

import json
import os
import stat
from pathlib import Path

import pytest

from kernel.files import write_json


def test_written_json_is_whole_and_has_the_permissions_of_a_plain_file(tmp_path):
    path = tmp_path / "sub" / "table.json"
    write_json(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert stat.S_IMODE(path.stat().st_mode) & 0o044 == 0o044  # readable by group and others
    with pytest.raises(TypeError):
        write_json(path, {"a": object()})  # not serialisable: the old file stays, no stray temp file
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["table.json"]


def test_a_written_file_reaches_the_disk_before_it_replaces_the_old_one_and_the_folder_after(
    tmp_path, monkeypatch
):
    """A power cut leaves the old file or the whole new one: the temporary file is synced,
    then it replaces the old one, then the folder that records the replacement is synced."""
    real_fsync, real_replace, done = os.fsync, os.replace, []

    def fsync(fd: int) -> None:
        done.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        done.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "best.json"
    write_json(path, {"a": 1})
    (synced, file), replaced, folder = done
    assert synced == "fsync" and file.startswith(f"{tmp_path}/.best.json.")
    assert replaced == ("replace", str(path)) and folder == ("fsync", str(tmp_path))


def test_every_file_the_product_replaces_goes_through_the_one_writer():
    """``os.replace`` appears in ``kernel.files.replacing`` alone: no writer of its own
    forgets the fsync."""
    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("kernel", "tuner", "reports", "refs") for p in (root / d).rglob("*.py")]
    users = {p.relative_to(root).as_posix() for p in sources if "os.replace(" in p.read_text()}
    assert users == {"kernel/files.py"}
