"""deep_ep.buffer, where DeepEP before V2 kept its Buffer (`from deep_ep.buffer import Buffer`)."""

from .buffers.legacy import Buffer, Config

__all__ = ["Buffer", "Config"]
