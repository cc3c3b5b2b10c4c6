"""Vocabulary extension for a new language: extend the tokenizer, initialise, adapt.

Stages (see ``tokenizer_ext.stages``): ``extend`` learns target-language BPE pieces and
appends them to a SentencePiece or byte-level BPE base; ``embed`` resizes and initialises the
embeddings; ``adapt`` fine-tunes (QLoRA, or full/embeddings under DeepSpeed ZeRO) and compares
against the base model adapted with the same budget.
"""
