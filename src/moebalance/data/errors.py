"""The one error of the data pipeline, shared by its modules."""


class DataError(ValueError):
    """Text data that cannot be used; the message names the config key and the fix."""
