"""Distilling a DFlash draft for a frozen mlx-lm target (the paper's recipe, §4.2, A.1).

Owns: initialising a draft for a target, reading training data, sampling random anchors,
the weighted block loss, the optimiser loop with checkpoints and resume. The draft borrows
the target's embedding and LM head (frozen, never copied); target features and the
target's own next tokens are computed online from the frozen target. Every block is
trained on exactly what inference shows it (`DFlashDraft.training_logits`). Never prints:
progress goes through a callback.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..engine.generate import generate
from ..models.config import DraftConfig, default_target_layer_ids
from ..models.draft import DFlashDraft
from ..options import GenerateOptions
from ..pair import Pair
from ..stats import Stats
from .blocks import cross_entropy, fast_path, grouped_blocks, grouped_logits
from .data import Example, read_examples, split_held, split_held_out  # noqa: F401 (the API)
from .verdict import probe_loss, verdict


@dataclass
class TrainSettings:
    steps: int = 1000
    batch: int = 8  # sequences per step
    seq_len: int = 512
    lr: float = 2e-3
    warmup: float = 0.04  # fraction of the steps
    anchors_per_seq: int = 32
    loss_gamma: float | None = None  # w_k = exp(-(k - 1) / gamma); None: by block size
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    save_every: int = 100
    eval_prompts: int = 8
    eval_tokens: int = 128
    feature_cache_mb: float = 2048  # the target's rows computed once when they fit; 0: each step

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len", "anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr {self.lr} must be > 0")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup {self.warmup} must be a fraction in [0, 1)")
        if self.loss_gamma is not None and not self.loss_gamma > 0:
            raise ValueError(f"loss_gamma {self.loss_gamma} must be > 0")


def gamma_for_block(block_size: int) -> float:
    """The paper's loss decay per block size (7 for 16, 5 for 10, 4 for 8), interpolated."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 0.45 * block_size))


@dataclass
class TrainLog:
    settings: dict
    steps: list[dict] = field(default_factory=list)  # {"step", "loss", "lr", "tokens_per_s"}
    evals: list[dict] = field(default_factory=list)  # {"step", "tau", "held_loss", "train_loss"}
    skipped_lines: list[str] = field(default_factory=list)
    verdict: str = ""  # more data or more steps? (`verdict.verdict`, after the last check)
    data: dict = field(default_factory=dict)  # {"sequences", "response_tokens"} trained on


# -- the draft -------------------------------------------------------------------------------


def draft_config_for(
    model: nn.Module,
    *,
    layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int,
) -> dict:
    """A z-lab style `config.json` for a draft of `model` (shapes follow the target)."""
    t = Pair(model).target
    args = getattr(model, "args", None)
    inner = getattr(model, "language_model", model)
    args = getattr(inner, "args", args)
    heads = getattr(args, "num_attention_heads", max(1, t.hidden_size // 64))
    ids = target_layer_ids or default_target_layer_ids(t.num_layers, layers)
    return {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": t.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(args, "num_key_value_heads", heads) or heads,
        "head_dim": getattr(args, "head_dim", None) or t.hidden_size // heads,
        "intermediate_size": getattr(args, "intermediate_size", 4 * t.hidden_size),
        "vocab_size": t.vocab_size or t.embed_rows,
        "rms_norm_eps": getattr(args, "rms_norm_eps", 1e-6),
        "max_position_embeddings": getattr(args, "max_position_embeddings", 32768),
        "rope_theta": getattr(args, "rope_theta", 10000.0) or 10000.0,
        "num_target_layers": t.num_layers,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "block_size": block_size,
            "target_layer_ids": ids,
        },
    }


def init_draft(model: nn.Module, config: dict, seed: int = 0) -> Pair:
    """A new draft for `model`, paired with it (the fit checked): layers copied from the
    target's last layers where the shapes match, final norm from the target, `fc` reading
    the deepest captured layer."""
    mx.random.seed(seed)
    draft = DFlashDraft(DraftConfig.from_dict(config))
    pair = Pair(model, draft)
    for mine, theirs in zip(draft.layers, pair.target.layers[-len(draft.layers) :]):
        src = dict(tree_flatten(theirs.parameters()))
        own = tree_flatten(mine.parameters())
        if all(k in src and src[k].shape == v.shape for k, v in own):
            mine.update(tree_unflatten([(k, src[k]) for k, _ in own]))
    norm = getattr(getattr(model, "language_model", model), "model", None)
    if norm is not None and "norm" in norm and norm["norm"].weight.shape == draft.norm.weight.shape:
        draft.norm.weight = norm["norm"].weight
    d, n = draft.config.hidden_size, len(draft.config.target_layer_ids)
    fc = mx.zeros((d, n * d))
    draft.fc.weight = fc.at[:, (n - 1) * d :].add(mx.eye(d))
    # Trained in float32 whatever the target's precision: a half-precision target (bf16
    # checkpoints, on a GPU or a CPU without an optimized BLAS, where no upcast happens) made
    # a half-precision draft, whose small late updates round away and which takes the fused
    # bf16 attention that trained a worse draft (blocks.fast_path).
    draft.set_dtype(mx.float32)
    mx.eval(draft.parameters())
    return pair


def save_draft_checkpoint(draft: DFlashDraft, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = dict(tree_flatten(draft.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)


# -- data --------------------------------------------------------------------------------------


def sample_batch(
    examples: list[Example], settings: TrainSettings, step: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens (B, S), lengths (B,), seq_index (n,), anchors (n,)) for `step`: a pure
    function of the seed and step, so a resumed run sees exactly the batches it would
    have seen."""
    return sample_rows(examples, settings, step)[1:]


def sample_rows(
    examples: list[Example], settings: TrainSettings, step: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`sample_batch` with the chosen examples' indices first."""
    rng = np.random.default_rng((settings.seed, step))
    chosen = rng.choice(len(examples), size=settings.batch, replace=len(examples) < settings.batch)
    seqs = [examples[i] for i in chosen]
    S = max(len(e.tokens) for e in seqs)
    tokens = np.zeros((len(seqs), S), dtype=np.int32)
    seq_index, anchors = [], []
    for b, e in enumerate(seqs):
        tokens[b, : len(e.tokens)] = e.tokens
        positions = np.arange(e.start, len(e.tokens) - 1)  # at least one label after
        take = min(settings.anchors_per_seq, len(positions))
        anchors += list(rng.choice(positions, size=take, replace=False))
        seq_index += [b] * take
    lengths = np.array([len(e.tokens) for e in seqs], np.int32)
    return chosen, tokens, lengths, np.array(seq_index, np.int32), np.array(anchors, np.int32)


# -- the loss ----------------------------------------------------------------------------------


def block_targets(pair: Pair, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """Target features (B, S, K*D) and the target's own next token at each position."""
    logits, feats = pair.target.forward(tokens, None, pair.draft.config.target_layer_ids)
    nxt = mx.argmax(logits, axis=-1).astype(mx.int32)  # nxt[p] = target's token at p + 1
    return mx.stop_gradient(feats), nxt


class TargetRows:
    """The frozen target's features and own next tokens for every example, computed once
    before training (a few dozen batched forwards instead of one per step: the target is
    frozen and the data fixed, so every step would compute the same rows again). Kept when
    they fit in `TrainSettings.feature_cache_mb`; `batch` pads a step's rows as
    `block_targets` would have computed them."""

    def __init__(self, pair: Pair, examples: list[Example], batch: int = 16):
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens))
        self.feats: list[mx.array | None] = [None] * len(examples)
        self.nxt: list[mx.array | None] = [None] * len(examples)
        for j in range(0, len(order), batch):
            rows = order[j : j + batch]
            S = max(len(examples[i].tokens) for i in rows)
            tokens = np.zeros((len(rows), S), np.int32)
            for r, i in enumerate(rows):
                tokens[r, : len(examples[i].tokens)] = examples[i].tokens
            feats, nxt = block_targets(pair, mx.array(tokens))
            feats = feats.astype(mx.float32)
            for r, i in enumerate(rows):
                n = len(examples[i].tokens)
                self.feats[i], self.nxt[i] = mx.array(feats[r, :n]), mx.array(nxt[r, :n])
            mx.eval(*(self.feats[i] for i in rows), *(self.nxt[i] for i in rows))

    @staticmethod
    def nbytes(pair: Pair, examples: list[Example]) -> int:
        """What the rows of `examples` take (float32 features of every captured layer)."""
        width = len(pair.draft.config.target_layer_ids) * pair.target.hidden_size
        return sum(len(e.tokens) for e in examples) * (width * 4 + 4)

    def batch(self, chosen, S: int) -> tuple[mx.array, mx.array]:
        """(features (B, S, K*D), next tokens (B, S)) of the chosen examples, right-padded."""

        def pad(a):
            return mx.pad(a, [(0, S - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

        feats = mx.stack([pad(self.feats[i]) for i in chosen])
        return feats, mx.stack([pad(self.nxt[i]) for i in chosen])


def block_loss(
    pair: Pair,
    feats: mx.array,
    nxt: mx.array,
    tokens: mx.array,
    seq_index: mx.array,
    anchors: mx.array,
    lengths: mx.array,
    gamma: float,
    layout: tuple[int, mx.array] | None = None,
) -> mx.array:
    """Weighted cross-entropy of every block's predictions of the target's next tokens
    (differentiable in `pair.draft`'s parameters). `layout` (`grouped_blocks`'s m and
    slots): the blocks go through `grouped_logits`, the same logits computed faster."""
    draft = pair.draft
    L = draft.config.block_size
    k = mx.arange(1, L)
    block = mx.full((anchors.size, L), draft.config.mask_token_id, dtype=mx.int32)
    block[:, 0] = tokens[seq_index, anchors]
    if layout is not None and fast_path(draft):
        m, slot = layout
        n_slots = feats.shape[0] * m
        padded_anchors = mx.zeros((n_slots,), mx.int32).at[slot].add(anchors)
        padded = mx.full((n_slots, L), draft.config.mask_token_id, dtype=mx.int32)
        padded[slot] = block
        rows = None if anchors.size == n_slots else slot  # every slot a block: all of them
        logits = grouped_logits(draft, feats, padded_anchors, padded, pair.head, m, rows)
    else:
        logits = draft.training_logits(feats, seq_index, anchors, block, pair.head)  # (n, L-1, V)
    pos = anchors[:, None] + k[None] - 1  # label for index k: the target's token at anchor + k
    valid = (anchors[:, None] + k[None]) < lengths[seq_index][:, None]
    labels = nxt[seq_index[:, None], mx.minimum(pos, tokens.shape[1] - 1)]
    ce = cross_entropy(logits, labels)
    w = mx.exp(-(k - 1) / gamma)[None] * valid
    return (ce * w).sum() / mx.maximum(w.sum(), 1e-6)


# -- the loop ------------------------------------------------------------------------------------


def make_optimizer(settings: TrainSettings) -> optim.AdamW:
    """AdamW as MLX defines it: no bias correction, so the first updates are larger than the
    nominal rate ((1 - β1^t) / sqrt(1 - β2^t): x6.5 at step 10, x3.2 at 100, x2.1 at 250).
    Measured with it on (issue 28, demo target, 250 steps of 16 x 32 anchors, block 8):
    held-out τ at W=8 2.92 / 3.75 at steps 100 / 250 against 3.58 / 3.90 without, so the
    recipe's 2e-3 stays as MLX steps it (benchmarks/train_curve.py, docs/training.md)."""
    return optim.AdamW(learning_rate=_schedule(settings), weight_decay=settings.weight_decay)


def _schedule(settings: TrainSettings):
    warm = max(1, int(settings.warmup * settings.steps))
    cosine = optim.cosine_decay(settings.lr, max(1, settings.steps - warm), settings.lr * 0.1)
    return optim.join_schedules([optim.linear_schedule(0.0, settings.lr, warm), cosine], [warm])


# What `train` is doing, as its `progress(entry)` calls say in `entry["phase"]`: each step's
# entry after the step (TRAINING), and before a held-out τ check or a checkpoint, the same
# entry with the phase about to run.
TRAINING, HELD_OUT, SAVING = "training", "held-out τ check", "saving a checkpoint"
FEATURES = "the target reads the data"  # before the first step, when the rows are kept


def held_out_tau(pair: Pair, tokenizer, prompts: list[list[int]], tokens: int) -> float:
    """Mean tokens per verify of greedy decoding with the real engine, full block: the τ
    `dflash-mlx generate` reports, pooled over the prompts (verified tokens / cycles)."""
    options = GenerateOptions(max_tokens=tokens, verify_width=pair.draft.config.block_size)
    return Stats.total([generate(pair, tokenizer, ids, options).stats for ids in prompts]).tau


def train(
    pair: Pair,
    tokenizer,
    config: dict,
    examples: list[Example],
    settings: TrainSettings,
    out: Path,
    *,
    held_out: list[list[int]] | None = None,
    held_examples: list[Example] | None = None,
    resume: bool = False,
    progress: Callable[[dict], None] | None = None,
    log: TrainLog | None = None,
    loss_fn: Callable[..., mx.array] = block_loss,
) -> TrainLog:
    """Train `pair.draft` for `settings.steps` steps, checkpointing to `out` (resumable).
    `loss_fn`: `block_loss`'s signature (DFlash 2: `dflash2.dflash2_loss`). With
    `held_examples` (the held-out prompts' whole examples) each held-out check also probes
    the loss on them and on as many training examples, and the log ends with the verdict
    of `verdict.verdict` (would more data or more steps help)."""
    draft = pair.draft
    optimizer = make_optimizer(settings)
    gamma = settings.loss_gamma or gamma_for_block(draft.config.block_size)
    log = log or TrainLog(settings={**asdict(settings), "loss_gamma": gamma})
    log.data = {
        "sequences": len(examples),
        "response_tokens": sum(len(e.tokens) - e.start for e in examples),
    }
    start = 0
    state_dir = out / "training_state"
    if resume:
        start, log = _load_state(draft, optimizer, out, state_dir)
    loss_and_grad = nn.value_and_grad(draft, loss_fn)
    rows = None
    if settings.feature_cache_mb > 0 and start < settings.steps:
        if TargetRows.nbytes(pair, examples) <= settings.feature_cache_mb * 2**20:
            if progress is not None:
                progress({"step": start, "loss": float("nan"), "lr": 0.0, "tokens_per_s": 0.0,
                          "step_s": 0.0, "phase": FEATURES})  # fmt: skip
            rows = TargetRows(pair, examples, settings.batch)

    def step_fn(tokens, lengths, seq_index, anchors, layout, chosen):
        if rows is None:
            feats, nxt = block_targets(pair, tokens)
        else:
            feats, nxt = rows.batch(chosen, tokens.shape[1])
        loss, grads = loss_and_grad(
            pair, feats, nxt, tokens, seq_index, anchors, lengths, gamma, layout
        )
        grads, _ = optim.clip_grad_norm(grads, settings.grad_clip)
        optimizer.update(draft, grads)
        return loss

    def probes(held: list[Example] | None) -> dict:
        if not held:
            return {}
        mine = [examples[i] for i in np.random.default_rng((settings.seed, 9)).permutation(
            len(examples))[: len(held)]]  # fmt: skip
        return {
            "held_loss": probe_loss(pair, held, loss_fn, gamma, settings.seed),
            "train_loss": probe_loss(pair, mine, loss_fn, gamma, settings.seed),
        }

    tic, seen = time.perf_counter(), 0
    for step in range(start, settings.steps):
        t0 = time.perf_counter()
        chosen, *batch = sample_rows(examples, settings, step)
        tokens = batch[0]
        m, slot = grouped_blocks(batch[2], len(tokens))
        loss = step_fn(*(mx.array(a) for a in batch), (m, mx.array(slot)), chosen)
        mx.eval(loss, draft.parameters(), optimizer.state)
        seen += tokens.size
        entry = {
            "step": step + 1,
            "loss": loss.item(),
            "lr": float(optimizer.learning_rate),
            "tokens_per_s": seen / (time.perf_counter() - tic),
            "step_s": time.perf_counter() - t0,
        }
        log.steps.append(entry)
        done = step + 1 == settings.steps
        if held_out and (done or (step + 1) % settings.eval_every == 0):
            if progress is not None:  # said before it runs: it can take a while
                progress({**entry, "phase": HELD_OUT})
            tau = held_out_tau(pair, tokenizer, held_out, settings.eval_tokens)
            log.evals.append({"step": step + 1, "tau": tau, **probes(held_examples)})
            entry["tau"] = tau
            if done and (said := verdict(log.evals)) is not None:
                log.verdict = entry["verdict"] = said.line
        if done or (step + 1) % settings.save_every == 0:
            if progress is not None:
                progress({**entry, "phase": SAVING})
            _save_state(draft, config, optimizer, out, state_dir, step + 1, log)
        if progress is not None:
            progress({**entry, "phase": TRAINING})
    return log


def _save_state(draft, config, optimizer, out: Path, state_dir: Path, step: int, log: TrainLog):
    save_draft_checkpoint(draft, config, out)
    state_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(state_dir / "optimizer.safetensors"), dict(tree_flatten(optimizer.state))
    )
    (state_dir / "state.json").write_text(json.dumps({"step": step}))
    (out / "training_log.json").write_text(json.dumps(asdict(log), indent=1))


def _load_state(draft, optimizer, out: Path, state_dir: Path) -> tuple[int, TrainLog]:
    if not (state_dir / "state.json").is_file():
        raise ValueError(f"--resume: no training state in {state_dir}")
    step = json.loads((state_dir / "state.json").read_text())["step"]
    draft.load_weights(str(out / "model.safetensors"))
    optimizer.state = tree_unflatten(
        list(mx.load(str(state_dir / "optimizer.safetensors")).items())
    )
    data = json.loads((out / "training_log.json").read_text())
    log = TrainLog(**data)
    log.steps = [s for s in log.steps if s["step"] <= step]
    log.evals = [e for e in log.evals if e["step"] <= step]
    return step, log
