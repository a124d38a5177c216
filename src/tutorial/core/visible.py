"""Every GPU vendor's way to hide all GPUs from a process, and torch's device types of a GPU, without importing torch
(check-ddp and the rehearsal launches hide them before deciding anything else; core.accelerator picks one vendor's
entries; config and the engines' options check a device type against the list).

CUDA hides every GPU for an empty CUDA_VISIBLE_DEVICES. ROCm hides them for an empty ROCR_VISIBLE_DEVICES; an empty
HIP_VISIBLE_DEVICES hides nothing (ROCm/hip#3001), and torch's own count (amdsmi) reads an empty ROCR list as one
device, so HIP's list is made invalid as well. Level Zero reads an empty ZE_AFFINITY_MASK as no mask at all, so SYCL
is told to use no Level Zero device. AMD's and Intel's entries come from the runtimes' documentation and issues, not
from a run on such a GPU here.
"""
# torch's device types of a GPU: "cuda" on NVIDIA and AMD (ROCm answers as CUDA), "xpu" on Intel
GPU_DEVICE_TYPES = ("cuda", "xpu")
HIDDEN = {"CUDA_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "-1",
          "ONEAPI_DEVICE_SELECTOR": "opencl:cpu"}
