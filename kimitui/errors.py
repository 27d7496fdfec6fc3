"""Errors that reach the user as one line and exit code 2, never a traceback."""


class UserError(Exception):
    """A mistake the user can fix: bad config, a missing file, a bad flag."""

    exit_code = 2
