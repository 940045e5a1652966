"""An attempt's working directory: made for it, kept for the next attempt when left empty (a rename,
no new inode), removed whole when anything is left in it; spares of an earlier agent process swept."""

from __future__ import annotations

import os
from pathlib import Path

from podium.agent.workdirs import SPARE_PREFIX, WorkDirs


def names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


async def test_an_empty_directory_is_kept_and_given_to_the_next_attempt(tmp_path: Path) -> None:
    w = WorkDirs(tmp_path / "tasks")
    first = w.make("t1-1")
    assert first == tmp_path / "tasks" / "t1-1" and first.is_dir() and not any(first.iterdir())
    inode = first.stat().st_ino
    await w.release(first)
    assert not first.exists()
    assert [n.startswith(SPARE_PREFIX) for n in names(w.root)] == [True]
    second = w.make("t2-5")
    assert second.name == "t2-5" and second.stat().st_ino == inode  # the same directory, renamed
    assert names(w.root) == {"t2-5"}


async def test_a_directory_with_anything_left_in_it_is_removed_never_kept(tmp_path: Path) -> None:
    w = WorkDirs(tmp_path / "tasks")
    d = w.make("t1-1")
    (d / "sub").mkdir()
    (d / "sub" / "out.txt").write_text("left behind")
    await w.release(d)
    assert names(w.root) == set()
    fresh = w.make("t2-2")
    assert not any(fresh.iterdir())


async def test_spares_are_bounded_and_a_missing_directory_is_no_error(tmp_path: Path) -> None:
    w = WorkDirs(tmp_path / "tasks", keep=2)
    dirs = [w.make(f"t{i}-1") for i in range(4)]
    for d in dirs:
        await w.release(d)
    assert len(names(w.root)) == 2  # two kept, two removed
    await w.release(w.root / "never-made")  # a container attempt's: nothing to do
    # a spare removed behind the agent's back: the next attempt still gets a directory
    for n in names(w.root):
        os.rmdir(w.root / n)
    assert w.make("t9-9").is_dir()


async def test_an_earlier_agent_processs_spares_are_swept_before_the_first_attempt(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    (root / f"{SPARE_PREFIX}0").mkdir(parents=True)
    (root / f"{SPARE_PREFIX}7").mkdir()
    (root / f"{SPARE_PREFIX}7" / "stray").write_text("x")
    w = WorkDirs(root)
    d = w.make("t1-1")
    assert names(root) == {"t1-1"} and not any(d.iterdir())
    await w.release(d)
    assert len(names(root)) == 1 and w.make("t2-1").is_dir()
