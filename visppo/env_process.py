"""One env in a process of its own, so that a crash of its code is the env's error, not the run's end.

A user's env (``module:EnvId``) may segfault or call ``os._exit``; in the training process nothing
runs after that (exit 139, no message). :class:`EnvProcess` builds the env in a forkserver child
and forwards ``reset``, ``step``, ``render``, ``close`` and (where the env has one) its side camera
``render_view`` to it through a pipe: what the env returns or raises (``sys.exit`` included)
arrives unchanged, and a child that dies makes the call raise an :class:`EnvDied` naming the env
and how its process ended. Vector envs of such envs step in gymnasium's async workers instead
(:func:`visppo.envs.use_async`), whose deaths :func:`visppo.envs.worker_errors` names with
:func:`how_it_ended`.
(A leaf: imports nothing of visppo but its errors.)
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from visppo.errors import EnvDied

VIEW = "render_view"
"""The side camera of visppo's tasks and DMC envs (on the env's ``unwrapped``), which evaluation
videos show beside the policy's frames."""

in_worker = False
"""Whether this process is an env worker (an EnvProcess's, or an async vector env's): set where one
starts. Not ``multiprocessing.parent_process()``: a learner started by a sweep's pool has a parent
too, and must keep its stop signals."""


def how_it_ended(exitcode: int | None) -> str:
    """A dead env process's exit code in words, with what ends a process that way: "died of signal
    SIGSEGV (a crash in the env's code or a library it calls)", "exited with code 3 (...)"."""
    if exitcode is None:
        return "closed its pipe"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"died of signal {name} (a crash in the env's code or a library it calls)"
    return f"exited with code {exitcode} (sys.exit or os._exit in the env's code)"


class EnvProcess(gym.Env):
    """The env ``build()`` returns, built and stepped in a child process (started with
    ``start_method``); ``name`` is the env as the user named it (``env.id``), for the error of a
    child that dies."""

    def __init__(self, build: Callable[[], gym.Env], name: str, start_method: str = "forkserver"):
        ctx = multiprocessing.get_context(start_method)
        self.name = name
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, build, sys.path), daemon=True,
                                    name=f"env {name}")
        self._process.start()
        child.close()  # the child's end lives in the child alone: its death is an EOF here
        self._open = True
        try:
            (self.observation_space, self.action_space, self.metadata, self.render_mode,
             self.spec, has_view) = self._call("constructor")
        except BaseException:
            self._end()
            raise
        if has_view:  # evaluation videos look it up with getattr(env.unwrapped, "render_view", None)
            self.render_view = self._render_view

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return self._call("reset", seed=seed, options=options)

    def step(self, action):
        return self._call("step", action)

    def render(self):
        return self._call("render")

    def _render_view(self, width: int = 480, height: int = 480):
        """The inner env's ``render_view`` (a side camera for videos): ``render_view`` of this
        env only where the inner env has one, so that a video without one has no side panel."""
        return self._call(VIEW, width=width, height=height)

    def close(self) -> None:
        if not self._open:
            return
        try:
            if self._process.is_alive():
                self._call("close")
        finally:
            self._end()

    def _end(self) -> None:
        """Close the pipe and reap the child (killed if it has not ended 10 s after its pipe closed)."""
        self._open = False
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            if method != "constructor":
                self._conn.send((method, args, kwargs))
            status, value = self._conn.recv()
        except (EOFError, OSError):  # the child is gone: a crash of the env's code
            self._end()
            code = self._process.exitcode
            if method == "constructor" and code is not None and code > 0:  # it never answered
                raise EnvDied(f"env {self.name}: the process it runs in exited with code {code} before the "
                               "env was built: see the error printed above (a script that starts visppo needs "
                               "the `if __name__ == \"__main__\":` guard of multiprocessing), or os._exit in "
                               "the env's constructor") from None
            where = "its constructor" if method == "constructor" else f"{method}()"
            raise EnvDied(f"env {self.name}: during {where}, the process it runs in {how_it_ended(code)}") from None
        if status == "raised":
            raise value
        return value


def _serve(conn, build: Callable[[], gym.Env], path: list[str]) -> None:
    """The child: build the env, then answer (method, args, kwargs) until close or the parent's EOF.
    ``path`` is the parent's ``sys.path`` now (the forkserver has the one of its own start)."""
    global in_worker
    in_worker = True
    sys.path[:] = path
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's to handle (it closes this env)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        env = build()
        _answer(conn, "returned", (env.observation_space, env.action_space, env.metadata, env.render_mode,
                                   _picklable(env.spec), callable(getattr(env.unwrapped, VIEW, None))))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it (sys.exit too)
        _answer(conn, "raised", exc)
        return
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            env.close()
            return
        try:
            owner = env.unwrapped if method == VIEW else env  # gymnasium's wrappers do not forward it
            _answer(conn, "returned", getattr(owner, method)(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001
            _answer(conn, "raised", exc)
        if method == "close":
            return


def _answer(conn, status: str, value: Any) -> None:
    """Send (status, value); what cannot travel through the pipe is raised there as a TypeError."""
    if status == "raised":
        value = _picklable(value) or RuntimeError(f"{type(value).__name__}: {value}")
    try:
        data = pickle.dumps((status, value))
    except Exception as exc:  # noqa: BLE001 - e.g. a generator returned by the env
        data = pickle.dumps(("raised", TypeError(f"the env returned a {type(value).__name__} that cannot be "
                                                 f"sent between processes ({type(exc).__name__}: {exc})")))
    conn.send_bytes(data)


def _picklable(value: Any) -> Any:
    """``value`` if it survives a pickle round trip (an exception whose class needs other
    arguments does not), else None."""
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:  # noqa: BLE001
        return None
    return value
