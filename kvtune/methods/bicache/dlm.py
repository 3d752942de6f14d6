"""Diffusion-LM path: prefix reuse with periodic deep-layer refresh in an unmasking loop.

BiCache ("Enabling KV Caching of Shared Prefix for Diffusion Language Models", arXiv 2606.07571),
Sec. 3-4; loop of LLaDA ("Large Language Diffusion Models", Nie et al. 2025, arXiv 2502.09992, Sec. 2.4,
"low-confidence remasking"). A masked diffusion LM generates ``gen_length`` tokens by starting
from all ``[MASK]`` and, over ``steps`` denoising steps, predicting every masked token and
keeping the most confident ``k`` predictions per step (``k`` spread evenly over the steps).
Every token attends to every other, so the shared prefix's state changes as the response
fills in. BiCache's recipe, behind the same :class:`~kvtune.methods.bicache.adapters.EncoderAdapter`
interface as the encoder path:

* layers ``1..d``: the prefix's K/V (and the hidden entering layer ``d + 1``) come from the
  cross-request cache (the prefix computed alone), at every step;
* layers ``d + 1..L``: on a *refresh* step (every ``refresh_every`` steps, and the first) the
  prefix is recomputed in context and its deep K/V are kept; on the other steps they are
  reused from the last refresh, so only the request's own tokens are computed in all layers.

``refresh_every = 1`` with ``d = 0`` is the plain loop (full recompute each step).

Real results need a user's own masked-diffusion weights (e.g. LLaDA-8B through a registered
adapter): none ship offline, so kvtune tests this path for mechanics on a tiny randomly
initialised ``BertForMaskedLM``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtune.methods.bicache.adapters import EncoderAdapter
from kvtune.methods.bicache.state import PrefixState, merge_states
from kvtune.core.errors import BiCacheError

__all__ = ["DenoiseResult", "tokens_per_step", "unmask_loop"]


def tokens_per_step(gen_length: int, steps: int) -> list[int]:
    """How many tokens to unmask at each step: ``gen_length`` spread evenly (LLaDA's schedule).

    >>> tokens_per_step(10, 4)
    [3, 3, 2, 2]
    """
    if steps <= 0 or gen_length <= 0:
        raise BiCacheError(f"need steps > 0 and gen_length > 0, got {steps}, {gen_length}")
    base, extra = divmod(gen_length, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


@dataclass(frozen=True)
class DenoiseResult:
    """Result of :func:`unmask_loop`.

    Attributes:
        tokens: ``(gen_length,)`` long, the generated tokens (no ``[MASK]`` left).
        refresh_steps: indices of the steps that recomputed the deep prefix layers.
        token_layers: token x layer evaluations done (the compute actually spent).
        token_layers_full: the same count for full recompute at every step.
    """

    tokens: torch.Tensor
    refresh_steps: tuple[int, ...]
    token_layers: int
    token_layers_full: int

    @property
    def compute_fraction(self) -> float:
        """Fraction of full recompute's token-layer evaluations spent (< 1 = saved)."""
        return self.token_layers / self.token_layers_full


@torch.inference_mode()
def unmask_loop(
    adapter: EncoderAdapter,
    prefix_ids: Sequence[int],
    *,
    gen_length: int,
    steps: int,
    mask_token_id: int,
    depth: int = 0,
    prefix_state: PrefixState | None = None,
    refresh_every: int = 16,
    request_ids: Sequence[int] = (),
) -> DenoiseResult:
    """LLaDA-style greedy low-confidence-remasking generation with BiCache reuse.

    Args:
        adapter: an adapter with ``mlm_logits`` (e.g. :class:`BertFamilyAdapter` over a
            ``BertForMaskedLM``).
        prefix_ids: the shared prefix (system prompt), P tokens.
        gen_length: tokens to generate.
        steps: denoising steps (<= gen_length).
        mask_token_id: the ``[MASK]`` id.
        depth: cross-request reuse depth d in ``0..L``.
        prefix_state: the prefix computed alone (required for ``d >= 1``).
        refresh_every: recompute the deep prefix layers every this many steps (>= 1).
        request_ids: the request's own prompt tokens between the prefix and the response.

    Returns:
        :class:`DenoiseResult`.

    Raises:
        BiCacheError: bad arguments (see :meth:`EncoderAdapter.run`).
    """
    if refresh_every < 1:
        raise BiCacheError(f"refresh_every must be >= 1, got {refresh_every}")
    if steps > gen_length:
        raise BiCacheError(f"steps ({steps}) must not exceed gen_length ({gen_length})")
    L = adapter.num_layers
    P = len(prefix_ids)
    own = torch.as_tensor(list(request_ids), dtype=torch.long, device=adapter.device)
    x = torch.full((gen_length,), mask_token_id, dtype=torch.long, device=adapter.device)
    schedule = tokens_per_step(gen_length, steps)
    N = len(own) + gen_length
    refreshes: list[int] = []
    in_context: PrefixState | None = None
    token_layers = 0
    for step, k in enumerate(schedule):
        suffix = torch.cat([own, x]).unsqueeze(0)
        if in_context is None or step % refresh_every == 0:
            out = adapter.run(prefix_ids, suffix, depth=depth, state=prefix_state, capture=True)
            in_context = out.prefix_state
            refreshes.append(step)
            token_layers += depth * N + (L - depth) * (P + N)
        else:
            shallow = prefix_state if depth else in_context
            merged = merge_states(shallow, in_context, depth) if depth else in_context
            out = adapter.run(prefix_ids, suffix, depth=L, state=merged)
            token_layers += L * N
        logits = adapter.mlm_logits(out.hidden[:, P + len(own):])[0]  # (gen_length, vocab)
        logits[:, mask_token_id] = -torch.inf  # never "predict" a mask
        probs = torch.softmax(logits.float(), dim=-1)
        conf, pred = probs.max(dim=-1)
        masked = x == mask_token_id
        conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
        chosen = torch.topk(conf, k).indices
        x[chosen] = pred[chosen]
    return DenoiseResult(x.clone(), tuple(refreshes), token_layers, len(schedule) * L * (P + N))
