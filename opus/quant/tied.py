"""One table for a tied model's embedding and its int8 lm_head.

A model that ties its embedding to its lm_head (SmolLM, Qwen2.5's small ones, Llama 3.2 1B) keeps one
float table. Quantizing the head gives it its own int8 copy, and the embedding then keeps the float table
beside it only for the lookup: on a 49k × 576 vocabulary that is 113 MB of fp32 next to a 28 MB head, half
of a W8A8 135M model. Where the head is int8 per output row (W8A8, W8A16), its row ``i`` times its scale
``i`` is token ``i``'s embedding rounded to int8: ``SharedInt8Embedding`` looks tokens up there and the
float table goes. That rounding (at most half a scale step per element) is a change of the model: the
quantize stage measures its perplexity with it, and it can be turned off there.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from opus.models.layout import DECODER
from opus.quant.modules import Int8WeightLinear
from opus.recipe import RecipeStep, register_transform

RECIPE_KIND = "shared_embedding"
EMBEDDING, HEAD = DECODER.embedding, DECODER.lm_head


class SharedInt8Embedding(nn.Module):
    """Token embeddings read from the int8 rows of the lm_head: ``qweight[ids] * scale[ids]``.

    The head is held outside the module tree (a tuple), so its tensors are saved, moved and counted once,
    as the head's; the lookup reads them at call time, whatever device or storage they have by then.
    """

    def __init__(self, head: Int8WeightLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = (head,)
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        # Empty, but cast with the model (``.to(torch.bfloat16)``): the dtype the lookup returns.
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype, device=head.qweight.device), persistent=False)

    @property
    def head(self) -> Int8WeightLinear:
        return self._head[0]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the int8 lm_head"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        dtype = self._dtype.dtype
        rows = self.head.qweight[ids].to(dtype)
        return rows * self.head.scale.reshape(-1)[ids].unsqueeze(-1).to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The whole table ``[vocab, hidden]`` (for exporters that write an embedding tensor)."""
        return self.forward(torch.arange(self.num_embeddings, device=self.head.qweight.device))


def _int8_head(model: nn.Module) -> Int8WeightLinear | None:
    head = getattr(model, HEAD, None)
    head = getattr(head, "inner", head)  # MinRows pads a CUDA head's rows around the same module
    if isinstance(head, Int8WeightLinear) and head.scale.numel() == head.out_features:
        return head
    return None


def why_not_shared(model: nn.Module) -> str | None:
    """None when the embedding can read the lm_head's int8 rows, else why not."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return "the model does not tie its embedding to its lm_head"
    embedding = model.get_submodule(EMBEDDING)
    if isinstance(embedding, SharedInt8Embedding):
        return "the embedding already reads the lm_head's rows"
    head = _int8_head(model)
    if head is None:
        return "the lm_head is not int8 per output row (W8A8 or W8A16)"
    table = getattr(embedding, "weight", None)
    if not isinstance(table, torch.Tensor) or tuple(table.shape) != tuple(head.qweight.shape):
        return "the embedding table's shape is not the lm_head's"
    # The head's rows must be this table rounded (nothing folded into the head since it was tied).
    scale = head.scale.reshape(-1, 1).float()
    error = (table.detach().float() - head.qweight.float() * scale).abs()
    if bool((error > scale * 0.5 * (1 + 1e-3) + 1e-6).any()):
        return "the lm_head's int8 rows are not the embedding table rounded (the head was changed after tying)"
    return None


def share_embedding(model: nn.Module) -> nn.Module:
    """Replace the embedding with a lookup into the int8 lm_head (``why_not_shared`` must be None)."""
    embedding = model.get_submodule(EMBEDDING)
    head = _int8_head(model)
    assert head is not None
    model.set_submodule(EMBEDDING, SharedInt8Embedding(head, embedding.weight.dtype))
    return model


class SharedEmbeddingStep(RecipeStep):
    """The embedding is a lookup into the int8 lm_head (which the quantize step before it rebuilt)."""

    kind: Literal["shared_embedding"] = RECIPE_KIND
    version: Literal[1] = 1
    embedding: str = EMBEDDING
    head: str = HEAD


def shared_embedding_step() -> SharedEmbeddingStep:
    return SharedEmbeddingStep()


@register_transform(RECIPE_KIND, SharedEmbeddingStep)
def rebuild(model: nn.Module, step: SharedEmbeddingStep) -> nn.Module:
    """After the quantize step rebuilt the (empty) int8 head: the lookup into it; the head's tensors load next."""
    if _int8_head(model) is None:
        raise ValueError("recipe step shared_embedding: the lm_head is not int8 per output row")
    return share_embedding(model)
