"""What the tuner and the emulator know about GPUs and models."""

from tuner.catalog.gpus import CPU, GPUS, GpuProfile, cpu_profile, get_gpu
from tuner.catalog.models import BUILTIN_MODELS, ModelProfile, load_model

__all__ = ["BUILTIN_MODELS", "CPU", "GPUS", "GpuProfile", "ModelProfile", "cpu_profile", "get_gpu", "load_model"]
