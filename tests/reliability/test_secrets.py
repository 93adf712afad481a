"""Findings 4 and 5: the settings' WANDB_MODE wins over a key in the environment, and secret
values are masked everywhere a run writes: job logs, failure files of a kept job folder, the
wandb run files, outputs, Metadata. Names are a fixed list plus the settings' own, so
TOKENIZERS_PARALLELISM=false is not taken for a secret."""

from __future__ import annotations

import io
import os
import textwrap

from pipeline.store import upload_dir
from steps.runtime.names import EXTRA_SECRETS_VARIABLE
from steps.runtime.secrets import redact, secret_values
from tests.jobs.training_job import HPS, job_root, start
from tests.reliability.figures import record
from tests.test_local_backend import backend, probe_processing

SECRETS = {"WANDB_API_KEY": "wandb-secret-0123456789", "MY_DB_PASSWORD": "hunter2-db-password"}


def files_holding(folder, values) -> list[str]:
    return [str(p) for p in files_of(folder) if any(v.encode() in p.read_bytes() for v in values)]


def files_of(folder) -> list:
    return [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]


def test_only_named_variables_are_secrets():
    env = {**SECRETS, "TOKENIZERS_PARALLELISM": "false", "MY_KEYBOARD": "qwerty-layout",
           EXTRA_SECRETS_VARIABLE: "MY_DB_PASSWORD"}  # fmt: skip
    assert set(secret_values(env)) == set(SECRETS.values())
    assert redact("false qwerty-layout hunter2-db-password", secret_values(env)) == (
        "false qwerty-layout <redacted>"
    )


def test_a_failed_jobs_kept_folder_and_outputs_hold_no_secret(store, tmp_path, monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "in").mkdir()
    (tmp_path / "in/a.txt").write_text("x")
    upload_dir(store, tmp_path / "in", "inputs/things/")
    failing, job = probe_processing("probe-fail", "--fail"), probe_processing("probe-ok")
    failing.env = job.env = {
        EXTRA_SECRETS_VARIABLE: "MY_DB_PASSWORD"
    }  # [tracking] SECRET_VARIABLES
    echo = io.StringIO()
    failed = backend(store, tmp_path, echo).run_processing(failing)
    assert failed.status == "Failed" and "asked to fail with" in failed.failure_reason
    kept = tmp_path / "kept/probe-fail"
    assert failed.kept_folder == str(kept)
    assert (kept / "output/message").exists() and "<redacted>" in (
        kept / "output/message"
    ).read_text()
    assert files_holding(kept, SECRETS.values()) == []
    assert not any(v in echo.getvalue() or v in failed.failure_reason for v in SECRETS.values())
    done = backend(store, tmp_path).run_processing(job)
    assert done.status == "Completed"
    keys = store.list_keys("")
    held = [k for k in keys if any(v.encode() in store.get_bytes(k) for v in SECRETS.values())]
    record("secrets/job-folder-and-outputs", files=len(files_of(kept)) + len(keys),
           found=len(files_holding(kept, SECRETS.values())) + len(held))  # fmt: skip
    assert held == []


def test_wandb_stays_offline_with_a_key_set_and_its_files_hold_no_secret(
    tmp_path,
    channels,
    monkeypatch,
):
    # A user's debug print in the model's forward: wandb copies the console into its run files.
    (tmp_path / "leaky.py").write_text(textwrap.dedent('''
        import os
        from user_functions import encode, load_model as _load_model, load_tokenizer, ordered_input_keys, reconcile  # noqa

        def load_model(model_name, id2label, label2id):
            model = _load_model(model_name, id2label, label2id)
            def debug(module, args):
                print("debug:", os.environ.get("WANDB_API_KEY"), os.environ.get("MY_DB_PASSWORD"), flush=True)
            model.register_forward_pre_hook(debug)
            return model
    '''))  # fmt: skip
    root, env = job_root(
        tmp_path / "job", channels, {**HPS, "wandb_mode": "offline", "epochs": "1"}
    )
    env.pop("WANDB_MODE", None)
    env.update(SECRETS, WANDB_SILENT="true", SMPIPE_USER_FUNCTIONS="leaky",
               PYTHONPATH=f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}", **{EXTRA_SECRETS_VARIABLE: "MY_DB_PASSWORD"})  # fmt: skip
    proc = start(env, 1)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    assert "debug: <redacted> <redacted>" in log
    runs = [p.name for p in (root / "output/data/wandb").iterdir() if "run-" in p.name]
    assert runs and all(name.startswith("offline-run-") for name in runs), runs
    found = [files_holding(root / folder, SECRETS.values()) for folder in ("output", "model")]
    record("secrets/wandb-run", files=len(files_of(root / "output")) + len(files_of(root / "model")),
           found=sum(map(len, found)))  # fmt: skip
    assert found == [[], []]
    assert any("*" * len(SECRETS["WANDB_API_KEY"]) in p.read_text(errors="replace")
               for p in (root / "output/data/wandb").rglob("output.log"))  # fmt: skip
    # wandb's binary run log holds the console too: masked byte for byte, its records still
    # tile the file (a mask of another length would break the framing of every later record).
    (binary,) = (root / "output/data/wandb").rglob("*.wandb")
    records = wandb_log_records(binary.read_bytes())
    assert any(b"*" * len(SECRETS["WANDB_API_KEY"]) in r for r in records)


def wandb_log_records(data: bytes) -> list[bytes]:
    """The records of a wandb run log (.wandb): a 7-byte header (':W&B', a 2-byte magic, a
    version), then LevelDB's log format (leveldb doc/log_format.md): 32 KiB blocks of
    records, each a 4-byte checksum, a 2-byte little-endian length, a 1-byte type (1 full,
    2 first, 3 middle, 4 last) and the data; fewer than 7 bytes left in a block are zeros.
    Fails where the records do not tile the file exactly."""
    assert data[:4] == b":W&B"
    records, at, block = [], 7, 32768
    while at < len(data):
        left = block - at % block
        if left < 7:
            assert data[at : at + left] == bytes(left), at
            at += left
            continue
        length, kind = int.from_bytes(data[at + 4 : at + 6], "little"), data[at + 6]
        assert kind in (1, 2, 3, 4) and 7 + length <= left, (at, kind, length)
        records.append(data[at + 7 : at + 7 + length])
        at += 7 + length
    assert at == len(data)
    return records
