"""User-facing errors: one clear line, exit code 2, no traceback (the CLI catches these)."""

__all__ = ["UserError"]


class UserError(Exception):
    """Bad input from the user (a path, a config, a flag). The message is the whole story."""

    exit_code = 2
