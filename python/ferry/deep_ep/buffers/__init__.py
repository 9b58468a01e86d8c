"""deep_ep.buffers over Ferry: the legacy Buffer (normal and low-latency modes) and the V2 ElasticBuffer."""

from .elastic import ElasticBuffer, EPHandle
from .legacy import Buffer

__all__ = ["Buffer", "ElasticBuffer", "EPHandle"]
