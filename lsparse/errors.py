class LsparseError(Exception):
    """A problem with the user's input or machine: the CLI shows it as one line, without a traceback."""
