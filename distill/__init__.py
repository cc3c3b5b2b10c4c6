"""distill: build a draft model from the target and distil it for speculative decoding."""
