"""deep_ep.utils over Ferry: EventHandle and EventOverlap (event), the domain sizes and process helpers (envs)."""

from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
