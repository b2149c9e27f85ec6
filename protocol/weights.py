"""Where a model's weights are: the ``weights`` field of a ``GET /v1/models`` entry.

A worker finds it without downloading anything (worker/weights.py, in the weight loader's order)
and reports it per model id in its heartbeats; a gateway shows, per model, the best any healthy
worker reports. ``state`` stays what the contract says (``available`` until a load); ``weights``
says whether that load can find the weights:

- ``cached``: on the worker's machine (``weights_path``, the local disk cache, the hub client's own
  cache in offline mode, or an installed package): it loads without the network;
- ``cluster_cache``: in the cluster cache; copied to the worker on the first load;
- ``hub``: only on the Hugging Face hub, which answered a short check; downloaded on the first load;
- ``missing``: nowhere the loader looks can serve it now (the hub is off in offline mode, or did
  not answer): a request for it fails with ``MODEL_LOAD_FAILED``;
- ``unknown``: not checked (yet), or the cluster cache could not be read.
"""

from __future__ import annotations

from collections.abc import Iterable

CACHED = "cached"
CLUSTER_CACHE = "cluster_cache"
HUB = "hub"
MISSING = "missing"
UNKNOWN = "unknown"
STATUSES = (CACHED, CLUSTER_CACHE, HUB, MISSING, UNKNOWN)  # best first


def best(statuses: Iterable[str]) -> str:
    """What a cluster can do for a model, from its workers' reports: the best of them (a request
    goes to a worker that can load it); ``unknown`` when none reports it."""
    ranks = [STATUSES.index(s) for s in statuses if s in STATUSES]
    return STATUSES[min(ranks)] if ranks else UNKNOWN
