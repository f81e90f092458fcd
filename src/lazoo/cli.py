"""Running a parsed `lazoo` command line: `run` calls the command's `cmd_<name>(args)` (one module each in
`lazoo.commands`) once `lazoo_cli` has parsed the arguments (`lazoo_cli.parser`, the standard library alone, so
that `--help` answers at once), and turns what a user can cause into an exit status.

Errors print one line, `lazoo <command>: error: ...`, and exit with status 2 (Ctrl-C: `lazoo <command>:
interrupted`, status 130). train, card, eval and demo never delete or overwrite a file they did not write unless
given `--overwrite`: they refuse before doing any work, naming the file (a new `lazoo train` run needs a new or
empty --output). `python -m lazoo.cli ...` is the `lazoo` command.
"""

from __future__ import annotations

import sys

from lazoo_cli import exit_status, main, silence_stdout
from lazoo_cli.parser import ArgumentParser, add_training_arguments, build_parser

# the commands, which `run` calls by name
from .commands.bench import cmd_bench
from .commands.cards import cmd_card, cmd_cards
from .commands.convert import cmd_convert
from .commands.demo import cmd_demo
from .commands.evaluate import cmd_eval
from .commands.generate import cmd_generate
from .commands.list_mechanisms import cmd_list
from .commands.train import cmd_train, run_training
from .user_input import CLIError

__all__ = ["main", "run", "build_parser", "add_training_arguments", "ArgumentParser", "CLIError", "run_training"]

def run(args, argv: list[str]) -> int:
    """Run the command `args` (parsed from `argv` by lazoo_cli) and return its exit status; the errors a user can
    cause are one line on stderr (see the module's docstring)."""
    try:
        return globals()[f"cmd_{args.command}"](args)  # looked up here when it runs (a test may replace one)
    except CLIError as err:
        return _fail(argv, str(err))
    except BrokenPipeError:  # the reader of the output went away (`lazoo list | head -1`): nothing to say
        silence_stdout()
        return 141
    except OSError as err:  # a file in the way, a read-only folder, a full disk: expected, said in one line
        return _fail(argv, _os_error_message(err))
    except UnicodeError as err:  # text that is not UTF-8 where no check above named it
        return _fail(argv, f"text that is not UTF-8: {err}")
    except KeyboardInterrupt:  # Ctrl-C: checkpoints written so far are complete (see lazoo.trainer.LazooTrainer)
        print(f"lazoo {_command(argv)}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exit_:  # a check by argparse after parsing, and subcommands that exit
        return exit_status(exit_)


def _command(argv: list[str]) -> str:
    return argv[0] if argv and not argv[0].startswith("-") else ""


def _fail(argv: list[str], message: str) -> int:
    """Print `lazoo <command>: error: <message>` as one line; status 2."""
    print(f"lazoo {_command(argv)}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def _os_error_message(err: OSError) -> str:
    """`path: reason` for an OSError from the system (errno set), else its own message."""
    if err.errno is None or err.strerror is None:
        return str(err)
    files = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
    return f"{files}: {err.strerror}" if files else err.strerror


if __name__ == "__main__":
    sys.exit(main())
