"""The configuration's one exception."""


class ConfigError(ValueError):
    """An invalid engine configuration: the message names the setting and what it accepts."""
