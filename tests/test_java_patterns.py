"""SageMaker's patterns are Java regular expressions (pipeline/service_model.py `as_java`): `.`
stops at every Java line terminator, `\\d`, `\\s`, `\\w` and `\\p{Alnum}` are ASCII. A value
that Python's `regex` would pass and SageMaker refuses is refused here, before anything is
sent; what Java accepts stays accepted."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_settings
from pipeline.paths import ExperimentTree
from pipeline.plan import check_requests
from pipeline.service_model import as_java, check_value, service_model
from pipeline.sources import Sources
from pipeline.stages import build_jobs
from tests.conftest import write_settings

ROLE = "arn:aws:iam::123456789012:role/smpipe"

# (shape of the service model, its pattern, a value, whether Java's Pattern matches it whole)
CASES = [
    ("HyperParameterValue", ".*", "5e-5", True),
    ("HyperParameterValue", ".*", "a\rb", False),  # \r: a line terminator
    ("HyperParameterValue", ".*", "a\r\nb", False),
    ("HyperParameterValue", ".*", "a\x85b", False),  # NEXT LINE
    ("HyperParameterValue", ".*", "a\u2028b", False),  # LINE SEPARATOR
    ("HyperParameterValue", ".*", "a\u2029b", False),  # PARAGRAPH SEPARATOR
    ("HyperParameterValue", ".*", "é\u00a0ü", True),  # not terminators: any character
    ("RoleArn", None, ROLE, True),
    ("RoleArn", None, "arn:aws:iam::١٢٣٤٥٦٧٨٩٠١٢:role/smpipe", False),  # \d is [0-9]
    ("RoleArn", None, "arn:aws:iam::１２３４５６７８９０１２:role/smpipe", False),  # fullwidth
    ("TrainingEnvironmentValue", "[\\S\\s]*", "a\r\n\u2028\u00a0é", True),  # \S: not ASCII \s
    ("ProcessingEnvironmentValue", "[\\S\\s]*", "", True),
]


@pytest.mark.parametrize(("shape_name", "pattern", "value", "java"), CASES)
def test_values_are_matched_as_java_matches_them(shape_name, pattern, value, java):
    from pipeline.service_model import shape

    if pattern is not None:
        assert shape(shape_name).metadata["pattern"] == pattern
    problems = check_value(shape_name, value, "field")
    assert (problems == []) is java, problems


@pytest.mark.parametrize(
    ("pattern", "value", "java"),
    [
        ("\\w+", "abc_09", True),
        ("\\w+", "é", False),  # \w is [a-zA-Z_0-9]
        ("\\W", "é", True),
        ("\\s", "\u00a0", False),  # \s is [ \t\n\x0B\f\r]
        ("\\s", "\x0b", True),
        ("\\S", "\u3000", True),
        ("\\d", "٣", False),
        ("\\D", "٣", True),
        ("[\\w-]+", "a-é", False),
        ("arn:[\\p{Alnum}\\-]+:x", "arn:é:x", False),  # POSIX classes are US-ASCII only
        ("arn:[\\p{Alnum}\\-]+:x", "arn:aws-cn:x", True),
        ("[\\p{L}\\p{N}_.]*", "éü٣", True),  # Unicode categories stay Unicode
        ("a$", "a\r\n", False),  # whole-value matching consumes what $ stops before
        ("(?=.{1,4}$)[a-z]+", "ab\u2028", False),
    ],
)
def test_java_constructs(pattern, value, java):
    import regex

    assert bool(regex.fullmatch(as_java(pattern), value)) is java


def test_every_pattern_of_the_service_model_translates():
    """as_java refuses a construct it cannot translate: none is in botocore's model."""
    model = service_model()
    patterns = {
        model.shape_for(name).metadata["pattern"]
        for name in model.shape_names
        if "pattern" in model.shape_for(name).metadata
    }
    assert len(patterns) > 100
    for pattern in patterns:
        as_java(pattern)


def test_a_setting_with_a_carriage_return_is_refused_before_the_plan(tmp_path):
    """WANDB_PROJECT becomes an argument of the inference job (ContainerArgument `.*`): a
    carriage return passes Python's `.` and not SageMaker's."""
    path = write_settings(
        tmp_path / "settings.ini",
        "s3://bucket/root",
        experiment={"BACKEND": "sagemaker", "ROLE_ARN": ROLE, "IMAGE_URI": "i:1"},
    )
    settings = load_settings(path, env={"SMPIPE__TRACKING__WANDB_PROJECT": "news\rfeed"})
    tree = ExperimentTree(settings.experiment.name)
    steps = ["reconcile", "prepare", "train", "inference"]
    jobs = build_jobs(settings, steps, tree.run(1), Sources(raw=tree.raw))

    class S3:
        uri = "s3://bucket/root"

        def uri_of(self, key: str) -> str:
            return f"{self.uri}/{key}"

    with pytest.raises(ConfigError) as error:
        check_requests(jobs, settings, S3())
    assert any(
        "ContainerArguments" in p and "regular expression pattern: .*" in p
        for p in error.value.problems
    ), error.value.problems
