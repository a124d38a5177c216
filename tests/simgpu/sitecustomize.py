"""Starts the GPU simulation in every Python process of a lane that puts this folder on PYTHONPATH and sets
TUTORIAL_SIMGPU (the kernel, the engines, torchrun's workers, `!python` launches, restarted engines: they all inherit
the environment). torch is patched right after something imports it, so processes that never import torch (the
ipcontroller, pip) pay nothing."""
import os

if os.environ.get("TUTORIAL_SIMGPU"):
    import simgpu

    simgpu.install_when_torch_is_imported()
