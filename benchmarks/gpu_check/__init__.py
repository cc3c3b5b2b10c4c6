"""`python -m benchmarks.gpu_check` (`make gpu-check`): the GPU half of Warsha in one command.

Parts, each a module run in its own subprocess with its own time limit (a CUDA fault or a hang
in one cannot take the others down), each writing one JSON result that `__main__` gathers into
`report.json` and `report.md`:

- `kernels`: serve's Triton kernel tests (`tests/serve/test_triton_*`), compiled for the GPU,
  default and slow cases; on CPU under Triton's interpreter, default cases.
- `engine`: the engine against transformers `generate`, greedy, per family and dtype, with
  prefix caching, chunked prefill, preemption and a same-family draft on; GPTQ int4 checkpoints
  through `Int4TritonLinear` against their dequantized twins.
- `speed`: the TinyLlama-1.1B shape in bf16, batch-1 decode beside the HBM roofline and a
  64-request mixed workload against transformers (CUDA only).
- `train`: training steps on the device against the same steps on the CPU in float32.
- `validate`: serve.validate's plain-vs-draft measurement on the device.

Everything runs offline from seeded random models; nothing is downloaded.
"""
