"""tuner: find the vLLM launch flags that give the most throughput within your latency and success SLOs."""

from tuner.errors import CatalogError, ConfigError, LaunchError, StorageError, TunerError
from tuner.flags import VllmFlags

__version__ = "0.1.0"

__all__ = ["CatalogError", "ConfigError", "LaunchError", "StorageError", "TunerError", "VllmFlags", "__version__"]
