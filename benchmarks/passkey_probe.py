"""Passkey probe: how fast does a fine-tune teach a model to retrieve? (quick, CPU)

Uses the ``context_ext.yarn`` stage's own pieces (its scaled config, its batch mix of corpus,
passkey and copy rows with the length curriculum, its weighted loss and its passkey scorer) in a
bare AdamW loop with a cosine schedule, and scores passkey accuracy at each length every
``--eval-every`` steps. For finding a recipe before paying for the full stage or
``benchmarks/context_bench.py`` (which also runs every baseline). Nothing is written; the
accuracies are printed. Example (the run behind the README's yarn row)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.passkey_probe --model runs/arabic-tiny/bootstrap \
        --steps 120 --trials 20 --lengths 256,1024,2048 --lang en --copy 0.4 --retr 0.4 --curr 0.5 \
        --lmpos 0.25 --lr 1e-3 --eval-every 60
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--model", default="runs/arabic-tiny/adapt", help="HF model directory with a RoPE config")
ap.add_argument("--method", default="yarn")
ap.add_argument("--factor", type=float, default=4.0)
ap.add_argument("--target", type=int, default=0)
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--bs", type=int, default=2)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--warmup", type=int, default=10)
ap.add_argument("--retr", type=float, default=0.5)
ap.add_argument("--copy", type=float, default=0.0)
ap.add_argument("--curr", type=float, default=0.0)
ap.add_argument("--lmpos", type=float, default=1.0)
ap.add_argument("--aw", type=float, default=5.0)
ap.add_argument("--lengths", default="256,1024,2048")
ap.add_argument("--trials", type=int, default=20)
ap.add_argument("--eval-every", type=int, default=50)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--lang", default="ar")
a = ap.parse_args()
torch.set_num_threads(a.threads)
from transformers import AutoTokenizer  # noqa: E402  (after set_num_threads)

from context_ext import longdata, passkey, suite  # noqa: E402  (after set_num_threads)
from context_ext.stages import YarnParams  # noqa: E402  (after set_num_threads)
from context_ext.yarn_stage import resolve  # noqa: E402  (after set_num_threads)
from warsha.data import DataConfig, load_corpus  # noqa: E402  (after set_num_threads)
from warsha.lm_loss import weighted_lm_loss  # noqa: E402  (after set_num_threads)

p = YarnParams(method=a.method, factor=a.factor, target_length=a.target or None, baselines=[], finetune_baselines=[])
base_cfg = json.loads((Path(a.model) / "config.json").read_text())
plan = resolve(base_cfg, p)
tok = AutoTokenizer.from_pretrained(a.model)
corpus = load_corpus(DataConfig(source="hadith", strip_diacritics=True, validation_fraction=0.02, test_fraction=0.02))
texts = longdata.heldout_texts(corpus, a.lang)
filler = passkey.filler_stream(tok, texts[: len(texts) // 2])
fmt = passkey.PasskeyFormat(tok)
model = suite.load_variant(Path(a.model), plan.configs[a.method], "float32")
lengths = [int(x) for x in a.lengths.split(",")]


def ev(tag: str) -> dict[int, float]:
    """Passkey accuracy per length (exact greedy match, ``--trials`` prompts each)."""
    model.eval()
    out = {}
    for L in lengths:
        c = passkey.evaluate_length(
            model, fmt, filler, L, min_trials=a.trials, max_trials=a.trials, batch_size=max(1, 4096 // L)
        )
        out[L] = round(c.accuracy, 3)
    print(tag, out, flush=True)
    model.train()
    return out


ev("step 0")
b = longdata.make_batches(
    tok,
    corpus,
    a.lang,
    plan.target,
    a.bs,
    a.retr,
    0,
    answer_weight=a.aw,
    copy_fraction=a.copy,
    start_len=plan.original,
    steps=a.steps,
    curriculum=a.curr,
    lm_positions=a.lmpos,
    max_stream_tokens=400_000,
)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
model.train()
t0 = time.time()
for step in range(a.steps):
    lr = a.lr * min(1, (step + 1) / max(1, a.warmup))
    lr = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps))) if step >= a.warmup else lr
    for g in opt.param_groups:
        g["lr"] = lr
    batch = b(step, 0, 0)
    loss = weighted_lm_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    if step % 10 == 0:
        print(
            f"step {step} len {b.length_at(step)} loss {loss.item():.3f} {(time.time() - t0) / (step + 1):.2f}s/step",
            flush=True,
        )
    if (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
        ev(f"step {step + 1}")
ev(f"final {a.steps}")
print("train time", time.time() - t0)
