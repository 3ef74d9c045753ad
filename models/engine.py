"""Batched generation for CPU (and any torch device) with a static KV cache.

``Engine(loaded).generate(prompts, params, seeds, max_new_tokens)`` runs many sequences at once:

- one left-padded prefill (split into row groups of at most ``prefill_tokens`` tokens; on the fast
  path everything but attention runs on the real tokens only), then one decode step per generated
  token for all live sequences;
- a preallocated KV cache per layer (no per-step concatenation, unlike ``DynamicCache``);
- a sequence that emits an EOS token or reaches ``max_new_tokens`` leaves the batch at once
  (its cache rows are compacted away), so work tracks the live sequences;
- sampling by ``models.sampling`` with the caller's per-sequence seed; generated token ``i`` of a
  sequence uses ``step = i`` (``step_offsets[k] + i`` when given: a multi-turn episode's later turn
  continues its sample's sampler stream), so a verifier replays it from (seed, step) alone.

For every generated token the engine returns the final hidden state (after the final norm, in
the model dtype) *at the position that produced it*: token 0 comes from the last prompt position,
token ``i`` from the position of token ``i - 1``. That is exactly what a verifier's prefill over
prompt + completion yields at positions ``len(prompt) - 1 ... len(prompt) + n - 2``.

LLaMA-shaped models (llama, mistral, qwen2: RMSNorm, rotary, grouped-query attention, SwiGLU)
run on a fused fast path that reads the Hugging Face weights (q/k/v and gate/up concatenated once,
so the engine holds a copy of those; build a new Engine after changing the weights). Any other
architecture runs through ``models.forward`` with the Hugging Face cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from models.forward import check_context, decode, left_pad, prefill
from models.kernels import KernelChoice
from models.llama import FastLlama
from models.loading import LoadedModel
from models.sampling import SamplingParams, sample, seed_tensor
from protocol.errors import ModelError

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One finished sequence."""

    prompt_tokens: list[int]
    tokens: list[int]
    """Generated token ids (including the EOS token when finish_reason is "eos")."""
    logprobs: list[float]
    """Sampling logprob of each generated token (see ``models.sampling``)."""
    hidden_states: torch.Tensor
    """[len(tokens), hidden] in the model dtype: the state that produced each generated token."""
    finish_reason: Literal["eos", "length"]
    seed: int


class Engine:
    """Generates completions for many prompts at once; see the module docstring."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        prefill_tokens: int = 8192,
        fast_path: bool | None = None,
        kernel: str | None = None,
        kernel_cache: Path | None = None,
    ) -> None:
        """``kernel`` forces the fast path's matmul kernel (see ``models.kernels``; default
        ``$PRIME_ENGINE_KERNEL`` or ``auto``: measured once per machine and cached in ``kernel_cache``)."""
        self.loaded = loaded
        self.prefill_tokens = prefill_tokens
        use_fast = FastLlama.supports(loaded) if fast_path is None else fast_path
        if use_fast and not FastLlama.supports(loaded):
            raise ModelError(f"no fast path for model type {loaded.model.config.model_type!r}")
        self._fast = FastLlama(loaded, kernel=kernel, kernel_cache=kernel_cache) if use_fast else None
        self.kernels: KernelChoice | None = self._fast.kernels if self._fast is not None else None
        """The fast path's matmul kernels (None on the generic path)."""
        self._eos = torch.tensor(sorted(loaded.eos_token_ids), dtype=torch.long, device=loaded.device)

    def _validate(self, prompts: list[list[int]], seeds: list[int], max_new_tokens: int) -> None:
        if len(prompts) != len(seeds):
            raise ModelError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        for s in seeds:
            if not -(1 << 63) <= s < (1 << 64):
                raise ModelError(f"seed {s} does not fit 64 bits")
        if max_new_tokens < 1:
            raise ModelError("max_new_tokens must be >= 1")
        vocab = self.loaded.vocab_size
        for p in prompts:
            if not p:
                raise ModelError("empty prompt")
            if min(p) < 0 or max(p) >= vocab:
                raise ModelError(f"prompt token ids outside the vocabulary [0, {vocab})")
            check_context(self.loaded, len(p) + max_new_tokens)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], max_new_tokens: int,
        step_offsets: list[int] | None = None,
    ) -> list[Generation]:
        """Generate up to ``max_new_tokens`` per prompt; sequence ``i`` samples with ``seeds[i]`` from sampler
        step ``step_offsets[i]`` (default 0) on."""
        self._validate(prompts, seeds, max_new_tokens)
        offsets = [0] * len(prompts) if step_offsets is None else list(step_offsets)
        if len(offsets) != len(prompts) or any(not 0 <= o < (1 << 62) for o in offsets):
            raise ModelError(f"need one step offset in [0, 2**62) per prompt, got {len(offsets)}")
        if not prompts:
            return []
        with torch.inference_mode():
            if self._fast is not None:
                return self._generate_fast(prompts, params, seeds, max_new_tokens, offsets)
            return self._generate_hf(prompts, params, seeds, max_new_tokens, offsets)

    # -- shared bookkeeping -------------------------------------------------------------------------

    def _results(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        hidden: torch.Tensor,
        lengths: list[int],
        eos_hit: list[bool],
    ) -> list[Generation]:
        tok_rows = tokens.cpu().tolist()
        lp_rows = logprobs.cpu().tolist()
        out = []
        for i, p in enumerate(prompts):
            n = lengths[i]
            out.append(
                Generation(
                    prompt_tokens=list(p),
                    tokens=tok_rows[i][:n],
                    logprobs=lp_rows[i][:n],
                    hidden_states=hidden[i, :n].clone(),
                    finish_reason="eos" if eos_hit[i] else "length",
                    seed=seeds[i],
                )
            )
        return out

    # -- fast path ------------------------------------------------------------------------------------

    def _generate_fast(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], max_new: int, offsets: list[int]
    ) -> list[Generation]:
        fast = self._fast
        assert fast is not None
        device, dtype = self.loaded.device, self.loaded.dtype
        b = len(prompts)
        ids, valid = left_pad(prompts, self.loaded.device)
        width = ids.shape[1]
        total = width + max_new
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        cache = fast.new_cache(b, total)
        # Every column a row may attend to: its real prompt tokens, then its generated tokens.
        key_valid = torch.ones((b, total), dtype=torch.bool, device=device)
        key_valid[:, :width] = valid

        # Prefill in row groups so the [rows, heads, T, T] attention stays bounded.
        rows_per_group = max(1, self.prefill_tokens // width)
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        diag = torch.eye(width, dtype=torch.bool, device=device)
        last_hidden = torch.empty((b, fast.embed.shape[1]), dtype=dtype, device=device)
        for r0 in range(0, b, rows_per_group):
            r1 = min(b, r0 + rows_per_group)
            # Padding queries attend to themselves only, so no attention row is empty (NaN).
            mask = (causal & valid[r0:r1, None, :]) | diag
            group_cache = [(k[r0:r1], v[r0:r1]) for k, v in cache]
            rows_valid = valid[r0:r1]
            keep = None if bool(rows_valid.all()) else rows_valid.reshape(-1).nonzero().squeeze(-1)
            h = fast.forward(ids[r0:r1], positions[r0:r1], 0, mask[:, None], group_cache, keep)
            last_hidden[r0:r1] = h[rows_valid.sum(-1).cumsum(0) - 1]  # left padding: a row ends last

        out_tokens = torch.zeros((b, max_new), dtype=torch.long, device=device)
        out_lp = torch.zeros((b, max_new), dtype=torch.float32, device=device)
        out_hidden = torch.zeros((b, max_new, last_hidden.shape[1]), dtype=dtype, device=device)
        lengths = [0] * b
        eos_hit = [False] * b
        rows = torch.arange(b, device=device)  # live batch index -> sequence index
        live = list(range(b))
        seed_t = seed_tensor(seeds)
        offset_t = torch.tensor(offsets, dtype=torch.long)
        next_pos = positions[:, -1] + 1
        hidden = last_hidden
        for step in range(max_new):
            logits = fast.logits(hidden)
            tok, lp = sample(logits, params, seed_t[live], offset_t[live] + step)
            out_tokens[rows, step] = tok
            out_lp[rows, step] = lp
            out_hidden[rows, step] = hidden
            done = torch.isin(tok, self._eos)
            done_list = done.tolist()
            for j, seq in enumerate(live):
                lengths[seq] = step + 1
                if done_list[j]:
                    eos_hit[seq] = True
            if step + 1 == max_new:
                break
            if any(done_list):
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                # Compact: finished rows leave the batch, so compute follows the live sequences.
                live = [live[j] for j in keep.tolist()]
                rows, tok, next_pos = rows[keep], tok[keep], next_pos[keep]
                key_valid = key_valid[keep]
                col = width + step  # cache columns filled so far
                new_cache = fast.new_cache(len(live), total)
                for (k_new, v_new), (k_old, v_old) in zip(new_cache, cache, strict=True):
                    k_new[:, :, :col] = k_old[keep, :, :col]
                    v_new[:, :, :col] = v_old[keep, :, :col]
                cache = new_cache
            col = width + step
            mask = key_valid[:, None, None, : col + 1]
            hidden = fast.forward(tok[:, None], next_pos[:, None], col, mask, cache)
            next_pos = next_pos + 1
        return self._results(prompts, seeds, out_tokens, out_lp, out_hidden, lengths, eos_hit)

    # -- generic path ----------------------------------------------------------------------------------

    def _generate_hf(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], max_new: int, offsets: list[int]
    ) -> list[Generation]:
        device, dtype = self.loaded.device, self.loaded.dtype
        b = len(prompts)
        ids, valid = left_pad(prompts, self.loaded.device)
        state = prefill(self.loaded, ids, valid.long(), use_cache=True, logits_last_only=True)
        hidden = state.hidden[:, -1]
        logits = state.logits[:, -1]
        out_tokens = torch.zeros((b, max_new), dtype=torch.long, device=device)
        out_lp = torch.zeros((b, max_new), dtype=torch.float32, device=device)
        out_hidden = torch.zeros((b, max_new, hidden.shape[-1]), dtype=dtype, device=device)
        lengths = [0] * b
        eos_hit = [False] * b
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        seed_t = seed_tensor(seeds)
        offset_t = torch.tensor(offsets, dtype=torch.long)
        for step in range(max_new):
            tok, lp = sample(logits, params, seed_t, offset_t + step)
            live = ~finished
            out_tokens[live, step] = tok[live]
            out_lp[live, step] = lp[live]
            out_hidden[live, step] = hidden[live]
            for i in live.nonzero().squeeze(-1).tolist():
                lengths[i] = step + 1
            newly = live & torch.isin(tok, self._eos)
            for i in newly.nonzero().squeeze(-1).tolist():
                eos_hit[i] = True
            finished |= newly
            if bool(finished.all()) or step + 1 == max_new:
                break
            state = decode(self.loaded, tok[:, None], state)
            hidden, logits = state.hidden[:, -1], state.logits[:, -1]
        return self._results(prompts, seeds, out_tokens, out_lp, out_hidden, lengths, eos_hit)
