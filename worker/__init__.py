"""Model execution: catalog, adapters, batching, pre/post-processing; front doors serve (HTTP) and ipc."""

from pathlib import Path

CATALOG_DIR = Path(__file__).resolve().parent / "catalog"
DEFAULT_MODELS_DIR = CATALOG_DIR / "models"
DEFAULT_BUNDLES_DIR = CATALOG_DIR / "bundles"
