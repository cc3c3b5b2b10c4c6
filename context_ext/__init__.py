"""context_ext: longer context for RoPE models, proven at the long and at the short end.

- ``rope``: inverse frequencies and attention scaling of PI, static/dynamic NTK and YaRN,
  as pure functions checked against transformers' reference;
- ``scaling``: writes the scaling into config.json so that transformers and vLLM derive the
  same frequencies and the same length (original * factor, exactly once), and refuses to scale
  a scaled model twice unless asked to compose;
- ``passkey``, ``longdata``, ``suite``, ``report``: held-out passkey retrieval and perplexity
  from 1x to 8x the original context, the short-context regression, the table and the plot;
- ``extend`` / ``stages``: the ``context_ext.yarn`` stage (scale, fine-tune, evaluate, write).
"""
