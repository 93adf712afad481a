"""The predict job: its request, its code and INPUT's parts in the store, and OUTPUT made from
the parts it wrote."""

from __future__ import annotations

import dataclasses
import tempfile
from contextlib import contextmanager
from pathlib import Path

from pipeline.config import Settings
from pipeline.errors import PipelineError, log
from pipeline.jobs import ProcessingJob
from pipeline.paths import PredictionTree
from pipeline.predict.checks import Chosen
from pipeline.predict.files import (
    PART,
    OutputWriter,
    read_rows,
    write_parts,
)
from pipeline.stages import processing_job
from pipeline.store import (
    Store,
    file_sha256,
    upload_dir,
)
from steps.runtime.names import USER_FUNCTIONS_VARIABLE


def predict_job(
    settings: Settings, chosen: Chosen, prediction: PredictionTree, instance_count: int
) -> ProcessingJob:
    """The processing job: [inference]'s instance type, batch size and MODEL_FORMAT; the
    run's own user functions; the texts split across the instances by S3 key."""
    inputs = {
        "texts": prediction.input,
        "model": chosen.model_key,
        "labels": chosen.data.split("labels"),
    }
    given = {"model_name": chosen.model, "text_columns": chosen.text_columns}
    job = processing_job(
        settings,
        chosen.run,
        "predict",
        inputs,
        {"predictions": prediction.output},
        given,
        settings.inference.instance_type,
        chosen.model,
    )
    env = {**job.env, USER_FUNCTIONS_VARIABLE: chosen.user_functions}
    return dataclasses.replace(
        job,
        code=prediction.code,
        env=env,
        instance_count=instance_count,
        sharded_inputs=("texts",),
    )


def upload_texts(
    store: Store,
    source: Path,
    kind: str,
    columns: list[str],
    prediction: PredictionTree,
    kinds: dict[str, str] | None = None,
) -> list[int]:
    """INPUT as parquet parts in the store; the rows of each part (`kinds`: the columns that
    are not text, files.read_rows)."""

    told = [0]  # parts end at PART_ROWS rows or PART_CHARS characters: a line per 100,000 rows

    def tell(rows: int) -> None:
        if rows // 100_000 > told[0]:
            told[0] = rows // 100_000
            log.info(f"read {rows:,} rows of {source}")

    with tempfile.TemporaryDirectory(prefix="smpipe-predict-input-") as tmp:
        rows = read_rows(source, kind, columns, kinds)
        sizes = write_parts(rows, Path(tmp), columns, tell, kinds)
        if sizes:
            upload_dir(store, tmp, prediction.input)
    return sizes


LISTED = 100  # malformed rows named in the record (the output's `error` column has them all)


def write_output(
    store: Store, prediction: PredictionTree, sizes: list[int], output: Path, kind: str
) -> tuple[dict, Path]:
    """OUTPUT from the job's parts, in the input's order, written whole to a hidden file beside
    it (`place` renames it into place); the counts and the first LISTED malformed rows, and
    that file. A write that fails (a full disk) is one PipelineError naming OUTPUT."""
    keys = set(store.list_keys(prediction.output))
    counts = {"rows": 0, "predicted": 0, "malformed": 0}
    listed: list[dict] = []
    columns: list[str] = []
    with writing(output):
        writer = OutputWriter(output, kind)
    try:
        with tempfile.TemporaryDirectory(prefix="smpipe-predict-output-") as tmp:
            for number, size in enumerate(sizes):
                table = read_part(store, prediction.output + PART.format(number), keys, tmp)
                if table.num_rows != size:
                    raise PipelineError(
                        f"part {number} of the predictions has {table.num_rows} rows where its "
                        f"input had {size}: {store.uri_of(prediction.output)}"
                    )
                with writing(output):
                    writer.write(table)
                columns = [c for c in table.column_names if c != "row"]
                errors = table.column("error").to_pylist()
                ids = table.column("id").to_pylist()
                bad = [(i, e) for i, e in zip(ids, errors, strict=True) if e]
                listed += [{"id": i, "error": e} for i, e in bad[: LISTED - len(listed)]]
                counts["rows"] += size
                counts["malformed"] += len(bad)
                counts["predicted"] += size - len(bad)
        with writing(output):
            written = writer.finish()
            digest = file_sha256(written)
    except BaseException:
        writer.discard()
        raise
    return {
        "columns": columns,
        **counts,
        "malformed_rows": listed,
        "output_sha256": digest,
    }, written


@contextmanager
def writing(path: Path):
    """An OSError while writing `path` (beside it: a full disk, a folder made read-only
    since the check) as one line naming it; the traceback says nothing the user can act on."""
    import pyarrow as pa

    try:
        yield
    except (OSError, pa.ArrowException) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise PipelineError(f"cannot write {path} ({why}): it was not written") from None


def read_part(store: Store, key: str, keys: set[str], tmp: str):
    import pyarrow.parquet as pq

    if key not in keys:  # every instance writes a part for each part it was given
        raise PipelineError(f"the job wrote no predictions for {store.uri_of(key)}")
    path = Path(tmp, "part.parquet")
    store.download_file(key, path)
    table = pq.read_table(path)
    path.unlink()
    return table


def remove_input(store: Store, prediction: PredictionTree) -> None:
    """The parts of INPUT are a copy of the user's texts, only the job's to read: once it
    has ended they go (the record keeps INPUT's sha256)."""
    for key in store.list_keys(prediction.input):
        store.delete(key)
