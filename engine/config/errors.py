"""The one exception every configuration mistake becomes."""


class ConfigError(Exception):
    """A mistake in the experiment config: unknown key, wrong type, impossible combination.

    ``str(err)`` is a one-paragraph message for a human (the key, the value, the fix); entry points
    print it and exit with status 2 instead of showing a traceback (see :mod:`engine.config.cli`).
    """
