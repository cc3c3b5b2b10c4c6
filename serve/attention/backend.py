"""The attention backend's selection by device (the interface is in `interface.py`).

The model calls `backend.build_metadata` once per forward (all index arithmetic, shared by
every layer) and `backend.forward` once per layer. The CUDA backend (Triton kernels,
`triton_backend.py`) implements the same methods; `get_backend` picks by device so the model
never branches on it.
"""

from __future__ import annotations

import os
import warnings

import torch

from serve import args
from serve.args import ATTENTION_BACKENDS as BACKENDS
from serve.attention.interface import AttentionBackend


def get_backend(device: torch.device | str, prefer: str | None = None, **options: int) -> AttentionBackend:
    """The attention backend for `device`: Triton kernels on CUDA, the torch reference on CPU.

    `prefer="torch"` or `prefer="triton"` overrides the choice. Triton on CPU only runs under
    Triton's interpreter (TRITON_INTERPRET=1, tests); it raises a ValueError otherwise. The
    Triton module is imported here, lazily, so CPU serving never imports triton. On CUDA without
    triton installed the automatic choice falls back to torch with a warning. `options`
    (partition_size, block_m) go to the Triton backend.
    """
    from serve.attention.torch_ref import TorchPagedAttention

    kind = torch.device(device).type
    if kind not in args.DEVICES:
        raise ValueError(f"device {kind!r} is not supported by serve; supported: {', '.join(args.DEVICES)}")
    if prefer not in (None, *BACKENDS):
        raise ValueError(f"prefer={prefer!r} is not a backend; use one of {BACKENDS} or None (by device)")
    choice = prefer or ("triton" if kind == "cuda" else "torch")
    if choice == "torch":
        if options:
            raise ValueError(f"options {sorted(options)} only apply to the triton backend, not torch")
        return TorchPagedAttention(device=device)
    if kind == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":  # before triton is imported
        raise ValueError("prefer='triton' on cpu needs TRITON_INTERPRET=1 set before triton is imported (tests only)")
    try:
        from serve.attention.triton_backend import TritonPagedAttention
    except ImportError as err:
        if prefer == "triton":
            raise ValueError(
                f"prefer='triton' but triton cannot be imported ({err}); install triton or use prefer='torch'"
            ) from err
        warnings.warn(
            f"triton cannot be imported ({err}); serving attention on {kind} with the torch backend", stacklevel=2
        )
        return TorchPagedAttention(device=device)
    return TritonPagedAttention(device, **options)
