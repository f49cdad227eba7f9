"""The one exception every configuration mistake becomes."""


class ConfigError(Exception):
    """A mistake in the experiment config: unknown key, wrong type, impossible combination.

    ``str(err)`` is a one-paragraph message for a human (the key, the value, the fix); entry points
    print it and exit with status 2 instead of showing a traceback (see :mod:`engine.config.cli`).
    """


class InputError(ConfigError):
    """A file or folder the config names is missing or unusable (model, tokenizer, data, reward
    function); the message names the key and the path. Found before any process group starts."""
