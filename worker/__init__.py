"""Model execution: catalog, adapters, batching, pre/post-processing; front doors serve (HTTP) and ipc."""

from pathlib import Path

CATALOG_DIR = Path(__file__).resolve().parent / "catalog"
DEFAULT_MODELS_DIR = CATALOG_DIR / "models"
DEFAULT_BUNDLES_DIR = CATALOG_DIR / "bundles"

# GOMP_SPINCOUNT of the worker process in a pod (``sie up``, the chart, compose; an operator's own value
# wins). When a forward ends, libgomp's OpenMP threads spin, by default about 300,000 iterations,
# before they sleep: they hold a core just when the sidecar answers the batch and hands over the next
# (and, under ``sie up``, the gateway and NATS pass the answers on). 10,000 still spins through the
# short waits inside a forward. ``sie serve`` keeps libgomp's default (one run on 2 cores: the same
# 1 x 16 rate with less CPU at 10,000, but one client's single-item requests about 10% slower).
POD_OMP_SPINCOUNT = "10000"
