"""Errors that are the user's to fix, as opposed to bugs.

The CLI prints a `UserError` as one line and exits 2; the engine service sends
it back as an error reply; the GUI shows it in place. Anything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: an unknown profile or model, an unreadable file, a contradictory flag."""
