"""What the tuner and the emulator know about GPUs and models."""

from tuner.catalog.gpus import GPUS, GpuProfile, get_gpu
from tuner.catalog.models import BUILTIN_MODELS, ModelProfile, load_model

__all__ = ["BUILTIN_MODELS", "GPUS", "GpuProfile", "ModelProfile", "get_gpu", "load_model"]
