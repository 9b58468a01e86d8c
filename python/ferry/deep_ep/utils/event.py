"""DeepEP's EventHandle and EventOverlap (deep_ep.utils.event) over torch's events.

Ferry enqueues every call on the caller's current stream (DeepEP: on a communication stream of its own), so the work
an event stands for is already ordered before whatever the current stream runs next: waiting on it is correct and
costs one event wait. On the cpu backend every call has completed when it returns; an EventHandle there records
nothing and waiting on it does nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

import ferry


class EventHandle:
    """A point on torch's current stream (DeepEP's C++ EventHandle): a CUDA event recorded there when CUDA is in use;
    on the cpu backend already complete."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """The current stream waits for this point (no host synchronisation)."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)


def wait_event(previous_event) -> None:
    """Waits for a previous_event argument as DeepEP hands it to its kernels: an EventOverlap's event (None: nothing to
    wait for), an EventHandle, or None."""
    event = getattr(previous_event, "event", previous_event)
    if event is None:
        return
    if not isinstance(event, EventHandle):
        raise ferry.InputError(f"ferry.deep_ep: previous_event must be an EventOverlap, an EventHandle (capture()) or "
                               f"None, got {type(previous_event).__name__}")
    event.current_stream_wait()


class EventOverlap:
    """DeepEP's EventOverlap: an optional EventHandle, the tensors to keep alive until it completes, and a hook run
    after the first wait (register_hook_after_wait). `event` is None unless the call had async_finish=True (legacy
    Buffer) or async_with_compute_stream=True (ElasticBuffer), as in DeepEP.

        event.current_stream_wait()           # the current stream waits
        with event: ...                        # ... and so does the end of the block (when there is an event)
        with event(release_handle=True): ...   # and drops the event after the wait
    """

    # the defaults are the class's: an EmptyEventOverlap (below) is made without running __init__
    event: Optional[EventHandle] = None
    extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None
    _release_handle_by_call = False
    hook_after_wait: Optional[Callable] = None

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is None:
            raise ferry.InputError("ferry.deep_ep: EventOverlap.current_stream_wait() on an empty event; a call "
                                   "returns an event only when asked to finish asynchronously (async_finish=True, "
                                   "or async_with_compute_stream=True on an ElasticBuffer), as in DeepEP")
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        if self.hook_after_wait is not None:
            raise ferry.InputError("ferry.deep_ep: a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class EmptyEventOverlap(EventOverlap):
    """The EventOverlap without an event that a call without async_finish (async_with_compute_stream) returns: a fresh
    object per call, as DeepEP's (a hook registered on one stays with it), made without a Python __init__ (its fields
    are EventOverlap's defaults). NOTE: the layer returns one per call, and a Python __init__ per call was a
    measurable part of its own host time (docs/python.md, "The DeepEP-compatible layer")."""

    __init__ = object.__init__
