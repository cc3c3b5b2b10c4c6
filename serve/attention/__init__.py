"""Paged attention backends: a torch reference for CPU, room for Triton kernels on CUDA."""

from serve.attention.backend import get_backend
from serve.attention.interface import AttentionBackend, SeqChunk
from serve.attention.torch_ref import TorchPagedAttention, paged_attention_reference

__all__ = ["AttentionBackend", "SeqChunk", "TorchPagedAttention", "get_backend", "paged_attention_reference"]
