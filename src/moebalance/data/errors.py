"""The one error of the data pipeline, shared by its modules."""

from pathlib import Path

from moebalance.config import missing_path_message


class DataError(ValueError):
    """Text data that cannot be used; the message names the config key and the fix."""


def unreadable(path: Path, err: OSError) -> DataError:
    """The error of a file under `dataset_path` that cannot be read (permission denied)."""
    return DataError(f"config key `dataset_path`: cannot read {path} ({err.strerror}); make it "
                     "readable (chmod a+rX) or leave it out of dataset_path")


def missing_path(entry: str) -> DataError:
    """The error of a `dataset_path` entry that does not exist."""
    return DataError(missing_path_message(entry))
