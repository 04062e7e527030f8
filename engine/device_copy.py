"""Host data onto the engine's device without waiting for the device.

On a GPU, ``host_tensor.to("cuda")`` (and ``torch.tensor(data, device="cuda")``) is a blocking copy:
PyTorch synchronizes the stream after it, so the host waits for every kernel queued before it; from
pageable memory even ``non_blocking=True`` may wait. Inside a step that wait is the forward pass
itself: the host cannot launch the sampling kernels, or prepare the next step, until the device
has caught up. A step's integers therefore cross in its one packed upload
(``engine.persistent_batch.upload_step``); anything else a step moves goes through ``to_device``,
a copy from pinned memory that the device runs in stream order while the host goes on. PyTorch's
caching host allocator keeps the pinned block until that copy has run.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, queued without a sync; itself on a CPU engine."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def ints_on(values, device: torch.device) -> torch.Tensor:
    """int64 ``values`` (a list, an ``array('q')``) on ``device`` (``to_device``)."""
    return to_device(torch.as_tensor(values, dtype=torch.int64), device)
