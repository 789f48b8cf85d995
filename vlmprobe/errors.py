"""The one exception type for bad input: its message is the single line the user sees."""


class ConfigError(ValueError):
    """A configuration value that is not allowed; the message names the value and what is allowed."""
