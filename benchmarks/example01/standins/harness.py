"""What the wrapper does around the example: its CUDA calls run on the CPU (there is no GPU
here), every process starts from the same seed (so that runs compare bitwise), every step is
recorded, and rank 1 of the first workers SIGKILLs itself after a step.

Reads EXAMPLE01_OUT (a directory: <pid>.steps lines "monotonic_ns step world rank pid",
``killed`` "monotonic_ns step", ``weights.<pid>`` each worker's parameters' SHA-256 at the end) and
EXAMPLE01_KILL_AT (the step after which rank 1 dies; unset: none). The kill waits for the file
OUT/arm (a benchmark arms it once what it measures is in place)."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

OUT = os.environ.get("EXAMPLE01_OUT", "")
KILL_AT = int(os.environ.get("EXAMPLE01_KILL_AT", "0") or 0)
_steps = 0
_optimizer: Any = None


def _cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


def run_cuda_on_cpu() -> None:
    """The example's CUDA calls, on a machine without a GPU: a device of one, the CPU."""
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: 0
    torch.nn.Module.cuda = _cpu
    torch.Tensor.cuda = _cpu
    ddp_init = DistributedDataParallel.__init__

    def cpu_ddp(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("device_ids", None)  # a CPU module takes none
        kwargs.pop("output_device", None)
        ddp_init(self, module, *args, **kwargs)

    DistributedDataParallel.__init__ = cpu_ddp


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _steps, _optimizer
    _steps += 1
    _optimizer = optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    now = time.monotonic_ns()
    with open(os.path.join(OUT, f"{os.getpid()}.steps"), "a") as f:
        f.write(f"{now} {_steps} {world} {rank} {os.getpid()}\n")


def _before_forward(module: Any, args: Any) -> None:
    """Rank 1 of the first workers dies as its step KILL_AT + 1 begins."""
    spare = os.environ.get("ELASTICRUN_HOT_SPARE") == "1"
    first = os.environ.get("ELASTICRUN_REPLACEMENT", "0") == "0" and not spare
    if _steps != KILL_AT or not first or not dist.is_initialized() or dist.get_rank() != 1:
        return
    while not os.path.exists(os.path.join(OUT, "arm")):
        time.sleep(0.01)
    with open(os.path.join(OUT, "killed"), "w") as f:
        f.write(f"{time.monotonic_ns()} {_steps}")
    os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    run_cuda_on_cpu()
    torch.manual_seed(0)
    if OUT:
        register_optimizer_step_post_hook(_after_step)
    if OUT and KILL_AT:
        torch.nn.modules.module.register_module_forward_pre_hook(_before_forward)


def finish() -> None:
    """Each worker that trained writes its parameters' digest to OUT/weights.<pid> (DDP keeps
    them equal: a benchmark compares them with each other and with a fault-free run's)."""
    if OUT and _optimizer is not None:
        digest = hashlib.sha256()
        for group in _optimizer.param_groups:
            for p in group["params"]:
                digest.update(p.detach().numpy().tobytes())
        with open(os.path.join(OUT, f"weights.{os.getpid()}"), "w") as f:
            f.write(digest.hexdigest())
