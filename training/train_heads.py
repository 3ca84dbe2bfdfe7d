"""The parts of training that transformers' glm5_next does not have: the NextN (MTP) layer and
the DSA indexer's loss.

transformers drops the NextN layer and runs the indexer under no_grad, so:
- `TrainableNextN` is the draft layer built from transformers' own modules (MLA + kpool indexer,
  MoE), wired as serving/models/nextn.py runs it: eh_proj(cat(enorm(embed(x_{i+1})),
  hnorm(h_i))) -> one DSA layer with a plain residual. Its loss (`nextn_loss`) distils the
  target's next-position distribution (what greedy verification accepts) and regresses its
  output hidden onto the target's h_{i+1}, so draft steps after the first, which feed the
  draft's own hidden back in, see what they were trained on (EAGLE's feature loss). Target-side
  tensors are detached: the draft rides along without changing the target.
- `indexer_loss` trains an indexer's pool scores toward the attention mass its layer puts on
  each complete pool (DeepSeek-V3.2's indexer warm-up objective, per pool instead of per token),
  so sparse selection past index_topk keeps the pools attention wanted.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def _modeling():
    from transformers.models.glm5_next import modeling_glm5_next

    return modeling_glm5_next


class TrainableNextN(nn.Module):
    """Parameter names follow serving/models/nextn.py's NextNDraft (see `draft_state`)."""

    def __init__(self, text_config) -> None:
        super().__init__()
        m = _modeling()
        n = text_config.num_hidden_layers
        cfg = copy.deepcopy(text_config)  # the draft is layer n: a DSA layer with its own indexer
        cfg.num_hidden_layers = n + 1
        cfg.layer_types = [*text_config.layer_types, "deepseek_sparse_attention"]
        cfg.indexer_types = [*text_config.indexer_types, "full"]
        cfg.mlp_layer_types = [*text_config.mlp_layer_types, "sparse"]
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = m.Glm5NextTextRMSNorm(hidden, eps)
        self.hnorm = m.Glm5NextTextRMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = m.Glm5NextTextRMSNorm(hidden, eps)
        self.self_attn = m.Glm5NextTextAttention(cfg, n)
        self.post_attention_layernorm = m.Glm5NextTextRMSNorm(hidden, eps)
        self.mlp = m.Glm5NextTextMoE(cfg)
        self.shared_head_norm = m.Glm5NextTextRMSNorm(hidden, eps)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] embeddings of x_{i+1} and target hiddens h_i -> the draft's pre-norm hidden."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        attn, _, _ = self.self_attn(hidden_states=self.input_layernorm(x), attention_mask=mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def draft_state(mtp: TrainableNextN) -> dict[str, torch.Tensor]:
    """`mtp`'s weights under NextNDraft's parameter names (serving/models/nextn.py)."""
    out = {}
    for name, t in [*mtp.named_parameters(), *mtp.named_buffers()]:
        name = name.replace("indexer.k_norm.weight", "indexer.k_norm_weight")
        name = name.replace("indexer.k_norm.bias", "indexer.k_norm_bias")
        name = name.replace("mlp.experts.gate_up_proj", "mlp.w13")
        name = name.replace("mlp.experts.down_proj", "mlp.w2")
        out[name] = t.detach()
    return out


def _rms(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def nextn_loss(
    mtp: TrainableNextN,
    draft_hidden: torch.Tensor,
    lm_head: torch.Tensor,
    target_logits: torch.Tensor,
    target_hidden: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """draft_hidden [B, T-1, H] at positions i; target_logits / target_hidden [B, T, ...] of the
    whole window; lm_head the target's (shared, not trained here). Returns (KL(target_{i+1} ||
    draft_i), the feature loss, the draft's top-1 agreement with the target)."""
    logits = F.linear(mtp.shared_head_norm(draft_hidden), lm_head.detach()).float()
    want = target_logits[:, 1:].detach().float()
    kl = F.kl_div(
        F.log_softmax(logits, -1), F.log_softmax(want, -1), log_target=True, reduction="none"
    ).sum(-1)
    feature = F.smooth_l1_loss(_rms(draft_hidden), _rms(target_hidden[:, 1:].detach()))
    agree = (logits.argmax(-1) == want.argmax(-1)).float().mean()
    return kl.mean(), feature, agree


def indexer_loss(attn: nn.Module, x: torch.Tensor, kpool: int) -> torch.Tensor:
    """KL(attention mass per complete pool || softmax of the indexer's pool scores), averaged
    over the queries that have at least one complete pool. x [B, T, H] is the layer's input
    (after input_layernorm), T a multiple of kpool; only the indexer's weights get gradients."""
    b, t, _ = x.shape
    pools = t // kpool
    x = x.detach()
    with torch.no_grad():
        q_lora = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_lora).view(b, t, attn.num_heads, attn.qk_head_dim).transpose(1, 2)
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., : attn.kv_lora_rank])
        kv = attn.kv_b_proj(latent).view(b, t, attn.num_heads, -1)
        k = kv[..., : attn.qk_nope_head_dim].transpose(1, 2)
        scores = (q.float() @ k.float().transpose(-1, -2)) * attn.scaling
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)  # [B, T, T]
        mass = probs.view(b, t, pools, kpool).sum(-1)  # [B, T, P]
        complete = torch.arange(pools, device=x.device)[None, :] < (
            (torch.arange(t, device=x.device)[:, None] + 1) // kpool
        )  # [T, P]: pool p is a candidate of query s when it closed at or before s
        want = mass * complete
        rows = complete.any(-1)
        want = want / want.sum(-1, keepdim=True).clamp_min(1e-9)
    idx = attn.indexer
    heads, dim = idx.n_heads, idx.head_dim
    qi = idx.wq_b(q_lora).view(b, t, heads, dim).float()
    keys = idx.k_norm(idx.wk(x)).view(b, pools, kpool, dim).float()
    gates = F.linear(x, idx.index_kpool_compress_gate).view(b, pools, kpool, dim).float()
    weights = (gates + idx.index_kpool_compress_ape.float()).softmax(dim=2)
    pooled = (weights * keys).sum(2)  # [B, P, D]
    per_head = F.relu(torch.einsum("bshd,bpd->bshp", qi, pooled) * idx.softmax_scale)
    head_w = idx.weights_proj(x).float() * heads**-0.5
    index = torch.einsum("bsh,bshp->bsp", head_w, per_head)
    logq = index.masked_fill(~complete, float("-inf")).log_softmax(-1)
    kl = (want * (want.clamp_min(1e-12).log() - logq.masked_fill(~complete, 0))).sum(-1)
    return kl[:, rows].mean()
