"""A processing step that fails with a reason of the length its argument gives, naming its host
first: what SageMaker makes of a long /opt/ml/output/message, and of several hosts' messages."""

import json
import sys

from steps.runtime import names
from steps.runtime.environment import ml_root
from steps.runtime.names import host_path
from steps.runtime.step import run_step


def main():
    resource = json.loads(host_path(ml_root(), names.PROCESSING_RESOURCE_CONFIG_FILE).read_text())
    raise ValueError(resource["current_host"] + "|" + "x" * int(sys.argv[1]))


if __name__ == "__main__":
    run_step("long-failure", main)
