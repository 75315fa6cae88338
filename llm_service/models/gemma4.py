"""Gemma 4's decoder on the paged KV cache (the language model of ``Gemma4ForConditionalGeneration``).

Math as transformers 5.25's ``Gemma4TextModel``, so greedy outputs agree. Beyond Gemma 3:

- **Per-layer embeddings (PLE).** A second table, indexed by token id (placeholders of media items
  looked up as ``pad``, as HF does), plus a projection of the input rows (media embeddings included),
  gives every layer its own small input, gated into the residual after the MLP.
- **KV-shared layers.** The last ``num_kv_shared_layers`` layers compute no K/V: they attend the cache
  of the last earlier layer of their kind and write nothing, so they own no cache (``kv_layer_specs``)
  and a token's KV memory counts only the layers that write. Nothing of theirs is cached, so they run
  on the last row of each chunk only (the row that may sample), as HF's ``_maybe_slice_kv_shared_inputs``
  does for ``generate``: a prefill chunk of n tokens costs them 1 row, not n.
- Full layers have their own head dim (and, with ``attention_k_eq_v``, their own KV heads and values
  taken from the key projection), and a "proportional" RoPE that rotates only part of each head.
- Attention scale 1 (q, k and v are RMS-normed per head); RMSNorm multiplies by ``weight`` (not
  ``1 + weight``); each layer ends scaled by ``layer_scalar``; optional MoE block beside the MLP.
- Image soft tokens attend each other both ways on sliding layers only (``use_bidirectional_attention:
  vision``); full layers stay causal.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llm_service.attention import AttentionMetadata, DecodeGroup, PagedAttention, SeqAttention
from llm_service.models.gemma3 import ScaledEmbedding
from llm_service.models.gemma4_config import Gemma4TextConfig, RopeSpec
from llm_service.models.qwen2 import Qwen2ForCausalLM, TextConfig, rotate_half


class RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: float32, ``x * (ms + eps) ** -0.5``, times ``weight`` when it has one."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, spec: RopeSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's default / proportional RoPE: the first ``rotary_fraction`` of the frequencies rotate."""
    angles = int(spec.rotary_fraction * head_dim // 2)
    inv = 1.0 / (spec.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv = torch.cat([inv, torch.zeros(head_dim // 2 - angles)]) / spec.factor
    freqs = positions[:, None].float() * inv.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class PlaceholderAsPadEmbedding(ScaledEmbedding):
    """Token embeddings (times ``sqrt(dim)``) with every media placeholder id looked up as ``pad``, as
    HF's ``Gemma4Model`` does: media rows are overwritten by the items' embeddings anyway, and a
    placeholder id the model itself generates is embedded as pad, not as its own row."""

    def __init__(self, num: int, dim: int, placeholder_ids: tuple[int, ...], pad_id: int) -> None:
        super().__init__(num, dim)
        self.pad_id = pad_id
        self.register_buffer(
            "placeholder_ids", torch.tensor(placeholder_ids, dtype=torch.long), persistent=False
        )

    def as_pad(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(torch.isin(ids, self.placeholder_ids), self.pad_id, ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(self.as_pad(ids))


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig, backend: PagedAttention, i: int) -> None:
        super().__init__()
        self.sliding = cfg.layer_is_sliding[i]
        self.shared = cfg.kv_source[i] != i
        self.num_heads, self.head_dim = cfg.num_heads, cfg.layer_head_dims[i]
        self.num_kv_heads = cfg.layer_kv_heads[i]
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_eq_v = cfg.attention_k_eq_v and not self.sliding
        if not self.shared:  # a shared layer has no K/V weights at all (HF neither creates nor saves them)
            self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, eps)
            self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.window = cfg.sliding_window if self.sliding else None
        self.backend = backend

    def forward(self, x, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        t = x.shape[0]
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        q = q * cos + rotate_half(q) * sin
        k = v = None
        if not self.shared:
            raw_k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
            raw_v = raw_k if self.k_eq_v else self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
            k = self.k_norm(raw_k)
            k = k * cos + rotate_half(k) * sin
            v = self.v_norm(raw_v)
        o = self.backend.forward(q, k, v, kv_cache, meta, 1.0, self.window, bidirectional=self.sliding)
        return self.o_proj(o.reshape(t, -1))


class Gemma4MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4Router(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.root = cfg.hidden_size**-0.5
        self.top_k = cfg.top_k_experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(x) * self.scale * self.root)
        probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Gemma4Experts(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig) -> None:
        super().__init__()
        e, h, m = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * m, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, m))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):  # experts in index order, as HF sums them
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            gate, up = nn.functional.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.gelu(gate, approximate="tanh") * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig, backend: PagedAttention, i: int) -> None:
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Gemma4Attention(cfg, backend, i)
        wide = cfg.double_wide_shared_mlp and self.self_attn.shared
        self.mlp = Gemma4MLP(hidden, cfg.intermediate_size * (2 if wide else 1))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # a buffer in HF, saved with the weights
        if cfg.ple_dim:
            self.per_layer_input_gate = nn.Linear(hidden, cfg.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(cfg.ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.moe = cfg.num_experts > 0
        if self.moe:
            self.router = Gemma4Router(cfg)
            self.experts = Gemma4Experts(cfg)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)

    def forward(self, h, per_layer_input, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        a = self.self_attn(self.input_layernorm(h), rope, kv_cache, meta)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            weights, index = self.router(h)
            e = self.experts(self.pre_feedforward_layernorm_2(h), index, weights)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e)
        h = h + self.post_feedforward_layernorm(m)
        if per_layer_input is not None:
            g = nn.functional.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar


def last_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    """The batch rows that end each sequence's chunk, and attention metadata for them alone: each one
    query over its whole context (the last token of a chunk sees every earlier one, and a bidirectional
    span never outlasts its chunk); they write nothing (no slots)."""
    seqs: list[SeqAttention] = []
    rows: list[int] = []
    for s in meta.seqs:
        last = s.q_start + s.q_len - 1
        seqs.append(SeqAttention(len(rows), 1, s.context_slots, None, s.pos_start + s.q_len - 1, s.spans))
        rows.append(last)
    device = meta.slot_mapping.device
    out = torch.tensor(rows, dtype=torch.long, device=device)
    decode = None
    if (g := meta.decode) is not None:
        sub = torch.arange(len(rows), len(rows) + g.rows.numel(), device=device)
        decode = DecodeGroup(sub, g.slots, g.valid, g.lengths)
        out = torch.cat([out, g.rows])
    windowed = None if meta.windowed is None else last_rows(meta.windowed)[1]
    return out, AttentionMetadata(meta.slot_mapping[:0], seqs, decode, windowed=windowed)


class Gemma4ForCausalLM(Qwen2ForCausalLM):
    """Qwen2ForCausalLM's interface with Gemma 4's layers; ``forward`` also takes the batch's token ids
    (``takes_token_ids``: the runner passes them) for the per-layer embeddings. ``kv_caches`` holds one
    cache per KV-writing layer (``cfg.kv_layer_specs()``), not one per layer."""

    takes_token_ids = True
    extra_weight_prefixes = (
        "embed_tokens_per_layer.",
        "per_layer_model_projection.",
        "per_layer_projection_norm.",
    )

    def __init__(self, cfg: TextConfig, backend: PagedAttention) -> None:
        nn.Module.__init__(self)
        assert isinstance(cfg, Gemma4TextConfig)
        self.cfg = cfg
        self.gcfg = cfg
        self.bidirectional_mm = cfg.bidirectional_vision  # image soft tokens both ways (sliding layers)
        self.embed_tokens = PlaceholderAsPadEmbedding(
            cfg.vocab_size, cfg.hidden_size, cfg.mm_token_ids, cfg.pad_token_id
        )
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cache_index = cfg.kv_cache_index()
        shared = [i for i, src in enumerate(cfg.kv_source) if src != i]
        self.first_shared = shared[0] if shared else None
        if cfg.ple_dim:
            n = cfg.num_layers * cfg.ple_dim
            self.embed_tokens_per_layer = ScaledEmbedding(cfg.ple_vocab_size, n)
            self.embed_tokens_per_layer.scale = math.sqrt(cfg.ple_dim)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, n, bias=False)
            self.per_layer_projection_norm = RMSNorm(cfg.ple_dim, cfg.rms_norm_eps)

    @property
    def uses_mrope(self) -> bool:
        return False

    def per_layer_inputs(self, inputs_embeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T, num_layers, ple_dim]``: HF's ``get_per_layer_inputs`` (media placeholders as pad) combined
        with ``project_per_layer_inputs`` of the rows the layers get (media embeddings included)."""
        c = self.gcfg
        by_token = self.embed_tokens_per_layer(self.embed_tokens.as_pad(token_ids)).view(
            -1, c.num_layers, c.ple_dim
        )
        proj = self.per_layer_model_projection(inputs_embeds) * c.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(-1, c.num_layers, c.ple_dim))
        return (proj + by_token) * 2.0**-0.5

    def forward(  # type: ignore[override]
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        c, dtype = self.gcfg, inputs_embeds.dtype
        ple = None
        if c.ple_dim:
            if token_ids is None:
                raise ValueError("Gemma 4's per-layer embeddings need the batch's token ids")
            ple = self.per_layer_inputs(inputs_embeds, token_ids)
        ropes: dict[tuple[bool, int], tuple[torch.Tensor, torch.Tensor]] = {}
        h, full, rows = inputs_embeds, None, None
        for i, layer in enumerate(self.layers):
            if i == self.first_shared:  # from here on nothing is cached: only the chunks' last rows matter
                rows, meta = last_rows(meta)
                full, h, positions, ropes = h, h[rows], positions[rows], {}
                ple = None if ple is None else ple[rows]
            attn = layer.self_attn
            key = (attn.sliding, attn.head_dim)
            if key not in ropes:
                spec = c.rope_sliding if attn.sliding else c.rope_full
                ropes[key] = rope_cos_sin(positions, attn.head_dim, spec, dtype)
            h = layer(h, None if ple is None else ple[:, i], ropes[key], kv_caches[self.cache_index[i]], meta)
        if full is not None:  # rows other than the last of a chunk keep their pre-shared state (unused)
            h = full.index_copy(0, rows, h)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.gcfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
