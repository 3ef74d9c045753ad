"""The fused LLaMA-shaped decoder the engine generates with and the validator checks with.

``FastLlama(loaded)`` reads the Hugging Face weights of a llama, mistral or qwen2 model (RMSNorm,
rotary, grouped-query attention, SwiGLU), concatenates q/k/v and gate/up once (so it holds a copy
of those: build a new one after changing the weights) and runs every linear layer through the
kernel ``models.kernels`` measured for that weight shape and dtype on this machine. The caller owns
a static KV cache (``new_cache``); ``forward`` runs any block of tokens against it and computes the
per-token work (everything but attention) on the real tokens only. ``models.engine`` decodes with
it; ``models.scoring`` runs the verifier's prefill with it, so node and validator run the same
kernels on the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.kernels import Linear, choose
from models.loading import LoadedModel, output_head

FAST_PATH_TYPES = frozenset({"llama", "mistral", "qwen2"})


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


class FastLlama:
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
