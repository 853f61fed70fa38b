"""Documents stored as records: JSON Lines (`.jsonl`, `.jsonl.gz`, and `.json` as Hugging Face
`datasets.Dataset.to_json` writes it) and Parquet (`.parquet`, `Dataset.to_parquet`), one document
per record in its text field.

    is_record_file(path)                 -> whether the pipeline reads the file as records
    read_records(path, field)            -> iterator of (row, text or None), streamed

Bad records, by one rule: a record that cannot be a document (a line that is not JSON or not an
object, invalid UTF-8, a missing field, a field that is not text), or a file that breaks off (a
truncated or corrupt .gz or Parquet file), stops with a `RecordError` (a DataError) naming the file
and line (JSON Lines, 1-based) or row (Parquet, 0-based), since a silently thinned corpus is worse
than a clear stop; a record whose text is null or empty is no document: it is yielded as
None, and the caller counts and skips it. Blank lines of a JSON Lines file are not records.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from moebalance.data.errors import DataError, unreadable

JSON_LINES = (".jsonl", ".jsonl.gz", ".json")
PARQUET = (".parquet",)
ARRAY_HINT = ("; a JSON Lines file holds one JSON object per line (as datasets' to_json writes "
              "it), not one array")
PARQUET_BATCH_ROWS = 1024  # rows per read: bounds memory however large the file


class RecordError(DataError):
    """A record that cannot be a document; the message names the file, line or row, and the fix."""


def is_record_file(path: Path) -> bool:
    return path.name.endswith(JSON_LINES + PARQUET)


def read_records(path: Path, field: str) -> Iterator[tuple[int, str | None]]:
    """(row, text) of every record of a JSON Lines or Parquet file in file order; text None for a
    null or empty field (see the module docstring for the errors)."""
    if path.name.endswith(PARQUET):
        return _parquet_records(path, field)
    return _json_lines_records(path, field)


def _json_lines_records(path: Path, field: str) -> Iterator[tuple[int, str | None]]:
    row = 0
    for number, raw in _lines(path):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RecordError(f"{where}: not UTF-8 ({err.reason} at byte {err.start}); "
                              "re-encode the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            hint = ARRAY_HINT if line.lstrip()[:1] == "[" else ""
            raise RecordError(f"{where}: not JSON ({err.msg}){hint}") from None
        yield row, _text_of(record, field, where)
        row += 1


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of every line of a JSON Lines file, numbered from 1."""
    opener = gzip.open if path.name.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                yield number, raw
    except PermissionError as err:
        raise unreadable(path, err) from None
    except (EOFError, OSError, zlib.error) as err:  # a truncated or corrupt .gz
        raise _cut_short(path, f"after line {number}", err) from None


def _cut_short(path: Path, where: str, err: Exception) -> RecordError:
    return RecordError(f"{path}: unreadable {where} ({err}); the file is truncated or corrupt: "
                       "write it again, or leave it out")


def _text_of(record, field: str, where: str) -> str | None:
    if not isinstance(record, dict):
        hint = ARRAY_HINT if isinstance(record, list) else ""
        raise RecordError(f"{where}: a record must be a JSON object with a {field!r} field, got "
                          f"{type(record).__name__}{hint}")
    if field not in record:
        raise RecordError(f"{where}: the record has no {field!r} field (it has "
                          f"{', '.join(map(repr, list(record)[:8]))}); set dataset_text_field")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise RecordError(f"{where}: field {field!r} holds {type(text).__name__}, not text; set "
                          "dataset_text_field to a text field")
    return text or None


def _parquet_records(path: Path, field: str) -> Iterator[tuple[int, str | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise RecordError(f"{path}: not a readable Parquet file ({err})") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise RecordError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)}); set "
                          "dataset_text_field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise RecordError(f"{path}: column {field!r} is {kind}, not text; set dataset_text_field "
                          "to a text column")
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                yield row, text or None
                row += 1
    except (pa.ArrowException, OSError) as err:
        raise _cut_short(path, f"at row {row}", err) from None
