"""The embedded trainer backend: padding-free training of the Qwen2 model on packed micro-batches.

Each micro-batch is one 1-D token stream with cu_seqlens; attention never crosses a sequence
boundary (model.py, "packed" mode), so a sequence's log-probs are the same alone or packed. One
`train_step` accumulates gradients over all its micro-batches with the loss normalised by the global
token count, clips, and takes one AdamW step. Weights stay float32; on a GPU the forward runs under
bfloat16 autocast (float32 master weights and optimizer state).

Log-probs follow base.py: `logprobs[t] = log_softmax(logits_{t-1} / T)[x_t]`, 0 at each sequence's
first token; `model.token_logprobs` is shared with the generation engine so both compute the same thing.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch

from transport.files import atomic_write

from .base import LossFn, PackedBatch, RequestError, TokenLogProbs, TrainEngine, WeightBucket, step_loss_weights
from .checkpoint import (CheckpointError, assign_weights, bucketize, hf_state_dict, load_model, read_tokenizer_files,
                         save_model, write_tokenizer_files)
from .lora import (LoraSpec, adapter_problem, adapter_state, add_lora, copy_base_config, read_adapter, resolve_start,
                   write_adapter)
from .model import PackedAttn, Qwen2ForCausalLM, token_logprobs
from .moe import RoutingTrace, load_balancing_loss

TRAINER_STATE = "trainer_state.pt"
# Files of a model directory that travel with a checkpoint so it is a complete model directory.


@dataclasses.dataclass
class TrainConfig:
    lr: float = 2e-5
    adam_eps: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0                      # <= 0 disables clipping (the norm is still reported)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0                       # linear warm-up from lr / warmup_steps, any schedule
    total_steps: int = 0                        # cosine/linear decay horizon
    min_lr_ratio: float = 0.0                   # floor of cosine/linear decay, as a fraction of lr
    packed_attn: PackedAttn = "loop"            # "loop" measured faster on CPU (docs/engines.md)
    logprob_chunk_tokens: int = 4096            # lm_head rows per chunk in compute_logprobs
    # Mixture-of-experts models: weight of the load-balancing loss (transformers' router_aux_loss_coef) added to
    # every training step's loss; 0 (off) as RL trainers run MoE models (docs/engines.md, "Mixture of experts").
    moe_aux_loss_coef: float = 0.0
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"TrainConfig.schedule must be constant, cosine or linear, got {self.schedule!r}")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"TrainConfig.total_steps ({self.total_steps}) must exceed warmup_steps "
                             f"({self.warmup_steps}) for the {self.schedule} schedule")
        if self.moe_aux_loss_coef < 0:
            raise ValueError(f"TrainConfig.moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef}")
        if self.packed_attn not in ("loop", "mask"):
            raise ValueError(f"TrainConfig.packed_attn must be 'loop' or 'mask', got {self.packed_attn!r}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of lr at optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.schedule == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


class TorchTrainEngine(TrainEngine):
    """Embedded `TrainEngine` on one torch device."""

    def __init__(self, model_dir: str | None = None, config: TrainConfig | None = None, *,
                 model: Qwen2ForCausalLM | None = None, version: int = 0, tokenizer_dir: str | None = None,
                 lora: LoraSpec | None = None, start_adapter: str | None = None) -> None:
        """``tokenizer_dir`` (default ``model_dir``): whose tokenizer files every saved checkpoint carries.
        ``lora``: train adapters on the frozen model (lora.py); ``model_dir`` is then the base model or a LoRA
        checkpoint (which names its base), and ``start_adapter`` an adapter directory a new run starts from."""
        if (model_dir is None) == (model is None):
            raise ValueError("TorchTrainEngine needs exactly one of model_dir or model")
        self.config = config or TrainConfig()
        torch.manual_seed(self.config.seed)
        self.model_dir = model_dir
        self.lora = lora
        self.base_dir, adapter_dir = resolve_start(model_dir, start_adapter) if lora and model_dir else (model_dir, None)
        tokenizer_dir = tokenizer_dir or model_dir
        self._tokenizer_files = read_tokenizer_files(tokenizer_dir) if tokenizer_dir else {}
        self.model = (model if model is not None else load_model(self.base_dir)).to(self.config.device).float()
        if lora is not None:
            add_lora(self.model, lora, self.config.seed)
            if adapter_dir is not None:
                self._load_adapter(adapter_dir)
        self.model.train()
        self.device = torch.device(self.config.device)
        self.autocast = self.device.type == "cuda"
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:   # with LoRA only the adapters: no optimizer state for the frozen base
                (no_decay if p.dim() < 2 else decay).append(p)  # no weight decay on biases and norms
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.config.lr, betas=self.config.betas, eps=self.config.adam_eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.config.lr_factor)
        self.step = 0
        self._initial_version = version

    @property
    def version(self) -> int:
        return self._initial_version + self.step

    # --- forward -----------------------------------------------------------------------------------
    def _hidden(self, batch: PackedBatch, trace: RoutingTrace | None = None) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.model.hidden_states(batch.input_ids, batch.position_ids, batch.cu_seqlens,
                                            self.config.packed_attn, trace)

    def _routing(self, batch: PackedBatch, record: bool = False, router_logits: bool = False) -> RoutingTrace | None:
        """What the sparse layers record and replay in a forward over ``batch``: they replay
        ``batch.fields["routed_experts"]`` ([tokens, sparse layers, top-k], ROUTE_NATIVE rows routed natively)
        when it is there."""
        if not self.model.config.sparse_layers:
            return None
        return RoutingTrace(record=record, replay=batch.fields.get("routed_experts"), keep_router_logits=router_logits)

    def _token_outputs(self, hidden: torch.Tensor, batch: PackedBatch, temperature: float, with_entropy: bool,
                       chunk: int | None) -> TokenLogProbs:
        """Align log-probs with the input tokens: position t is predicted by hidden state t-1."""
        targets = batch.input_ids[1:]
        n = hidden.shape[0] - 1
        step = chunk or max(n, 1)
        lps, ents = [], []
        for s in range(0, n, step):
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                logits = self.model.logits(hidden[s:min(s + step, n)])
            lp, ent = token_logprobs(logits, targets[s:s + step], temperature, with_entropy)
            lps.append(lp)
            ents.append(ent)
        zero = hidden.new_zeros(1, dtype=torch.float32)
        starts = torch.zeros(n + 1, dtype=torch.bool, device=hidden.device)
        starts[batch.cu_seqlens[:-1]] = True
        logprobs = torch.cat([zero] + lps).masked_fill(starts, 0.0)
        entropy = torch.cat([zero] + ents).masked_fill(starts, 0.0) if with_entropy else None
        return TokenLogProbs(logprobs, entropy)

    def _check(self, batch: PackedBatch) -> PackedBatch:
        vocab = self.model.config.vocab_size
        if batch.num_tokens and (int(batch.input_ids.min()) < 0 or int(batch.input_ids.max()) >= vocab):
            raise RequestError(f"PackedBatch.input_ids has a token outside the vocabulary (size {vocab})")
        return batch.to(self.device)

    def compute_logprobs(self, batch: PackedBatch, temperature: float = 1.0,
                         with_entropy: bool = False, record_routing: bool = False) -> TokenLogProbs:
        """``record_routing``: also return the experts every token was routed to (mixture-of-experts models),
        for later forwards to replay (algo.routing_replay: r2)."""
        batch = self._check(batch)
        trace = self._routing(batch, record=record_routing)
        with torch.no_grad():
            hidden = self._hidden(batch, trace)
            out = self._token_outputs(hidden, batch, temperature, with_entropy, self.config.logprob_chunk_tokens)
        if record_routing and trace is not None:
            out.routed_experts = trace.experts()
        return out

    # --- optimisation ------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[PackedBatch], loss_fn: LossFn, temperature: float = 1.0,
                   loss_denominator: float | None = None, with_entropy: bool = False) -> dict[str, float]:
        batches = [self._check(mb) for mb in micro_batches]
        weights, denominator = step_loss_weights(batches, loss_denominator)
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        stat_sums: dict[str, float] = {}
        stat_weight = 0.0
        aux_coef = self.config.moe_aux_loss_coef
        step_tokens = sum(mb.num_tokens for mb in batches)
        aux_total = 0.0
        for mb, weight in zip(batches, weights):
            trace = self._routing(mb, router_logits=aux_coef > 0)
            outputs = self._token_outputs(self._hidden(mb, trace), mb, temperature, with_entropy, None)
            loss_sum, stats = loss_fn(outputs, mb)
            if loss_sum.dim() != 0:
                raise RequestError(f"loss_fn must return a scalar loss sum, got shape {tuple(loss_sum.shape)}")
            loss = loss_sum / denominator
            if trace is not None and aux_coef > 0:
                # Each micro-batch's balance loss weighted by its share of the step's tokens.
                cfg = self.model.config
                aux = load_balancing_loss(trace.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
                share = mb.num_tokens / step_tokens
                loss = loss + aux_coef * share * aux
                aux_total += float(aux.detach()) * share
            loss.backward()
            loss_total += float(loss_sum.detach())
            for key, value in stats.items():
                stat_sums[key] = stat_sums.get(key, 0.0) + float(value) * weight
            stat_weight += weight
        t1 = time.perf_counter()
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not math.isfinite(grad_norm)
        if skipped:  # a non-finite gradient would poison AdamW's moments; drop this step
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        out = {"loss": loss_total / denominator, "grad_norm": grad_norm, "lr": lr, "skipped": float(skipped),
               "tokens": float(sum(mb.num_tokens for mb in batches)), "seqs": float(sum(mb.num_seqs for mb in batches)),
               "step": float(self.step), "version": float(self.version),
               # the step's phases for the timeline (tools.trace): forward and backward of every micro-batch,
               # then clipping and the optimizer (on a GPU, as far as the host's clock sees them)
               "forward_backward_seconds": t1 - t0, "optimizer_seconds": time.perf_counter() - t1}
        if aux_coef > 0 and self.model.config.sparse_layers:
            out["moe_aux_loss"] = aux_total
        for key, value in stat_sums.items():
            out.setdefault(key, value / stat_weight if stat_weight else 0.0)
        return out

    # --- weights and checkpoints -------------------------------------------------------------------
    def export_weights(self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None) -> Iterator[WeightBucket]:
        """Buckets of (hf_name, tensor) copies, taken lazily bucket by bucket (valid after later steps)."""
        named = (adapter_state(self.model) if self.lora else hf_state_dict(self.model)).items()
        for bucket in bucketize(named, bucket_bytes):
            yield [(name, t.detach().to(dtype or t.dtype, copy=True)) for name, t in bucket]

    def save(self, path: str) -> None:
        if self.lora is not None:   # the adapter and the base's name; the base's weights stay where they are
            write_adapter(path, adapter_state(self.model), self.lora, self.base_dir, self.model.config)
            copy_base_config(self.base_dir, path)
        else:
            save_model(self.model, path)
        write_tokenizer_files(self._tokenizer_files, path)
        state = {
            "step": self.step, "initial_version": self._initial_version,
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "config": dataclasses.asdict(self.config),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }
        # Written last, whole or not at all: a directory without it is an incomplete checkpoint.
        atomic_write(os.path.join(path, TRAINER_STATE), lambda f: torch.save(state, f))

    def load(self, path: str) -> None:
        state_path = os.path.join(path, TRAINER_STATE)
        if not os.path.exists(state_path):
            raise CheckpointError(f"{path}: no {TRAINER_STATE} (not a complete trainer checkpoint)")
        if self.lora is not None:
            self._load_adapter(path)
        else:
            loaded = load_model(path)
            if loaded.config.to_dict() != self.model.config.to_dict():
                raise CheckpointError(f"{path}: config.json describes a different model than this trainer's")
            assign_weights(self.model, hf_state_dict(loaded).items(), strict=True, source=path)
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step, self._initial_version = int(state["step"]), int(state["initial_version"])
            rng = state["rng"]
        except KeyError as e:
            raise CheckpointError(f"{state_path}: missing key {e.args[0]!r}") from None
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


    def _load_adapter(self, adapter_dir: str) -> None:
        problem = adapter_problem(adapter_dir, self.model.config, self.lora)
        if problem:
            raise CheckpointError(problem)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in read_adapter(adapter_dir)[1].items():
                params[name].copy_(tensor)


def token_nll_loss(outputs: TokenLogProbs, batch: PackedBatch) -> tuple[torch.Tensor, dict[str, Any]]:
    """Sum of -log p over the tokens in batch.fields["loss_mask"] (all tokens but the first of each
    sequence when absent): supervised fine-tuning, and the simplest LossFn for tests and benchmarks."""
    mask = batch.fields.get("loss_mask")
    if mask is None:
        mask = torch.ones_like(outputs.logprobs)
        mask[batch.cu_seqlens[:-1]] = 0.0
    loss = -(outputs.logprobs * mask).sum()
    count = float(mask.sum())
    return loss, {"nll": float(loss.detach()) / count if count else 0.0}
