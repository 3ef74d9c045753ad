"""Batched generation for CPU (and any torch device) with a static KV cache.

``Engine(loaded).generate(prompts, params, seeds, max_new_tokens)`` runs many sequences at once:

- one left-padded prefill (split into row groups of at most ``prefill_tokens`` tokens; on the fast
  path everything but attention runs on the real tokens only), then one decode step per generated
  token for all live sequences;
- a preallocated KV cache per layer (no per-step concatenation, unlike ``DynamicCache``);
- a sequence that emits an EOS token or reaches ``max_new_tokens`` leaves the batch at once
  (its cache rows are compacted away), so work tracks the live sequences;
- sampling by ``models.sampling`` with the caller's per-sequence seed; generated token ``i`` of a
  sequence uses ``step = i``, so a verifier replays it from (seed, i) alone.

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
import torch.nn.functional as F

from models.forward import check_context, decode, prefill
from models.kernels import KernelChoice, Linear, choose
from models.loading import LoadedModel, output_head
from models.sampling import SamplingParams, sample, seed_tensor
from protocol.errors import ModelError

logger = logging.getLogger(__name__)

FAST_PATH_TYPES = frozenset({"llama", "mistral", "qwen2"})


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


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: Linear
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear
    down: Linear


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _FastLlama:
    """A LLaMA-shaped decoder over the Hugging Face weights with a caller-owned static KV cache."""

    def __init__(
        self, loaded: LoadedModel, *, kernel: str | None = None, kernel_cache: Path | None = None
    ) -> None:
        model = loaded.model
        cfg = model.config
        self.inner = model.model
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.embed = self.inner.embed_tokens.weight
        self.final_norm = self.inner.norm.weight
        self.scaling = self.head_dim**-0.5
        self.layers: list[_Layer] = []
        with torch.no_grad():
            # (weight [out, in], bias) of every linear, q/k/v and gate/up fused, layer by layer.
            weights: list[tuple[torch.Tensor, torch.Tensor | None]] = []
            for layer in self.inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                biases = [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]
                weights += [
                    (
                        torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                        torch.cat(biases) if all(b is not None for b in biases) else None,
                    ),
                    (att.o_proj.weight, att.o_proj.bias),
                    (torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None),
                    (mlp.down_proj.weight, None),
                ]
            head = output_head(model).weight
            shapes = [(int(w.shape[1]), int(w.shape[0])) for w, _ in weights] + [
                (int(head.shape[1]), int(head.shape[0]))
            ]
            self.kernels = choose(shapes, head.dtype, head.device, kernel=kernel, cache_dir=kernel_cache)

            def linear(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
                return Linear(w, b, self.kernels.path((int(w.shape[1]), int(w.shape[0]))))

            self.lm_head = linear(head, None)
            for i, layer in enumerate(self.inner.layers):
                qkv, o, gate_up, down = weights[4 * i : 4 * i + 4]
                self.layers.append(
                    _Layer(
                        ln1=layer.input_layernorm.weight,
                        qkv=linear(*qkv),
                        o=linear(*o),
                        ln2=layer.post_attention_layernorm.weight,
                        gate_up=linear(*gate_up),
                        down=linear(*down),
                    )
                )
            del weights
        self.inter = self.layers[0].gate_up.out_features // 2

    @staticmethod
    def supports(loaded: LoadedModel) -> bool:
        cfg = loaded.model.config
        if cfg.model_type not in FAST_PATH_TYPES:
            return False
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) is not False:
            return cfg.model_type == "llama"  # mistral/qwen2 sliding windows are not implemented here
        return getattr(cfg, "hidden_act", "silu") == "silu" and not getattr(cfg, "mlp_bias", False)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm (fp32 statistics, cast back, then scale).
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(dtype)

    def new_cache(self, batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, self.n_kv, length, self.head_dim)
        dtype, device = self.embed.dtype, self.embed.device
        return [
            (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in self.layers
        ]

    def forward(
        self,
        ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] rotary positions
        start: int,  # cache column of ids[:, 0]
        mask: torch.Tensor,  # bool [B, 1, T, start + T], True = attend
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        keep: torch.Tensor | None = None,  # indices into the flattened [B * T] tokens to compute
    ) -> torch.Tensor:
        """Final hidden states (after the final norm) of the kept tokens, packed: [len(keep), H]
        ([B * T, H] without ``keep``); writes k/v into ``cache`` (zeros at tokens not kept).

        Everything but attention is per token, so it runs on the kept tokens only: a left-padded
        prefill skips the padding (~10% of a chat batch's prompt tokens, more for mixed lengths).
        """
        b, t = ids.shape
        end = start + t
        flat_ids, flat_pos = ids.reshape(-1), positions.reshape(-1)
        if keep is not None:
            flat_ids, flat_pos = flat_ids[keep], flat_pos[keep]
        n = flat_ids.shape[0]
        x = F.embedding(flat_ids, self.embed)  # [N, H]
        cos, sin = self.inner.rotary_emb(x, flat_pos[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, d]: broadcast over heads
        nq, nk, d = self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.head_dim

        def padded(z: torch.Tensor, heads: int) -> torch.Tensor:  # [N, heads, d] -> [B, heads, T, d]
            if keep is not None:
                full = z.new_zeros((b * t, heads, d))
                full[keep] = z
                z = full
            return z.view(b, t, heads, d).transpose(1, 2)

        for layer, (k_cache, v_cache) in zip(self.layers, cache, strict=True):
            h = self._norm(x, layer.ln1)
            qkv = layer.qkv(h)
            q = qkv[:, :nq].view(n, self.n_heads, d)
            k = qkv[:, nq : nq + nk].view(n, self.n_kv, d)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache[:, :, start:end] = padded(k, self.n_kv)
            v_cache[:, :, start:end] = padded(qkv[:, nq + nk :].view(n, self.n_kv, d), self.n_kv)
            att = F.scaled_dot_product_attention(
                padded(q, self.n_heads),
                k_cache[:, :, :end],
                v_cache[:, :, :end],
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=self.n_kv != self.n_heads,
            )
            att = att.transpose(1, 2).reshape(b * t, nq)
            x = x + layer.o(att if keep is None else att[keep])
            h = self._norm(x, layer.ln2)
            gu = layer.gate_up(h)
            x = x + layer.down(F.silu(gu[:, : self.inter]) * gu[:, self.inter :])
        return self._norm(x, self.final_norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


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
        use_fast = _FastLlama.supports(loaded) if fast_path is None else fast_path
        if use_fast and not _FastLlama.supports(loaded):
            raise ModelError(f"no fast path for model type {loaded.model.config.model_type!r}")
        self._fast = _FastLlama(loaded, kernel=kernel, kernel_cache=kernel_cache) if use_fast else None
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
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], max_new_tokens: int
    ) -> list[Generation]:
        """Generate up to ``max_new_tokens`` per prompt; sequence ``i`` samples with ``seeds[i]``."""
        self._validate(prompts, seeds, max_new_tokens)
        if not prompts:
            return []
        with torch.inference_mode():
            if self._fast is not None:
                return self._generate_fast(prompts, params, seeds, max_new_tokens)
            return self._generate_hf(prompts, params, seeds, max_new_tokens)

    # -- shared bookkeeping -------------------------------------------------------------------------

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = True
        device = self.loaded.device
        return ids.to(device), mask.to(device)

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
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], max_new: int
    ) -> list[Generation]:
        fast = self._fast
        assert fast is not None
        device, dtype = self.loaded.device, self.loaded.dtype
        b = len(prompts)
        ids, valid = self._left_pad(prompts)
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
        next_pos = positions[:, -1] + 1
        hidden = last_hidden
        for step in range(max_new):
            logits = fast.logits(hidden)
            steps_t = torch.full((len(live),), step, dtype=torch.long)
            tok, lp = sample(logits, params, seed_t[live], steps_t)
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
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], max_new: int
    ) -> list[Generation]:
        device, dtype = self.loaded.device, self.loaded.dtype
        b = len(prompts)
        ids, valid = self._left_pad(prompts)
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
        for step in range(max_new):
            tok, lp = sample(logits, params, seed_t, torch.full((b,), step, dtype=torch.long))
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
