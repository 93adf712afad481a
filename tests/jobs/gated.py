"""The demo's user functions, their model made to stop at the step SMPIPE_TEST_GATE names
(tests/jobs/gate.py): USER_FUNCTIONS = tests.jobs.gated."""

from tests.jobs.gate import gate
from user_functions import encode, load_tokenizer, ordered_input_keys, reconcile  # noqa: F401
from user_functions import load_model as demo_load_model


def load_model(model_name, id2label, label2id):
    return gate(demo_load_model(model_name, id2label, label2id))
