"""The NextN / MTP layer used as the EAGLE draft.

input  = eh_proj(cat(enorm(embed(next_token)), hnorm(target_hidden)))
hidden = one DSA decoder layer (MLA + own indexer + MoE) with a plain residual, no mHC
logits = lm_head(shared_head.norm(hidden))       embed and lm_head are the target's

`target_hidden` is the target's stream mean before its final norm at the same position (for
later draft steps: the draft's own pre-norm hidden). The layer index is num_hidden_layers, so its
caches never collide with the target's.

Image prompts: the "embedding of the next token" is the row the target's input embeddings hold
at position i + 1, so where token i + 1 is one of a prompt's <|image|> tokens it is that
image's merged embedding (the scattered row), not embed(<|image|>). transformers 5.17 builds no
MTP layer for glm5_next (it drops the checkpoint's layer num_hidden_layers on load), so the
definition is the MTP layer's own: it reads the model's input embeddings shifted by one, and in
a multimodal model those are the scattered ones, which is also what SGLang's and vLLM's
multimodal MTP drafts are given (the target's input embeddings reused, not the placeholder's).
Only a prompt has image rows: drafted and committed tokens are text, and an <|image|> the model
generates stays a token embedding, as in the target. The draft only proposes, so greedy output
does not depend on this; acceptance does.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.config import ModelConfig
from serving.forward_batch import ForwardBatch
from serving.layers.linear import Linear
from serving.layers.mlp import make_mlp
from serving.layers.norm import RMSNorm, add_rms_norm
from serving.memory.cache import ModelCache
from serving.models.dsa import DSAttention
from serving.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from serving.models.vision import scatter_image_embeddings


class NextNDraft(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer = config.num_hidden_layers
        self.enorm = RMSNorm(hidden, eps, dtype)
        self.hnorm = RMSNorm(hidden, eps, dtype)
        self.eh_proj = Linear(2 * hidden, hidden, dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = DSAttention(config, dtype, has_indexer=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        self.mlp = make_mlp(config, self.layer, dtype)
        self.shared_head_norm = RMSNorm(hidden, eps, dtype)

    @torch.inference_mode()
    def forward(
        self,
        target: Glm5NextForCausalLM,
        batch: ForwardBatch,
        target_hidden: torch.Tensor,
        cache: ModelCache,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """batch.input_ids are the *next* tokens; target_hidden [T, Hd] aligns with them.
        images: (batch positions [K], embeddings [K, Hd]) of the next tokens that are image
        tokens, the rows the target took there."""
        e = self.next_embeddings(target, batch, images)
        pair = e.new_empty(e.shape[0], 2 * e.shape[1])  # cat(enorm(e), hnorm(h)), in place
        self.enorm(e, out=pair[:, : e.shape[1]])
        self.hnorm(target_hidden.to(e.dtype), out=pair[:, e.shape[1] :])
        x = self.eh_proj(pair)
        attn, _ = self.self_attn(self.input_layernorm(x), batch, cache.dsa(self.layer), None)
        x, h = add_rms_norm(x, attn, self.post_attention_layernorm)
        x, h = add_rms_norm(x, self.mlp(h), self.shared_head_norm)
        logits = target.project(h[batch.logit_index])
        return ForwardOutput(logits=logits, hidden=x)

    def next_embeddings(
        self,
        target: Glm5NextForCausalLM,
        batch: ForwardBatch,
        images: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The next tokens' input embeddings [T, Hd], as the target's forward builds its own."""
        e = target.embed(batch.input_ids)
        return e if images is None else scatter_image_embeddings(e, *images)
