"""Where the worker's models run: the device, the forwards a model runs at once, process tuning."""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass

from worker.batching.forward_threads import thread_plan
from worker.settings import WorkerSettings


@dataclass(frozen=True)
class Placement:
    device: str  # cpu | cuda | cuda:N
    forward_threads: int = 1  # forwards of one model that run at once (worker/batching/forward_threads.py)
    intra_op_threads: int = 1  # torch's intra-op threads each of them runs on

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def clear_cache(self) -> None:
        """Collect garbage and, on CUDA, hand cached blocks back to the device (after an unload, on OOM)."""
        gc.collect()
        if self.on_cuda:
            import torch

            torch.cuda.empty_cache()


def pick_device(setting: str) -> str:
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def tune_process_for_cuda() -> None:
    """Process-wide CUDA choices for serving: no attention backend that compiles per shape.

    PyTorch's SDPA picks cuDNN attention for half precision, and cuDNN builds a plan for every new
    (batch, width) shape: tens to hundreds of milliseconds on the hot path of mixed traffic.
    """
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


def place_process(settings: WorkerSettings) -> Placement:
    """Pick the device and set the process up for it: torch's intra-op threads shared among a model's
    forward threads, CUDA's attention backend, Python's thread switch interval."""
    import torch

    device = pick_device(settings.device)
    on_cuda = device.startswith("cuda")
    threads = settings.torch_threads or torch.get_num_threads()
    forward_threads, intra_op = thread_plan(on_cuda, settings.forward_threads, threads)
    torch.set_num_threads(intra_op)
    if on_cuda:
        tune_process_for_cuda()
    switch_ms = settings.gil_switch_interval_ms or (0.5 if on_cuda else 0.0)
    if switch_ms:
        # the inference thread launches kernels one Python call at a time; each time it gives
        # up the GIL, a busy tokenising thread keeps it for up to this interval
        sys.setswitchinterval(switch_ms / 1000.0)
    return Placement(device, forward_threads, intra_op)
