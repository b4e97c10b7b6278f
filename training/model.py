"""Llama-style decoder (RoPE, RMSNorm, SwiGLU, optional GQA and tied embeddings).

Module names mirror Hugging Face `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`,
`lm_head.weight`, ...) so export is a rename-free copy, and RoPE uses HF's rotate-half layout so
exported q/k weights need no permutation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.settings import MODEL_PRESETS, model_shape_errors


@dataclass
class ModelConfig:
    vocab_size: int = 32000
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # None: plain multi-head attention
    hidden_dim: int | None = None  # SwiGLU width; None: 8/3 * dim rounded up to multiple_of
    multiple_of: int = 64
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    bos_id: int | None = None
    eos_id: int | None = None

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.hidden_dim is None:
            hidden = int(8 * self.dim / 3)
            self.hidden_dim = self.multiple_of * math.ceil(hidden / self.multiple_of)
        errors = model_shape_errors(dataclasses.asdict(self))
        if errors:
            raise ValueError("; ".join(message for _, message in errors))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose from {sorted(MODEL_PRESETS)}")
        return cls(**{**MODEL_PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)

    def num_params(self) -> int:
        """Unique parameters (a tied embedding counts once)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv_dim * 2  # q, o, k, v
        mlp = 3 * self.dim * self.hidden_dim
        per_layer = attn + mlp + 2 * self.dim  # two RMSNorm weights
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return embed + head + self.n_layers * per_layer + self.dim

    def train_flops_per_token(self, seq_len: int) -> float:
        """FLOPs of one forward+backward per token: 6·N + 12·layers·dim·seq_len (PaLM appendix B).

        N excludes the input-embedding lookup (no matmul) but includes the output projection,
        which for tied weights is the same matrix. The attention term counts the full seq_len
        square, as PaLM does, although a causal kernel could skip half of it.
        """
        matmul_params = self.num_params() - (0 if self.tie_embeddings else self.vocab_size * self.dim)
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.dim * seq_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as HF does, so bf16 runs and exports agree.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim) in HF's layout (frequencies repeated, not interleaved)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # enable_gqa maps query head h to kv head h // (n_heads // n_kv_heads), like HF's repeat_kv.
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """HF's `LlamaModel`: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class KilnLM(nn.Module):
    """Causal LM. `forward(ids)` returns logits; `forward(ids, targets)` returns the mean token loss.

    `activation_checkpointing = True` recomputes each decoder block in backward instead of keeping
    its activations: torch's non-reentrant checkpoint, which works with ZeRO-3 (the recompute's
    forward hooks gather the partitioned weights again) and gives the same gradients.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = False
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(t, self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        if targets is None:
            return logits
        # fp32 cross-entropy: bf16 log-softmax over a large vocab loses too much precision.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def init_weights(model: KilnLM, seed: int) -> None:
    """Deterministic init from `seed` alone (own generator, parameter order fixed by the module tree).

    Normal(0, init_std) for matrices; residual-output projections (o_proj, down_proj) are scaled by
    1/sqrt(2·n_layers) as in GPT-2 so the residual stream's variance does not grow with depth.
    """
    cfg = model.cfg
    gen = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied weight appears once
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else cfg.init_std
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            param.copy_(values)


def build_model(cfg: ModelConfig, seed: int) -> KilnLM:
    """The step-0 model training starts from: same cfg and seed give bit-identical weights."""
    model = KilnLM(cfg)
    init_weights(model, seed)
    return model


def weights_fingerprint(model: nn.Module) -> str:
    """sha256 over parameter names and fp32 bytes; identifies an init without storing it."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
