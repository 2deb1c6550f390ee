"""The two tiers side by side under pytest-xdist (`pytest -n auto`): every `world` test on one worker, in order,
while the other workers take the one-process tests one at a time, as xdist's own `load` deals them.

A gloo world keeps about 1.6 of 2 cores busy, and two at once contend (the whole suite under plain `-n 2` took
1,160 s against 976 s in one process), while the one-process tests run one thread each: beside the worlds they fill
the idle core. xdist groups tests by a scope it reads from the test's id alone, so each worker writes the ids of
the world tests it collected to a file (`write_world_ids`), which the scheduler reads once every worker has
collected, before it deals the first test.
"""

from __future__ import annotations

from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

WORLD = "world"
"""The one scope of every test marked world."""


def write_world_ids(directory: str, worker: str, items) -> None:
    """On a worker: the ids of the world tests it collected, one per line, in `directory`/`worker`."""
    ids = "".join(f"{item.nodeid}\n" for item in items if "world" in item.keywords)
    path = Path(directory) / worker
    path.with_suffix(".tmp").write_text(ids)
    path.with_suffix(".tmp").replace(path)  # whole, or not there


class WorldsOnOneWorker(LoadScopeScheduling):
    """xdist's scope scheduling with the world tests one scope (the largest, so dealt first, to one worker) and
    every other test a scope of its own."""

    def __init__(self, config, log, directory: str) -> None:
        super().__init__(config, log)
        self.directory = Path(directory)
        self.world_ids: set[str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self.world_ids is None:  # every worker has collected (and written its file) before the first call
            self.world_ids = {line for f in self.directory.iterdir() for line in f.read_text().splitlines()}
        return WORLD if nodeid in self.world_ids else nodeid
