"""AWQ, GPTQ and round-to-nearest weight quantization, layer by layer, on CPU or GPU.

Modules: ``arch`` (architectures as data), ``quantizer`` (group-wise integer grid), ``rtn``,
``gptq``, ``awq`` (the algorithms), ``layerwise`` (the one-decoder-layer-at-a-time driver),
``calib`` (calibration packing), ``pack``/``export`` (GPTQ and AWQ-GEMM checkpoints, see
FORMAT.md), ``dequant`` (the torch reference that turns either format back into a plain HF
model) and ``stages`` (the pipeline stages ``quantize.awq``, ``quantize.gptq``, ``quantize.rtn``).
"""
