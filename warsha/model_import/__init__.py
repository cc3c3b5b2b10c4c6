"""Core stage ``import``: bring a real pretrained model into the workbench as an HF directory.

``source`` resolves a GGUF file (a path, or an installed package that ships one in chunks) or
an HF directory, checked before any work (``source.py``, ``gguf_header.py``); ``convert.py``
loads it through transformers, rebuilds a plain model from its config and state dict (a
GGUF-loaded model refuses ``save_pretrained``) and writes the artifact; ``stage.py`` registers
the stage and its parameters.
"""
