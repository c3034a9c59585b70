"""Test-only shim: run megatron-core 0.11 on CPU by mapping its hard-coded CUDA device requests to CPU.

megatron-core assumes a GPU in a few places that the CPU tests reach:
  * `torch.cuda.current_device()` as a device argument (global memory buffer, DDP param/grad buffers,
    the distributed optimizer, ChainedOptimizer's loss scale);
  * literal `device="cuda"` / `.cuda()` (pipeline schedules' token counter, grad-norm buffers, the
    local multi-tensor-apply's overflow flag, RotaryEmbedding moving inv_freq to the GPU);
  * the CUDA RNG tracker (`torch.cuda.get_rng_state` / `set_rng_state` / `manual_seed`);
  * `torch.cuda.synchronize`, streams and events around communication;
  * type strings: the optimizers and grad clipping accept only `param.type() == 'torch.cuda.FloatTensor'`
    (and the cuda Half/BFloat16 names), so `Tensor.type()` answers with the cuda name of its dtype.

`install()` maps all of these to CPU inside the calling process: a TorchFunctionMode rewrites every cuda
device argument of factory functions and `Tensor.to`/`Tensor.cuda` to cpu, and the `torch.cuda` helpers
that megatron calls become CPU equivalents. It is never imported by product code
(actors/engines/megatron.py runs on the device it is given and never names cuda itself).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed = False


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch's convention: a bare int is a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites cuda device arguments to cpu in every torch function and tensor method call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda(...) / Module-free tensor moves
            return args[0]
        if name == "to" and args:
            new_args = list(args)
            for i in range(1, len(new_args)):
                if _is_cuda(new_args[i]):
                    new_args[i] = _CPU
            args = tuple(new_args)
        if name in ("pin_memory",):
            return args[0]
        result = func(*args, **kwargs)
        if name == "type" and len(args) == 1 and not kwargs and isinstance(result, str) \
                and result.startswith("torch.") and not result.startswith("torch.cuda."):
            # megatron checks `param.type() == 'torch.cuda.FloatTensor'` (optimizers, grad clipping)
            return "torch.cuda." + result[len("torch."):]
        return result


def _patch_cuda_module() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0  # an int ordinal: the mode maps it to cpu wherever it is used
    cuda.device_count = lambda: 1
    cuda.synchronize = lambda *a, **k: None
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: None
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.Stream = _NullStream  # type: ignore[assignment]
    cuda.Event = _NullEvent  # type: ignore[assignment]
    cuda.stream = lambda s=None: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.FloatTensor = lambda *a, **k: torch.tensor(*a, dtype=torch.float32, **k)  # type: ignore[assignment]
    cuda.IntTensor = lambda *a, **k: torch.tensor(*a, dtype=torch.int32, **k)  # type: ignore[assignment]
    cuda.LongTensor = lambda *a, **k: torch.tensor(*a, dtype=torch.int64, **k)  # type: ignore[assignment]
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0


class _NullStream:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, *a: Any) -> None:
        pass

    def wait_event(self, *a: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a: Any) -> _NullEvent:
        return _NullEvent()

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _NullEvent:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def record(self, *a: Any) -> None:
        pass

    def wait(self, *a: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _patch_moe_host_copies() -> None:
    """megatron-core 0.16's alltoall dispatcher hands the all-to-all its split sizes through
    `moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)`, which makes a numpy array only of a CUDA tensor; on
    the CPU the sizes stayed a tensor, which `all_to_all_single` refuses. Here a CPU tensor becomes the numpy
    array a GPU run gets. (0.11 converts the sizes itself and has no such function.)"""
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return
    original = getattr(moe_utils, "maybe_move_tensor_to_cpu", None)
    if original is None:
        return

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.cpu().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = to_host


def install() -> None:
    """Map megatron's CUDA requests to CPU for the rest of this process (idempotent), in this thread and
    in every thread started after (torch function modes are per thread; an actor runs engine calls in
    worker threads).

    Call it only in a process that runs megatron on CPU (the tests spawn one per rank)."""
    global _installed
    if _installed:
        return
    _patch_cuda_module()
    _patch_moe_host_copies()
    _CudaToCpu().__enter__()  # stays active for the whole (test child) process
    run = threading.Thread.run

    def run_on_cpu(self: threading.Thread) -> None:
        _CudaToCpu().__enter__()
        run(self)

    threading.Thread.run = run_on_cpu  # type: ignore[method-assign]
    _installed = True


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Context-manager form for a single test process; the torch.cuda patches stay (harmless on CPU)."""
    install()
    yield
