"""The EP library's bootstrap store over a torch.distributed group's c10d store."""
from datetime import timedelta

import torch.distributed as dist


def _group_store(group: dist.ProcessGroup) -> dist.Store:
    c10d = dist.distributed_c10d
    # The default group's store serves every group: keys are namespaced by the buffer's job id.
    get = getattr(c10d, '_get_default_store', None)
    if get is not None:
        return get()
    return c10d._world.pg_map[c10d._get_default_group()][1]


class GroupStore:
    """set(key, bytes) / get(key, timeout_ms) -> bytes, as moerl_ep._C.Engine asks of its store."""

    def __init__(self, group: dist.ProcessGroup, prefix: str) -> None:
        self._store = dist.PrefixStore(prefix, _group_store(group))

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout_ms: int) -> bytes:
        self._store.wait([key], timedelta(milliseconds=timeout_ms))
        return self._store.get(key)
