"""A verifier's forward pass: the final hidden states (and logits) that produced submitted completions.

``Scorer.of(loaded).hidden(prompts, completions, prompt_index)`` returns, for every completion, the
``[len(completion), H]`` final hidden states (after the final norm, model dtype) at the positions
that produced its tokens: the last prompt position for token 0, the position of token ``i - 1``
for token ``i``, the rows ``models.engine`` hands its caller as ``Generation.hidden_states``.
``Scorer.logits(hidden)`` turns rows of them into float32 logits through the LM head.

Why not ``models.forward.prefill`` over every prompt + completion:

- **Shared prompts.** The samples of one task share their prompt. LLaMA-shaped models run on the
  engine's fused decoder (``models.llama.FastLlama``): each distinct prompt is prefilled once, its
  KV cache is copied to every completion of it, and only the completions run through the model a
  second time. A chat prompt of ~60 tokens before 4 completions of ~30 is ~2/3 of the tokens.
- **The machine's fastest kernels.** ``FastLlama`` runs every linear layer, the LM head included,
  through the kernel ``models.kernels`` measured for that weight shape and dtype (the same choice as
  the engine's, from the same cache file), so node and validator multiply the same way, and padding
  never reaches a matmul.
- **The LM head over many rows at once**: the caller passes the rows of a whole batch (in chunks
  sized to bound the ``[rows, vocab]`` float32 buffer), never one sequence at a time.

Other architectures go through ``models.forward.prefill`` (right-padded prompt + completion,
batched up to ``batch_tokens``) and the model's own head.

``Scorer.of`` keeps one scorer per model object and rebuilds it when any weight was modified in
place since (the fused copies would be stale).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from models.forward import check_context, left_pad, prefill
from models.llama import FastLlama
from models.loading import LoadedModel, output_head
from protocol.errors import ModelError

_FAST: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, ...], FastLlama]] = weakref.WeakKeyDictionary()
"""model -> (its weights' versions, its FastLlama). A FastLlama holds the model's tensors and submodules but not
the model itself, so an entry goes when its model does (a validator drops old policy versions)."""


def _weight_versions(model: torch.nn.Module) -> tuple[int, ...]:
    # A tensor's version counter moves on every in-place write: a scorer built before one is stale.
    return tuple(int(p._version) for p in model.parameters())


class Scorer:
    """Hidden states and logits of submitted completions; see the module docstring."""

    def __init__(
        self, loaded: LoadedModel, *, fast_path: bool | None = None, kernel: str | None = None,
        kernel_cache: Path | None = None, prebuilt: FastLlama | None = None,
    ) -> None:
        """``fast_path``, ``kernel`` and ``kernel_cache`` as for ``models.engine.Engine``; ``prebuilt``: a
        ``FastLlama`` already built on ``loaded``'s current weights (what ``of`` passes)."""
        self.loaded = loaded
        use_fast = FastLlama.supports(loaded) if fast_path is None else fast_path
        if use_fast and not FastLlama.supports(loaded):
            raise ModelError(f"no fast path for model type {loaded.model.config.model_type!r}")
        if not use_fast:
            self.fast: FastLlama | None = None
        else:
            self.fast = prebuilt or FastLlama(loaded, kernel=kernel, kernel_cache=kernel_cache)

    @classmethod
    def of(cls, loaded: LoadedModel) -> Scorer:
        """The scorer of ``loaded``'s model (built once, rebuilt after an in-place weight change)."""
        if not FastLlama.supports(loaded):
            return cls(loaded)
        versions = _weight_versions(loaded.model)
        held = _FAST.get(loaded.model)
        if held is None or held[0] != versions:
            held = _FAST[loaded.model] = (versions, FastLlama(loaded))
        return cls(loaded, prebuilt=held[1])

    # -- logits ---------------------------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, V]`` of hidden rows ``[N, H]`` (the engine's LM head kernel on the fast path)."""
        with torch.inference_mode():
            if self.fast is not None:
                return self.fast.logits(hidden)
            out: torch.Tensor = output_head(self.loaded.model)(hidden).float()
            return out

    # -- hidden states --------------------------------------------------------------------------------

    def hidden(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        prompt_index: Sequence[int],
        *,
        batch_tokens: int = 8192,
    ) -> list[torch.Tensor]:
        """Per completion ``c``, the ``[len(c), H]`` states that produced its tokens; completion ``i``
        follows ``prompts[prompt_index[i]]``. A batch holds about ``batch_tokens`` (padded) tokens."""
        if len(completions) != len(prompt_index):
            raise ModelError(f"{len(completions)} completions but {len(prompt_index)} prompt indices")
        vocab = self.loaded.vocab_size
        for p in prompts:
            if not p or min(p) < 0 or max(p) >= vocab:
                raise ModelError(f"prompts must be non-empty with ids in [0, {vocab})")
        for c, j in zip(completions, prompt_index, strict=True):
            if not 0 <= j < len(prompts):
                raise ModelError(f"prompt index {j} outside [0, {len(prompts)})")
            if not c or min(c) < 0 or max(c) >= vocab:
                raise ModelError(f"completions must be non-empty with ids in [0, {vocab})")
            check_context(self.loaded, len(prompts[j]) + len(c) - 1)
        out: list[torch.Tensor | None] = [None] * len(completions)
        with torch.inference_mode():
            for group in _groups(prompts, completions, prompt_index, batch_tokens):
                if self.fast is not None:
                    got = self._fast_group(prompts, completions, group)
                else:
                    got = self._generic_group(prompts, completions, group)
                for i, h in got.items():
                    out[i] = h
        return [h for h in out if h is not None]

    def _fast_group(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
        group: list[tuple[int, list[int]]],
    ) -> dict[int, torch.Tensor]:
        fast = self.fast
        assert fast is not None
        device = self.loaded.device
        # 1. Every distinct prompt once, left-padded (as the engine does), into its own cache.
        ps = [list(prompts[j]) for j, _ in group]
        ids, pvalid = left_pad(ps, device)
        width = ids.shape[1]
        positions = (pvalid.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        mask = (causal & pvalid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
        pcache = fast.new_cache(len(ps), width)
        keep = None if bool(pvalid.all()) else pvalid.reshape(-1).nonzero().squeeze(-1)
        h = fast.forward(ids, positions, 0, mask[:, None], pcache, keep)
        plen = pvalid.sum(-1)
        last = h[plen.cumsum(0) - 1]  # [P, H]: the state that produced every completion's token 0

        # 2. Every completion but its last token, after a copy of its prompt's cache.
        rows = [(r, i) for r, (_, samples) in enumerate(group) for i in samples]
        lengths = [len(completions[i]) - 1 for _, i in rows]
        t = max(lengths)
        result: dict[int, torch.Tensor] = {}
        if t == 0:
            for r, i in rows:
                result[i] = last[r : r + 1].clone()
            return result
        src = torch.tensor([r for r, _ in rows], dtype=torch.long, device=device)
        cids = torch.zeros((len(rows), t), dtype=torch.long)
        cvalid = torch.zeros((len(rows), t), dtype=torch.bool)
        for k, ((_, i), n) in enumerate(zip(rows, lengths, strict=True)):
            if n:
                cids[k, :n] = torch.tensor(list(completions[i][:-1]), dtype=torch.long)
                cvalid[k, :n] = True
        cids, cvalid = cids.to(device), cvalid.to(device)
        cpos = plen[src, None] + torch.arange(t, device=device)[None, :]
        cache = fast.new_cache(len(rows), width + t)
        for (k_new, v_new), (k_old, v_old) in zip(cache, pcache, strict=True):
            k_new[:, :, :width] = k_old[src]
            v_new[:, :, :width] = v_old[src]
        del pcache
        ccausal = torch.ones((t, t), dtype=torch.bool, device=device).tril()
        cmask = torch.cat(
            [pvalid[src, None, :].expand(-1, t, -1), ccausal[None] & cvalid[:, None, :]], dim=-1
        )  # a padding query still sees its (non-empty) prompt: no empty attention row
        ckeep = cvalid.reshape(-1).nonzero().squeeze(-1)
        hc = fast.forward(cids, cpos, width, cmask[:, None], cache, ckeep)
        at = 0
        for (r, i), n in zip(rows, lengths, strict=True):
            result[i] = torch.cat([last[r : r + 1], hc[at : at + n]])
            at += n
        return result

    def _generic_group(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
        group: list[tuple[int, list[int]]],
    ) -> dict[int, torch.Tensor]:
        items = [(j, i) for j, samples in group for i in samples]
        seqs = [list(prompts[j]) + list(completions[i][:-1]) for j, i in items]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):  # right padding: real positions start at 0 in every row
            ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[row, : len(s)] = 1
        out = prefill(self.loaded, ids, mask, logits_last_only=True)
        result = {}
        for row, (j, i) in enumerate(items):
            start = len(prompts[j]) - 1
            result[i] = out.hidden[row, start : start + len(completions[i])]
        return result


def _groups(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], prompt_index: Sequence[int],
    batch_tokens: int,
) -> list[list[tuple[int, list[int]]]]:
    """Batches of (prompt, its completions), about ``batch_tokens`` padded tokens each, similar lengths
    together; a prompt with more completions than fit is split over batches (and prefilled in each)."""
    by_prompt: dict[int, list[int]] = {}
    for i, j in enumerate(prompt_index):
        by_prompt.setdefault(j, []).append(i)
    order = sorted(by_prompt, key=lambda j: (len(prompts[j]) + max(len(completions[i]) for i in by_prompt[j]), j))
    groups: list[list[tuple[int, list[int]]]] = []
    width = t = n = 0
    for j in order:
        for i in by_prompt[j]:
            w2, t2 = max(width, len(prompts[j])), max(t, len(completions[i]) - 1)
            if groups and (n + 1) * (w2 + t2) <= batch_tokens:
                width, t, n = w2, t2, n + 1
                if groups[-1][-1][0] == j:
                    groups[-1][-1][1].append(i)
                else:
                    groups[-1].append((j, [i]))
            else:
                groups.append([(j, [i])])
                width, t, n = len(prompts[j]), len(completions[i]) - 1, 1
    return groups
