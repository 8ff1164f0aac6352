"""The optimisation loop: AdamW on fp32 master copies of the model's (bf16) parameters, warmup then cosine decay,
gradient clipping, and the auxiliary-loss-free MoE balancing of the router biases.

The model runs in the dtype it is served in, so the forward pass trained is the forward pass served. Router biases
(`e_score_correction_bias`) only choose experts (ops/moe/eager.py), so they get no gradient: after every step each
layer's bias moves by `bias_rate` towards the experts that got fewer tokens than the mean, as DeepSeek-V3's
load balancing does.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shard_svc.model import KimiForCausalLM
from training.data import Batch
from training.graphed import CapturedPass
from training.ops import RouterLoads, training_context, training_ops

log = logging.getLogger(__name__)


@dataclass
class Schedule:
    peak_lr: float
    warmup: int
    total: int
    floor: float = 0.1  # the last step's lr, as a fraction of the peak

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.peak_lr * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class PhaseReport:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) every `log_every` steps


class Trainer:
    def __init__(self, model: KimiForCausalLM, batch: int, seq_len: int, chunk: int, mxfp4_experts: bool,
                 weight_decay: float = 0.1, bias_rate: float = 1e-3, clip: float = 1.0, cuda_graphs: bool = False):
        """cuda_graphs: replay each step's forward and backward as one captured graph (training/graphed.py)."""
        self.model, self.batch, self.seq_len, self.clip, self.bias_rate = model, batch, seq_len, clip, bias_rate
        self.cuda_graphs = cuda_graphs
        self.captured: CapturedPass | None = None
        self.device = next(model.parameters()).device
        self.chunk = chunk
        self.loads = RouterLoads()
        self.use_mxfp4_experts(mxfp4_experts)
        named = list(model.named_parameters())
        self.biases = [p for n, p in named if n.endswith("e_score_correction_bias")]
        trained = [(n, p) for n, p in named if not n.endswith("e_score_correction_bias")]
        self.params = [p for _, p in trained]
        for p in self.params:
            p.requires_grad_(True)
        self.master = [p.detach().float().clone() for p in self.params]
        # Weight decay on matrices (not embeddings, norms, gates' A_log / dt_bias).
        decay = [p.dim() >= 2 and "embed_tokens" not in n for n, p in trained]
        decayed = [m for m, d in zip(self.master, decay) if d]
        rest = [m for m, d in zip(self.master, decay) if not d]
        self.opt = torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=0.0, betas=(0.9, 0.95), eps=1e-8,
                                     foreach=True)

    def use_mxfp4_experts(self, on: bool) -> None:
        """Routed experts on their MXFP4-rounded values from now on (straight-through), or on their own values."""
        self.ops = training_ops(self.batch, self.seq_len, self.chunk, on, self.loads)
        self.captured = None  # captured with the other experts' ops

    def loss(self, batch: Batch) -> torch.Tensor:
        ctx = training_context(self.ops, self.device)
        hidden = self.model(batch.inputs.flatten(), ctx)
        logits = self.model.compute_logits(hidden, self.ops)
        return F.cross_entropy(logits, batch.targets.flatten(), ignore_index=-100)

    def step(self, batch: Batch, lr: float) -> torch.Tensor:
        """One optimiser step; returns the loss (a device tensor: reading it is the caller's sync)."""
        if self.cuda_graphs:
            if self.captured is None:
                self.captured = CapturedPass(self.loss, self.params, batch, self.loads.per_layer)
            loss, loads = self.captured.run(batch), self.captured.loads
        else:
            self.loads.per_layer.clear()
            loss = self.loss(batch)
            loss.backward()
            loads = self.loads.per_layer
        with torch.no_grad():
            pairs = [(p.grad, m) for p, m in zip(self.params, self.master) if p.grad is not None]
            for _, m in pairs:
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
            torch._foreach_copy_([m.grad for _, m in pairs], [g for g, _ in pairs])
            torch.nn.utils.clip_grad_norm_([m for _, m in pairs], self.clip, foreach=True)
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.step()
            torch._foreach_copy_(self.params, self.master)
            if not self.cuda_graphs:  # the captured pass writes the same .grad tensors every replay
                for p in self.params:
                    p.grad = None
            for bias, load in zip(self.biases, loads, strict=True):
                bias.add_(torch.sign(load.float().mean() - load.float()), alpha=self.bias_rate)
        return loss.detach().clone() if self.cuda_graphs else loss.detach()  # the next replay rewrites it

    def run(self, sample, schedule: Schedule, report: PhaseReport, log_every: int, name: str,
            budget_s: float | None = None, calibrate_after: int = 10) -> PhaseReport:
        """`schedule.total` steps of batches from `sample(rows)`. With `budget_s`, the step time measured over the
        steps after the first `calibrate_after` sets `schedule.total` once (never above the given total), so the
        whole cosine schedule fits the budget; the steps taken are reported."""
        start = time.perf_counter()
        mark = None
        step = 0
        while step < schedule.total:
            batch = sample(self.batch)
            loss = self.step(batch, schedule.lr(step))
            step += 1
            report.tokens += int(batch.inputs.numel())
            if budget_s is not None and step == calibrate_after:
                _sync(self.device)
                mark = time.perf_counter()
            if budget_s is not None and step == 2 * calibrate_after and mark is not None:
                _sync(self.device)
                per_step = (time.perf_counter() - mark) / calibrate_after
                fits = int((budget_s - (time.perf_counter() - start)) / per_step) + step
                schedule.total = max(step, min(schedule.total, fits))
                log.info("step time measured", extra={"model": name, "step_s": round(per_step, 4),
                                                      "steps": schedule.total, "budget_s": budget_s})
            if step % log_every == 0 or step == schedule.total:
                value = float(loss)
                report.losses.append((step, round(value, 4)))
                log.info("train", extra={"model": name, "step": step, "of": schedule.total, "loss": round(value, 4),
                                         "lr": round(schedule.lr(step - 1), 6),
                                         "elapsed_s": round(time.perf_counter() - start, 1)})
                if not math.isfinite(value):
                    raise FloatingPointError(f"{name}: loss {value} at step {step}")
        _sync(self.device)
        report.steps += step
        report.seconds += time.perf_counter() - start
        return report

    def finish(self) -> None:
        for p in self.params:
            p.requires_grad_(False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
