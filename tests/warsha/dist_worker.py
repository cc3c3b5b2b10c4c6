"""Run by torchrun in test_distributed: the bootstrap stage under 2 CPU processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.conftest import tiny_recipe
from warsha import pipeline
from warsha.config import parse_recipe

root = Path(sys.argv[1])
recipe = parse_recipe(tiny_recipe(steps=6))
steps = pipeline.plan(recipe, root)
pipeline.Runner(recipe, root).run(steps, {0})
import torch  # noqa: E402
from accelerate import PartialState  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from warsha.training import TrainParams, check_ranks_in_sync, make_accelerator  # noqa: E402

state = PartialState()
# The divergence check must fire when one rank's weights differ (it guards against launchers
# that silently start independent runs).
acc = make_accelerator("cpu", TrainParams(bf16=False))
model = AutoModelForCausalLM.from_pretrained(root / "bootstrap")
same = check_ranks_in_sync(acc, model, "probe")
if state.process_index == 1:
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
try:
    check_ranks_in_sync(acc, model, "probe")
    caught = False
except RuntimeError:
    caught = True
(root / f"rank{os.environ['RANK']}.json").write_text(
    json.dumps({"world": state.num_processes, "same_ok": same, "divergence_caught": caught})
)
from warsha import distributed  # noqa: E402

distributed.shutdown()  # as `warsha run` does: no gloo teardown left to interpreter exit
distributed.leave(0)
