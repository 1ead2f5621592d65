"""moerl_ep: moerl's expert-parallel library with DeepEP's Python API (docs/python.md).

    import moerl_ep
    buffer = moerl_ep.Buffer(group, num_nvl_bytes=...)   # instead of deep_ep.Buffer
"""
import torch  # noqa: F401  (loads torch's libraries, which _C links, before _C)

from . import _C
from .buffer import Buffer, DispatchHandle, Error, LowLatencyHandle, TimeoutError  # noqa: A004
from .config import Config
from .utils import EventHandle, EventOverlap

__all__ = ['Buffer', 'Config', 'DispatchHandle', 'Error', 'EventHandle', 'EventOverlap', 'LowLatencyHandle',
           'TimeoutError']
