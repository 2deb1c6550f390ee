"""DCP's async save in one process, without torch's "assuming the intent is to save in a single process" warning.

`dcp.async_save` runs `dcp.save` on a thread of its own, and `dcp.save` warns whenever no process group is up, even
when told `no_dist`. A warnings filter cannot be scoped to that thread (Python 3.11's filters are the process's),
so shardlab stages the tensors as `async_save` does and writes them on its own thread through the function
`dcp.save` calls after its warning (a private one of torch's: kept here, alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict


def async_save(tensors: Mapping[str, torch.Tensor], path: Path) -> Future[Metadata]:
    """Copy `tensors` to host memory now (training may change them next), write them to `path` on a thread."""
    stager = DefaultStager(StagingOptions(False, False, False, False))  # as async_save's own: copies, synchronously
    try:
        staged = stager.stage(dict(tensors))
    finally:
        stager.close()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardlab-save")
    future = pool.submit(_save_state_dict, state_dict=staged, storage_writer=FileSystemWriter(path), no_dist=True)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future
