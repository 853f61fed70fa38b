"""The one error of the data pipeline, shared by its modules, and the checks of the paths a
config names, made before anything reads them."""

from pathlib import Path

from moebalance.paths import problem


class DataError(ValueError):
    """Text data that cannot be used; the message names the config key and the fix."""


def checked_path(key: str, entry: str, want: str, fix: str, *, empty: bool = True) -> Path:
    """The path `entry` of config key `key`, once it can be read as `want` ('file' or 'either':
    paths.problem); else a DataError naming the key, the entry, the problem and `fix`."""
    path = Path(entry).expanduser()
    wrong = problem(path, want, empty=empty)
    if wrong:
        raise DataError(f"config key `{key}`: {entry!r} {wrong}; {fix}")
    return path


def unreadable(path: Path, err: OSError) -> DataError:
    """The error of a file under `dataset_path` that cannot be read (permission denied)."""
    return DataError(f"config key `dataset_path`: cannot read {path} ({err.strerror}); make it "
                     "readable (chmod a+rX) or leave it out of dataset_path")
