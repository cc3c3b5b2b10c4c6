"""Paged attention backends: a torch reference for CPU, room for Triton kernels on CUDA."""

from serve.attention.backend import AttentionBackend, SeqChunk, get_backend
from serve.attention.torch_ref import TorchPagedAttention, paged_attention_reference

__all__ = ["AttentionBackend", "SeqChunk", "TorchPagedAttention", "get_backend", "paged_attention_reference"]
