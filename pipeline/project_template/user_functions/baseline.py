"""The baseline: a bag of embeddings learned from scratch, to show what pretraining brings."""

from __future__ import annotations

from torch import nn


class BagOfEmbeddings(nn.Module):
    """Mean of learned token embeddings, then a linear layer: a baseline trained from scratch."""

    def __init__(self, vocab_size: int, num_labels: int, dim: int = 128):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        summed = (self.embedding(input_ids) * mask).sum(dim=1)
        mean = summed / mask.sum(dim=1).clamp(min=1.0)
        return self.classifier(self.dropout(mean))
