"""What the tuner and the emulator know about GPUs and models: a lookup with fallbacks, never a gate."""

from tuner.catalog.gpus import CPU, GPUS, GpuProfile, cpu_profile, get_gpu, resolve_gpu
from tuner.catalog.models import BUILTIN_MODELS, ModelProfile, load_model
from tuner.catalog.nvml import DeviceInfo, machine_devices, memory_in_use_gib

__all__ = [
    "BUILTIN_MODELS",
    "CPU",
    "GPUS",
    "DeviceInfo",
    "GpuProfile",
    "ModelProfile",
    "cpu_profile",
    "get_gpu",
    "load_model",
    "machine_devices",
    "memory_in_use_gib",
    "resolve_gpu",
]
