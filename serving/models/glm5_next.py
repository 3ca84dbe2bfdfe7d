"""GLM-5.3-Flash text model for serving: hybrid KDA / DSA layers with mHC residual streams.

The hidden state is `hc_mult` parallel streams [T, hc, Hd]. Each layer collapses them for its
attention and its MLP (HyperConnection), and spreads the sublayer output back. Between two
sublayers that is one step, the boundary (HyperConnection.boundary: the expansion of one's output,
then the next one's collapse; one launch for a decode batch): the first attention's input is a
plain collapse, the last MLP's output a plain expansion. The head takes the mean of the streams,
then RMSNorm, then lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from serving.config import KDA, ModelConfig
from serving.distributed import padded_vocab, state, tp_all_reduce
from serving.forward_batch import ForwardBatch
from serving.layers.linear import Linear, padded, tp_param
from serving.layers.mhc import HyperConnection, Streams
from serving.layers.mlp import make_mlp
from serving.layers.norm import RMSNorm
from serving.memory.cache import ModelCache
from serving.models.dsa import DSAttention
from serving.models.kda import KDAttention
from serving.models.vision import scatter_image_embeddings


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, V] float32 for batch.logit_index
    hidden: torch.Tensor  # [T, Hd] stream mean before the final norm (the NextN draft's input)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.is_kda = config.layer_types[layer] == KDA
        if self.is_kda:
            self.self_attn: nn.Module = KDAttention(config, dtype)
        else:
            self.self_attn = DSAttention(config, dtype, config.indexer_types[layer] == "full")
        self.mlp = make_mlp(config, layer, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(
        self,
        x: torch.Tensor,
        streams: Streams,
        batch: ForwardBatch,
        cache: ModelCache,
        selected: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Streams, torch.Tensor | None]:
        """x: the attention's input (the streams collapsed by attn_hc, normed); streams: the
        residual streams with that collapse's mixing. Returns the MLP's output, not yet expanded
        (the next layer's boundary, or the model's last expansion, does that), the streams it
        expands onto, and the indexer's selection."""
        if self.is_kda:
            history = None
            if batch.kda_history is not None:
                history = batch.kda_history.setdefault(self.layer, [])
            x = self.self_attn(x, batch, cache.kda(self.layer), history)
        else:
            x, selected = self.self_attn(x, batch, cache.dsa(self.layer), selected)
        x, streams = self.ffn_hc.boundary(x, streams, self.post_attention_layernorm)
        return self.mlp(x), streams, selected


class Glm5NextForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        # vocab-parallel under TP: rank r holds rows [r*P/tp, (r+1)*P/tp) of both, P the vocab
        # padded to a multiple of tp; rows >= vocab_size are zero and their logits never leave
        # `project`
        vocab = padded_vocab(config.vocab_size, state().tp_size)
        self.embed_tokens = padded(tp_param(vocab, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = Linear(config.hidden_size, vocab, dtype, "column", gather=True)
        padded(self.lm_head.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = state()
        if tp.tp_size == 1:
            return self.embed_tokens[input_ids]
        # vocab-parallel: each rank looks up the ids it owns, zeros elsewhere, one all-reduce
        local = input_ids - tp.tp_rank * self.embed_tokens.shape[0]
        mine = (local >= 0) & (local < self.embed_tokens.shape[0])
        x = self.embed_tokens[torch.where(mine, local, 0)] * mine.unsqueeze(-1).to(self.dtype)
        return tp_all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: pre-norm [N, Hd] -> float32 logits [N, V]."""
        return self.project(self.norm(hidden))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden [N, Hd] -> float32 logits over the real vocabulary [N, V]: the padded
        columns are cut here, so no sampler, argmax or logprob ever sees them."""
        logits = self.lm_head(x)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[:, : self.config.vocab_size]
        return logits.float()

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        cache: ModelCache,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ForwardOutput:
        """images: (positions [K], embeddings [K, Hd]) that replace those tokens' embeddings
        (serving/models/vision.py's scatter; the image tokens of a prefill step)."""
        x = self.embed(batch.input_ids)
        if images is not None:
            x = scatter_image_embeddings(x, *images)
        first = self.layers[0]
        x, streams = first.attn_hc.collapse(
            x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous(), first.input_layernorm
        )
        selected = None
        for i, layer in enumerate(self.layers):
            if i:  # one boundary: the last layer's MLP output expanded, this attention's collapse
                x, streams = layer.attn_hc.boundary(x, streams, layer.input_layernorm)
            x, streams, selected = layer(x, streams, batch, cache, selected)
        hidden = HyperConnection.expand(x, streams).mean(dim=1)
        return ForwardOutput(logits=self.logits(hidden[batch.logit_index]), hidden=hidden)
