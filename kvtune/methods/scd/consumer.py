"""The consumer model of an SCD pair: a reproducible LoRA fine-tune of the producer.

SCD ("Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching",
arXiv 2606.07684) needs a producer A and a consumer B with the same architecture and
different weights (a base model and its fine-tune). kvtune makes B itself: LoRA adapters
(``peft``) trained on real domain text (XSum news documents, the ``xsum`` data asset) with a
fixed seed, merged into the weights, and saved as a Hugging Face folder under the kvtune
cache, in a folder named by the sha256 of its recipe (:meth:`ConsumerRecipe.digest`): the
same recipe, producer and data give the same folder, so the fine-tune runs once.

The data split is deterministic: a record of the JSONL file is held out for evaluation when
the first byte of ``sha256("scd-split", line)`` is below ``256 * holdout_fraction``; the
fine-tune sees only the other records (:func:`domain_split`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kvtune.core.errors import ConfigError, KvtuneError

log = logging.getLogger(__name__)

RECIPE_VERSION = 1
"""Bumped when the training procedure changes in a way that changes the weights."""

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConsumerError(KvtuneError):
    """The consumer model cannot be made or loaded (bad recipe, missing peft, unusable data)."""


@dataclass(frozen=True)
class ConsumerRecipe:
    """Everything that decides the consumer's weights (its digest names the cache folder).

    Attributes:
        producer: ``--model`` spec of the producer (asset name, path or HF id).
        data: data asset or JSONL path with a ``document`` field (default ``xsum``).
        holdout_fraction: fraction of records kept out of training (domain evaluation).
        steps: optimizer steps.
        batch_size: sequences per step.
        seq_tokens: tokens per training sequence (documents are concatenated, separated by
            the EOS token, and cut into windows of this length).
        lora_rank, lora_alpha: LoRA rank r and scale alpha (update = alpha / r * B A).
        target_modules: module names that get LoRA adapters.
        first_layer: only layers ``first_layer ..`` get adapters (0 = all). Back-propagation
            stops at the first adapted layer, so this sets most of the cost of a step; the
            consumer's layers below it equal the producer's, as in fine-tunes that change
            mostly the upper layers.
        learning_rate: AdamW peak learning rate (linear warm-up over 10 % of the steps, then
            cosine decay to 10 %).
        seed: seed of the LoRA initialisation and the window order.
        version: :data:`RECIPE_VERSION`.
    """

    producer: str = "smollm2-135m-instruct"
    data: str = "xsum"
    holdout_fraction: float = 0.2
    steps: int = 96
    batch_size: int = 4
    seq_tokens: int = 128
    lora_rank: int = 64
    lora_alpha: float = 128.0
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    first_layer: int = 0
    learning_rate: float = 2e-3
    seed: int = 0
    version: int = RECIPE_VERSION

    def __post_init__(self) -> None:
        if not 0.0 < self.holdout_fraction < 1.0:
            raise ConfigError(f"holdout_fraction must be in (0, 1), not {self.holdout_fraction}")
        if self.first_layer < 0:
            raise ConfigError(f"consumer recipe: first_layer must be >= 0, not {self.first_layer}")
        for name in ("steps", "batch_size", "seq_tokens", "lora_rank"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"consumer recipe: {name} must be >= 1, not {getattr(self, name)}")
        if not self.target_modules:
            raise ConfigError("consumer recipe: target_modules is empty")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d

    def digest(self) -> str:
        """sha256 hex of the canonical JSON of the recipe."""
        return hashlib.sha256(json.dumps(self.to_json_dict(), sort_keys=True).encode()).hexdigest()


def consumer_dir(recipe: ConsumerRecipe, root: Path | None = None) -> Path:
    """Cache folder of the consumer made by ``recipe``: ``<kvtune cache>/scd-consumers/<name>-<digest16>``."""
    from kvtune.evaluate.assets import cache_root

    base = root if root is not None else cache_root() / "scd-consumers"
    name = Path(recipe.producer).name.removesuffix(".gguf") or "model"
    return base / f"{name}-lora{recipe.lora_rank}-{recipe.digest()[:16]}"


def is_held_out(line: int, holdout_fraction: float) -> bool:
    """Deterministic split of JSONL records by 1-based line number (see the module doc)."""
    return hashlib.sha256(f"scd-split:{line}".encode()).digest()[0] < 256 * holdout_fraction


def domain_split(data: str, holdout_fraction: float) -> tuple[list[str], list[str], Any]:
    """``(train_documents, heldout_documents, DataSource)`` of a JSONL dataset with ``document``.

    Raises:
        ConsumerError: either side of the split is empty.
    """
    from kvtune.evaluate.workloads.data import Field, resolve_data

    source, records = resolve_data(data, (Field("document", "str", allow_empty=True),), workload="scd")
    train, held = [], []
    for rec in records:
        doc = rec["document"].strip()
        if doc:
            (held if is_held_out(rec["_line"], holdout_fraction) else train).append(doc)
    if not train or not held:
        raise ConsumerError(f"--data {data!r}: the split left {len(train)} training and {len(held)} held-out documents")
    return train, held, source


def token_windows(tokenizer: Any, documents: list[str], seq_tokens: int, max_windows: int) -> torch.Tensor:
    """``(N, seq_tokens)`` int64 windows of the documents concatenated with EOS between them.

    Tokenizes documents in order until ``max_windows`` full windows exist (or the documents
    run out); N <= max_windows.
    """
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    need = seq_tokens * max_windows
    for doc in documents:
        stream.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(int(eos))
        if len(stream) >= need:
            break
    n = min(max_windows, len(stream) // seq_tokens)
    if n == 0:
        raise ConsumerError(f"the documents hold fewer than {seq_tokens} tokens")
    return torch.tensor(stream[: n * seq_tokens], dtype=torch.long).view(n, seq_tokens)


def lr_at(step: int, steps: int, peak: float) -> float:
    """Learning rate of ``step`` (0-based): linear warm-up over 10 % of the steps, cosine to 10 % of peak."""
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def mean_nll(model: Any, windows: torch.Tensor, *, batch_size: int = 4) -> float:
    """Mean next-token NLL (nats/token) of a causal LM over ``(N, T)`` windows."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i: i + batch_size].to(next(model.parameters()).device)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="sum")
        total += float(nll)
        count += ids[:, 1:].numel()
    return total / count


def _require_peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConsumerError("making a consumer needs the 'peft' package: pip install peft") from exc
    return peft


def train_lora(model: Any, windows: torch.Tensor, recipe: ConsumerRecipe,
               progress: Callable[[int, float], None] | None = None) -> tuple[Any, list[float]]:
    """Train LoRA adapters on ``windows`` and merge them into the weights.

    Args:
        model: a causal LM (float32), modified in place.
        windows: ``(N, seq_tokens)`` int64 training windows; step i uses a seeded permutation.
        recipe: hyper-parameters.
        progress: optional ``progress(step, loss)`` after each step.

    Returns:
        ``(merged model, per-step training losses in nats/token)``.
    """
    peft = _require_peft()
    torch.manual_seed(recipe.seed)
    n_layers = int(model.config.num_hidden_layers)
    if recipe.first_layer >= n_layers:
        raise ConsumerError(f"first_layer {recipe.first_layer} >= the model's {n_layers} layers")
    layers = list(range(recipe.first_layer, n_layers)) if recipe.first_layer else None
    cfg = peft.LoraConfig(r=recipe.lora_rank, lora_alpha=recipe.lora_alpha, lora_dropout=0.0,
                          target_modules=list(recipe.target_modules), layers_to_transform=layers, bias="none",
                          task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, cfg)
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.learning_rate, weight_decay=0.0)
    g = torch.Generator().manual_seed(recipe.seed)
    order = torch.cat([torch.randperm(windows.shape[0], generator=g)
                       for _ in range(math.ceil(recipe.steps * recipe.batch_size / windows.shape[0]) + 1)])
    losses = []
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe.steps, recipe.learning_rate)
        ids = windows[order[step * recipe.batch_size: (step + 1) * recipe.batch_size]]
        loss = pm(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress:
            progress(step, losses[-1])
    merged = pm.merge_and_unload()
    merged.eval()
    return merged, losses


@dataclass
class ConsumerInfo:
    """What :func:`make_consumer` returns and saves as ``scd_consumer.json`` in the folder.

    Attributes:
        path: the consumer's Hugging Face folder (``--consumer`` value).
        recipe: the recipe.
        digest: sha256 of the recipe.
        cached: True when the folder already existed and nothing was trained.
        train_seconds: wall seconds of the fine-tune (of the run that made it).
        train_windows, train_tokens: training data size.
        losses: per-step training loss (nats/token).
        heldout_windows: held-out windows of ``seq_tokens`` tokens the perplexities use.
        producer_ppl, consumer_ppl: perplexity on the held-out documents (exp of mean NLL).
    """

    path: Path
    recipe: ConsumerRecipe
    digest: str
    cached: bool = False
    train_seconds: float = 0.0
    train_windows: int = 0
    train_tokens: int = 0
    losses: list[float] = field(default_factory=list)
    heldout_windows: int = 0
    producer_ppl: float = float("nan")
    consumer_ppl: float = float("nan")
    data_sha256: str = ""

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        d["recipe"] = self.recipe.to_json_dict()
        return d


def make_consumer(recipe: ConsumerRecipe | None = None, *, root: Path | None = None, device: str = "cpu",
                  heldout_windows: int = 16, force: bool = False,
                  progress: Callable[[int, float], None] | None = None) -> ConsumerInfo:
    """Create (or reuse) the consumer of ``recipe`` and measure how it differs from the producer.

    Loads the producer, trains LoRA on the training split of ``recipe.data``, merges it,
    saves model + tokenizer atomically (temp folder, then rename) into :func:`consumer_dir`,
    and measures producer and consumer perplexity on ``heldout_windows`` held-out windows.
    A folder that already exists is reused (``cached=True``) unless ``force``.

    Returns:
        :class:`ConsumerInfo` (also saved as ``scd_consumer.json`` in the folder).

    Raises:
        ConsumerError: peft is missing or the data cannot be split.
    """
    from kvtune.core.atomic import atomic_write_text
    from kvtune.evaluate.model import load_model

    recipe = recipe or ConsumerRecipe()
    folder = consumer_dir(recipe, root)
    info_path = folder / "scd_consumer.json"
    if info_path.is_file() and not force:
        d = json.loads(info_path.read_text())
        d["recipe"] = ConsumerRecipe(**{**d["recipe"], "target_modules": tuple(d["recipe"]["target_modules"])})
        d["path"] = folder
        d["cached"] = True
        return ConsumerInfo(**d)
    _require_peft()
    train_docs, held_docs, source = domain_split(recipe.data, recipe.holdout_fraction)
    lm = load_model(recipe.producer, device)
    windows = token_windows(lm.tokenizer, train_docs, recipe.seq_tokens, recipe.steps * recipe.batch_size)
    held = token_windows(lm.tokenizer, held_docs, recipe.seq_tokens, heldout_windows)
    producer_nll = mean_nll(lm.model, held)
    t0 = time.perf_counter()
    model, losses = train_lora(lm.model, windows, recipe, progress)
    train_seconds = time.perf_counter() - t0
    consumer_nll = mean_nll(model, held)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".consumer-"))
    try:
        qconfig = model.config.__dict__.get("quantization_config")
        if qconfig is not None:  # weights are plain floats after the GGUF dequantization
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        lm.tokenizer.save_pretrained(tmp)
        info = ConsumerInfo(
            path=folder, recipe=recipe, digest=recipe.digest(), train_seconds=train_seconds,
            train_windows=int(windows.shape[0]), train_tokens=int(windows.numel()), losses=losses,
            heldout_windows=int(held.shape[0]), producer_ppl=math.exp(producer_nll),
            consumer_ppl=math.exp(consumer_nll), data_sha256=source.sha256,
        )
        atomic_write_text(tmp / "scd_consumer.json", json.dumps(info.to_json_dict(), indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info
