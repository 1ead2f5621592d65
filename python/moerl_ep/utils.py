"""EventOverlap and EventHandle with DeepEP's interface (deep_ep/utils.py, v1.2.1).

moerl's calls finish before they return (the cuda engine synchronises its stream at the end of a call
unless Config.async is set, which this binding leaves off), so an event only has to order later work on
the current CUDA stream after what was enqueued before it; on the CPU it has nothing to do.
"""
from typing import Any, Optional, Tuple

import torch


class EventHandle:
    """An event recorded on the current CUDA stream (nothing on a CPU-only process)."""

    def __init__(self) -> None:
        self._event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)


class EventOverlap:
    """DeepEP's EventOverlap: an optional event plus tensors kept alive until it is waited on."""

    __slots__ = ('event', 'extra_tensors')

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
