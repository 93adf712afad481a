"""The demo's user functions with a BERT of two small layers, built from its config with random
weights (no download), for any model name: a model with layers to shard (FSDP) and to adapt
(LoRA), as quick to train as the bag of embeddings. It stops where SMPIPE_TEST_GATE says
(tests/jobs/gate.py). USER_FUNCTIONS = tests.jobs.tiny_bert."""

from tests.jobs.gate import gate
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401

VOCAB = (
    30_522  # MiniLM's tokenizer (the demo encodes every model with it); the small splits use fewer
)


def load_model(model_name, id2label, label2id):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=len(id2label),
        id2label=id2label, label2id=label2id,
    )  # fmt: skip
    return gate(BertForSequenceClassification(config))
