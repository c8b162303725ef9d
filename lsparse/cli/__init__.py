"""The lsparse command line: parses options and calls the stages (one module per group of commands); `main`
turns every error into one line and an exit status (`--debug`: the traceback)."""

from __future__ import annotations

import os
import signal
import sys
import threading

INTERRUPTED = 130
USAGE = 2


def _error_kinds() -> dict:
    """The exception classes main() answers: typer 0.29 and later bundle their own click, whose classes are
    not click's, so both are caught."""
    import typer

    from lsparse.errors import LsparseError
    kinds = {"usage": [typer.exceptions.TyperException], "exit": [typer.Exit], "abort": [typer.Abort],
             "lsparse": [LsparseError]}
    try:
        import click
        kinds["usage"].append(click.exceptions.ClickException)
        kinds["exit"].append(click.exceptions.Exit)
        kinds["abort"].append(click.exceptions.Abort)
    except ImportError:
        pass
    return {k: tuple(v) for k, v in kinds.items()}


def _interrupted(e: BaseException) -> bool:
    """Whether Ctrl-C caused `e`: a C extension interrupted while it loads raises ImportError from it."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__cause__ or e.__context__
    return False


def _exit_for(e: Exception, kinds: dict, debug: bool):
    if isinstance(e, kinds["exit"]):
        sys.exit(e.exit_code)
    if debug:
        raise e
    if isinstance(e, kinds["abort"]) or _interrupted(e):
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    if type(e).__name__ == "NoArgsIsHelpError":  # bare `lsparse`: the help, as click shows it
        e.show()
        sys.exit(USAGE)
    if isinstance(e, kinds["usage"]):
        print(f"error: {e.format_message()} (see lsparse --help, or lsparse COMMAND --help)", file=sys.stderr)
        sys.exit(USAGE)
    if isinstance(e, kinds["lsparse"]):
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if isinstance(e, OSError) and e.strerror:  # a file the user named could not be read or written
        print(f"error: {e.filename or 'a file'}: {e.strerror}", file=sys.stderr)
        sys.exit(1)
    raise e


def _on_interrupt(signum, frame):
    """Ctrl-C as KeyboardInterrupt, except inside an import: a C extension interrupted while it loads (MLX's
    nanobind) aborts the process, so there the signal is sent again shortly, until the import is done."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            threading.Timer(0.02, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


def main():
    debug, kinds = "--debug" in sys.argv[1:], None
    signal.signal(signal.SIGINT, _on_interrupt)
    try:
        kinds = _error_kinds()
        from lsparse.cli import bench, chat, image, run  # noqa: F401  (each registers its commands)
        from lsparse.cli.app import app
        # typer answers Ctrl-C inside a command by returning 130 rather than raising, when not standalone
        if app(standalone_mode=False) == INTERRUPTED:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except BrokenPipeError:
        sys.exit(1)
    except Exception as e:
        if kinds is None:
            raise
        _exit_for(e, kinds, debug)
    finally:  # the work is over: Ctrl-C while the interpreter exits (joining threads) ends it silently
        signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    main()
