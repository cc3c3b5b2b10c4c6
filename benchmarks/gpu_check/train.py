"""Part `train`: training steps on the device against the same steps on the CPU in float32.

Each case reuses the product's pieces (`warsha.training`'s loss and AdamW, `tokenizer_ext`'s
LoRA config, `context_ext`'s YaRN config, `distill`'s draft and loss, `quantize`'s GPTQ and
AWQ) on a small seeded Llama (2 layers, 128 wide, 512-token vocabulary), identical weights and
batches on both sides. The device runs bf16 autocast over float32 master weights, as the stages
do with `bf16: true`, and, on CUDA, float32 too. Loss tolerances (relative, every step):
float32 on the GPU 1e-3 (summation order only), bf16 3e-2 (bf16 keeps 8 bits of mantissa).
bitsandbytes is not on the GPU machine (its wheel alone is near the 64 MiB the tree may
carry), so the QLoRA case runs LoRA on an unquantized base; the report says so.

Without CUDA the "device" side is the CPU in bf16 autocast: the same comparison, on one host.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from benchmarks.gpu_check.common import PartResult, part_main

VOCAB, SEQ, BATCH = 512, 64, 4
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}


def _config(positions: int = 128) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                       tie_word_embeddings=False)  # fmt: skip


def _model(config: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _batches(steps: int, seq: int = SEQ, weights: bool = False) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    distinct = []
    for _ in range(2):  # two batches in turn: a model can learn them, so the loss must fall
        b: dict[str, Any] = {"input_ids": torch.randint(0, VOCAB, (BATCH, seq), generator=g)}
        if weights:
            b["loss_weights"] = (torch.rand(BATCH, seq, generator=g) < 0.5).float()
        distinct.append(b)
    return [distinct[i % 2] for i in range(steps)]


def train_losses(
    make: Callable[[], Any],
    loss_fn: Callable[[Any, dict], Any],
    batches: list[dict],
    device: str,
    dtype: str,
    lr: float,
) -> list[float]:
    """Losses of `len(batches)` AdamW steps (the stages' optimizer, clipping at 1.0)."""
    import torch

    from warsha.training import TrainParams, make_optimizer

    model = make().to(device).train()
    params = [q for q in model.parameters() if q.requires_grad]
    p = TrainParams(lr=lr, warmup_steps=0)
    opt = make_optimizer(params, p)
    losses = []
    for batch in batches:
        moved = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = loss_fn(model, moved)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, p.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def cases(quick: bool) -> dict[str, tuple[Callable[[], Any], Callable, list[dict], float]]:
    """name -> (model factory, loss, batches, lr)."""
    from context_ext import scaling
    from distill import draft
    from distill.train import DistillSpec, distill_loss
    from tokenizer_ext.qlora import lora_config
    from warsha.lm_loss import weighted_lm_loss
    from warsha.training import causal_lm_loss

    out: dict[str, Any] = {"bootstrap (20 steps)": (lambda: _model(_config()), causal_lm_loss, _batches(20), 2e-3)}
    if quick:
        return out

    def lora() -> Any:
        from peft import get_peft_model

        torch_seed()
        return get_peft_model(_model(_config()), lora_config([], False, 8, 16, 0.0, False))

    from transformers import LlamaConfig

    cfg = scaling.scaled_config(_config().to_dict(), "yarn", 4.0)
    yarn_cfg = LlamaConfig(**{k: v for k, v in cfg.items() if k != scaling.RECORD_KEY})
    teacher = _model(_config()).eval()
    out["LoRA r8 all-linear (10 steps)"] = (lora, causal_lm_loss, _batches(10), 1e-3)
    out["YaRN x4 fine-tune at 512 positions (3 steps)"] = (
        lambda: _model(yarn_cfg), weighted_lm_loss, _batches(3, seq=512, weights=True), 2e-4)  # fmt: skip
    out["distillation, forward KL (3 steps)"] = (
        lambda: draft.from_config(teacher, 64, 128, 1, 2, 1, "embedding"),
        _distill_on_device(teacher, distill_loss, DistillSpec(loss="fkl")),
        [{**b, "mask": b["input_ids"] >= 0} for b in _batches(3)],
        2e-3,
    )
    return out


def torch_seed() -> None:
    import torch

    torch.manual_seed(0)


def _distill_on_device(teacher: Any, make_loss: Callable, spec: Any) -> Callable[[Any, dict], Any]:
    """distill_loss with the teacher moved to the student's device first."""

    def loss_fn(model: Any, batch: dict) -> Any:
        device = next(model.parameters()).device
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        return make_loss(teacher, spec)(model, batch)

    return loss_fn


def close(a: list[float], b: list[float]) -> float:
    """Largest relative difference between two loss curves."""
    return max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b))


def run(result: PartResult, args: argparse.Namespace) -> None:
    import torch

    cuda = result.device == "cuda"
    if not cuda:
        result.skip("training on CUDA (bf16 autocast, fp32)", "no CUDA: the device side ran on the CPU in bf16")
    result.skip("QLoRA with bitsandbytes' CUDA 4-bit", "bitsandbytes is not installed on the GPU machine; LoRA in bf16")
    for name, (make, loss_fn, batches, lr) in cases(args.quick).items():
        ref = train_losses(make, loss_fn, batches, "cpu", "float32", lr)
        for dtype in ("float32", "bfloat16") if cuda else ("bfloat16",):
            got = train_losses(make, loss_fn, batches, result.device, dtype, lr)
            worst = close(got, ref)
            ok = worst <= TOLERANCE[dtype] and got[-1] < got[0]
            result.add(f"{name}: {result.device} {dtype} vs cpu float32 (and the loss fell)", ok,
                       max_rel_diff=round(worst, 5), tolerance=TOLERANCE[dtype], first=[got[0], ref[0]],
                       last=[got[-1], ref[-1]], decreased=got[-1] < got[0])  # fmt: skip
    if not args.quick:
        calibrate(result, torch.device(result.device))


def calibrate(result: PartResult, device: Any) -> None:
    """GPTQ and AWQ on one 512 -> 256 linear, on the device and on the CPU."""
    import torch

    from quantize.awq import AWQOptions, search_scale
    from quantize.gptq import GPTQOptions, HessianAccumulator, gptq_quantize
    from quantize.quantizer import QuantSpec

    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 512, generator=g) * 0.05
    x = torch.randn(2048, 512, generator=g) * (1 + 4 * (torch.rand(512, generator=g) < 0.02))  # outlier channels
    spec = QuantSpec(bits=4, group_size=128, sym=False)
    errors, alphas, losses = {}, {}, {}
    for dev in ("cpu", device.type):
        acc = HessianAccumulator(512, dev)
        acc.add(x.to(dev))
        ql = gptq_quantize(w.to(dev), acc.h, spec, GPTQOptions())
        ref = x @ w.t()
        errors[dev] = float((x @ ql.cpu().dequantize().t() - ref).norm() / ref.norm())
        lin = torch.nn.Linear(512, 256, bias=False).to(dev)
        lin.weight.data = w.to(dev).clone()
        xd = x.to(dev)
        _, alphas[dev], losses[dev] = search_scale(xd, [lin], lambda lin=lin, xd=xd: lin(xd), spec, AWQOptions())
    e_cpu, e_dev = errors["cpu"], errors[device.type]
    result.add("GPTQ one layer: output error on the device vs cpu", abs(e_dev - e_cpu) <= 0.02 * e_cpu,
               rel_output_error={"device": e_dev, "cpu": e_cpu}, tolerance="2% of the cpu error")  # fmt: skip
    same = alphas["cpu"] == alphas[device.type] or abs(losses[device.type] - losses["cpu"]) <= 0.02 * losses["cpu"]
    result.add("AWQ scale search one layer: same alpha, or its loss within 2%", same, alphas=alphas, losses=losses)


if __name__ == "__main__":
    part_main("train", run)
