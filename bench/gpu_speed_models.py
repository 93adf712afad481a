"""The user functions bench/gpu_speed.py trains through our training job (SMPIPE_USER_FUNCTIONS
names this module there): the demo's own for MiniLM, and encoders of BERT's family with random
weights, built from transformers' `BertConfig`, so that nothing is downloaded. Every model reads
MiniLM's tokenizer: BERT's uncased WordPiece vocabulary of 30,522 tokens, `BertConfig`'s
default vocabulary size."""

from __future__ import annotations

from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions import load_model as demo_load_model

# BERT-base's shape is `BertConfig`'s defaults (12 layers, hidden 768, 12 heads, intermediate
# 3072, 512 positions: transformers' BertConfig docs). bert_tiny is the same family small
# enough for the CPU smoke run to train in seconds on 2 cores.
RANDOM = {
    "bert_base": {},
    "bert_tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 2,
        "intermediate_size": 128,
    },
}


def load_model(model_name, id2label, label2id):
    if model_name not in RANDOM:
        return demo_load_model(model_name, id2label, label2id)
    from transformers import BertConfig, BertForSequenceClassification

    shape = BertConfig(**RANDOM[model_name], id2label=id2label, label2id=label2id)
    return BertForSequenceClassification(shape)
