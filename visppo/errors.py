"""The errors visppo raises on purpose, and how the CLI shows each (a leaf: imports nothing of visppo).

``UserError`` and its ``ConfigError`` are bad input the user fixes (one ``error:`` line, exit 2);
``RunError`` a run that cannot go on (exit 1), ``EnvError`` the env's part of them; ``Stopped`` a run stopped by a signal once its
final checkpoint is written (exit 128 + the signal).
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input the user must fix; the CLI shows it as one ``error: <message>`` line, exit 2."""


class ConfigError(UserError):
    """A config the user must change."""


class RunError(RuntimeError):
    """A run that cannot go on (an env worker died, training diverged); shown as one ``error:`` line, exit 1."""


class EnvError(RunError):
    """The env failed while the run drove it (it raised, returned what it must not, or its process
    died): the message names the env; the training loop adds what the run kept on disk."""


class EnvDied(EnvError):
    """The process an env runs in died (:mod:`visppo.env_process`): the run cannot go on, whatever
    stage it was at (the env check before a run included)."""


class Stopped(BaseException):
    """A run stopped by SIGINT / SIGTERM once its final checkpoint is written: the CLI prints the
    message (where the checkpoint is, how to resume) and exits 128 + the signal (130, 143).

    A BaseException, as KeyboardInterrupt is: a signal can land inside any call (an env's reset, a
    module's import), and the ``except Exception`` that reports that call's own failures must not
    report the signal as one."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
