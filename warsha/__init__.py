"""Warsha: a workbench that adapts LLMs to a new language and ships them ready to serve.

The core package: recipes, the pipeline runner and artifact contract, data, metrics and
tracking. Stage packages (tokenizer_ext, context_ext, distill, quantize) import this; serve
imports nothing from here.
"""

__version__ = "0.1.0"
