"""The demo's user functions with a classifier of about four thousand parameters, for any
model name: so little to compute that a training step's time is the loop around it
(bench/loop_overhead.py). USER_FUNCTIONS = bench.tiny_classifier."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401

BUCKETS, DIM = 1024, 4  # token ids hashed into 1024 embeddings of 4: 4,096 weights


class TinyClassifier(nn.Module):
    """The mean of the row's hashed token embeddings, then a linear layer. Without labels it
    returns the logits (what our job's loop takes); with them, the loss too, as a Hugging
    Face model does (what the Trainer takes)."""

    def __init__(self, num_labels: int):
        super().__init__()
        self.embedding = nn.Embedding(BUCKETS, DIM)
        self.classifier = nn.Linear(DIM, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        mask = attention_mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        summed = (self.embedding(input_ids % BUCKETS) * mask).sum(dim=1)
        logits = self.classifier(summed / mask.sum(dim=1).clamp(min=1.0))
        if labels is None:
            return logits
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def load_model(model_name, id2label, label2id):
    return TinyClassifier(len(id2label))
