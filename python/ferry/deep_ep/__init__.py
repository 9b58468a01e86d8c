"""DeepEP's API over Ferry: the legacy `deep_ep.Buffer` (normal and low-latency modes) and the V2
`deep_ep.ElasticBuffer`, with the same argument names, shapes, dtypes and return tuples.

An engine switches without changing its code: with FERRY_DEEP_EP=1 in its environment (ferry pip-installed), or
after ferry.deep_ep.install(), `import deep_ep` and `import deep_ep.<submodule>` give this package and its
submodules (buffers.legacy, buffers.elastic, buffer, utils, utils.event, utils.envs). Or import it by its name:

    import ferry.deep_ep as deep_ep

docs/deep_ep.md lists both APIs argument by argument: supported, mapped (how), or refused (why). Needs torch; the cuda
backend is used when ferry.cuda_available(), else the cpu backend with torch CPU tensors.
"""

from __future__ import annotations

from .buffers.elastic import ElasticBuffer, EPHandle
from .buffers.legacy import Buffer, Config, topk_idx_t
from .utils.envs import get_logical_domain_size, get_physical_domain_size
from .utils.event import EventHandle, EventOverlap

# the DeepEP API version this layer follows (DeepEP's deep_ep.__version__); Ferry's own is ferry.__version__
__version__ = "2.1.0"

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "get_logical_domain_size",
           "get_physical_domain_size", "install", "installed", "topk_idx_t", "uninstall"]


def install() -> None:
    """Makes `import deep_ep` (and its submodules) resolve to this package in this process, for an engine imported
    after this call. RuntimeError when another deep_ep is already imported. FERRY_DEEP_EP=1 does the same at
    interpreter start where ferry is pip-installed (its ferry-deep-ep.pth)."""
    import _ferry_deep_ep

    _ferry_deep_ep.install()


def uninstall() -> None:
    """Undoes install() for later imports."""
    import _ferry_deep_ep

    _ferry_deep_ep.uninstall()


def installed() -> bool:
    """Whether `import deep_ep` resolves to this package in this process."""
    import _ferry_deep_ep

    return _ferry_deep_ep.installed()
