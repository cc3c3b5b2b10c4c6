"""The random-model helpers read sharded checkpoints: a 1.1B float32 target is saved in 2 GB
shards (`make_model`), and the layer-skip draft and GPTQ pair built from it must hold exactly the
tensors they hold when the target is one file (the GPU check's TinyLlama case found this)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from warsha.random_models import gptq_pair, make_layer_skip_draft, make_model


def _same_files(a: Path, b: Path) -> None:
    """Two single-file checkpoints with the same tensor names and bit-identical values."""
    sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_draft_and_gptq_pair_of_a_sharded_target_match_the_single_file_ones(tmp_path: Path) -> None:
    whole = make_model(tmp_path / "whole", seed=3, num_hidden_layers=3)
    shards = make_model(tmp_path / "shards", seed=3, num_hidden_layers=3, _shard="40KB")
    assert (shards / "model.safetensors.index.json").is_file() and not (shards / "model.safetensors").exists()
    _same_files(make_layer_skip_draft(whole, tmp_path / "dw", 2), make_layer_skip_draft(shards, tmp_path / "ds", 2))
    (qw, dw), (qs, ds) = gptq_pair(whole, tmp_path / "gw"), gptq_pair(shards, tmp_path / "gs")
    _same_files(qw, qs)
    _same_files(dw, ds)
