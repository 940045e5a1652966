"""Each attempt's working directory (its cwd and HOME), named after the attempt, kept for the next
attempt when it is left empty.

Making a directory and removing it again for every attempt costs the filesystem a new inode each
time. On ext4, allocating one scans past every inode deleted in the last few seconds (they are not
reused at once), so at hundreds of attempts a second `mkdir` alone took a quarter of a busy agent's
CPU (issue 17; `perf`: `recently_deleted`, `find_inode_bit` under `ext4_mkdir`). An empty directory
is renamed instead — to a spare name when its attempt ends, to the next attempt's name when that one
starts — which allocates and frees nothing. A directory the attempt left anything in is removed
whole, in a worker thread (a removal waits on the filesystem's journal: on the loop it held up
every other attempt of the node).

A spare is empty when it is put aside and named so that no attempt's name can be it. The process
backend isolates nothing on disk (its processes run as the agent's user, as every other task's do),
so a kept directory exposes nothing a new one would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

SPARE_PREFIX = ".spare-"  # no attempt's directory starts with a dot (`<task id>-<token>`)
KEEP = 256  # spare directories kept at most (more than a node runs at once)


class WorkDirs:
    def __init__(self, root: Path, keep: int = KEEP) -> None:
        self.root = root
        self.keep = keep
        self._spare: list[Path] = []
        self._named = 0  # spares named so far (each spare's name is new)
        self._swept = False

    def make(self, name: str) -> Path:
        """The directory `name` under the root, made (or a spare renamed to it) and empty."""
        if not self._swept:
            self._sweep()
        path = self.root / name
        while self._spare:
            spare = self._spare.pop()
            try:
                os.rename(spare, path)
                return path
            except OSError as e:  # removed behind our back (or `path` is there): make one below
                log.debug("spare working directory %s not reused: %s", spare, e)
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def release(self, path: Path) -> None:
        """The attempt is over: keep its directory as a spare if it is empty, else remove it."""
        try:
            with os.scandir(path) as entries:
                empty = next(entries, None) is None
        except OSError:
            return  # never made (a container attempt), or already gone
        if empty and len(self._spare) < self.keep:
            spare = self.root / f"{SPARE_PREFIX}{self._named}"
            self._named += 1
            try:
                os.rename(path, spare)
                self._spare.append(spare)
                return
            except OSError as e:
                log.debug("working directory %s not kept: %s", path, e)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, path)

    def _sweep(self) -> None:
        """Spares left by an earlier agent process on this state directory are removed (a name this
        process gives may be one of theirs); once, before the first attempt's directory is made."""
        self._swept = True
        with contextlib.suppress(OSError), os.scandir(self.root) as entries:
            for e in entries:
                if e.name.startswith(SPARE_PREFIX):
                    shutil.rmtree(e.path, ignore_errors=True)
