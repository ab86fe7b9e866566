"""``visppo train | eval | export | plot | probe | bench | config``: argument parsing and error reporting, nothing else.

Bad input never shows a traceback: it prints one ``error:`` line that says what
to change and exits with code 2. Under ``torchrun`` every process parses the same
input, so bad input is reported once per machine (by local rank 0).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import sys
import threading
from pathlib import Path

from visppo.config import RESUMABLE, field_docs, load_config, names_a_file
from visppo.errors import ConfigError, RunError, Stopped, UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: same one-line form
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")  # prog: "visppo" or "visppo train"


_OVERRIDE = re.compile(r"[^=/]*=")
"""An override's start: a key without '/' (a path such as runs/lr=3e-4/config.yaml is a config)."""


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]``: the first argument is a config file unless it is an override."""
    if args and (not _OVERRIDE.match(args[0]) or names_a_file(args[0])):
        first = args[0]
        if not first.endswith((".yaml", ".yml")) and not Path(first).is_file():
            raise ConfigError(f"'{first}' is neither a YAML config file nor a key=value override "
                              "(e.g. ppo.num_envs=4)")
        return first, args[1:]
    return None, args


def cmd_train(ns: argparse.Namespace) -> int:
    from visppo.checkpoint import load_for_resume
    from visppo.loop import train

    if ns.resume:
        if any(not _OVERRIDE.match(a) for a in ns.args):  # a config path, even one holding '='
            raise ConfigError("--resume takes the saved config: give only key=value overrides, no CONFIG")
        cfg, ckpt = load_for_resume(ns.resume, ns.args)
        run_dir = train(cfg, resume=ckpt)
    else:
        path, overrides = _split(ns.args)
        run_dir = train(load_config(path, overrides))
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        print(f"visppo: run finished in {run_dir}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _leave_without_finalization()
    return 0


def _leave_without_finalization() -> None:
    """End a torchrun rank after a clean run with ``os._exit(0)``. By now every file is closed and
    the process group destroyed (after a barrier), yet gloo's worker threads can still abort the
    interpreter's finalization (SIGABRT, "terminate called without an active exception"): CI saw a
    rank fail so twice after its run had finished and written everything, and torchrun then
    reports the run as failed. Nothing is left to finalize, so the rank skips it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cmd_bench(ns: argparse.Namespace) -> int:
    from visppo.bench import bench_devices, format_devices

    if ns.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {ns.repeats}")
    path, overrides = _split(ns.args)
    cfg = load_config(path, overrides)
    print(format_devices(bench_devices(cfg, repeats=ns.repeats)))
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    """Episodes of a trained policy: mean/std return, success rate, optional video and JSON."""
    from visppo.evaluate import evaluate, format_result

    if ns.episodes < 1:
        raise ConfigError(f"--episodes must be at least 1, got {ns.episodes}")
    if not 0 <= ns.seed < 2**31:  # the evaluation stream's seeds are drawn from it as numpy's 32-bit seeds
        raise ConfigError(f"--seed must be in 0 .. 2**31 - 1, got {ns.seed}")
    result = evaluate(ns.source, ns.episodes, deterministic=ns.deterministic,
                      video=Path(ns.video) if ns.video else None,
                      json_path=Path(ns.json) if ns.json else None, seed=ns.seed,
                      env_overrides=ns.overrides)
    print(format_result(result))
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    """A run's policy as a folder (safetensors, config, model card), ONNX, pt2 or TorchScript."""
    from visppo.export import export

    out = export(ns.run, ns.out, ns.format)
    print(f"visppo: wrote {out} ({ns.format})")
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    """Learning curves of one or more runs, overlaid."""
    from visppo.plot import plot_runs

    out = plot_runs([Path(d) for d in ns.runs], Path(ns.out), smooth=ns.smooth)
    print(f"visppo: wrote {out}")
    return 0


def cmd_probe(ns: argparse.Namespace) -> int:
    """Largest micro-batch and inference chunk of a config under a memory budget."""
    from visppo.atomic import atomic_write_text, check_writable
    from visppo.config import to_yaml
    from visppo.plot import check_format
    from visppo.probe import format_table, plot, probe, write_json

    path, overrides = _split(ns.args)
    cfg = load_config(path, overrides)
    device = ns.device or ("cuda" if cfg.train.device == "auto" else cfg.train.device)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got '{device}'")
    for option, out in (("--json", ns.json), ("--plot", ns.plot), ("--write-config", ns.write_config)):
        if out is not None:
            check_writable(Path(out), option)
    if ns.plot:
        check_format(Path(ns.plot))
    if ns.budget is not None:
        _check_budget(ns.budget)
    result = probe(cfg, ns.budget or cfg.memory.budget, device, ns.mode, ns.margin)
    print(format_table(result))
    if ns.json:
        write_json(result, Path(ns.json))
    if ns.plot:
        plot(result, Path(ns.plot))
    if ns.write_config:
        cfg.memory.micro_batch_size = result.micro_batch_size
        cfg.memory.infer_chunk_size = result.infer_chunk_size
        atomic_write_text(Path(ns.write_config), to_yaml(cfg))
    return 0


def _check_budget(budget: str) -> None:
    """``--budget`` as ``memory.budget`` takes it: a size (8GiB, 6000MB, bytes), positive."""
    from visppo.config import MAX_INT, parse_bytes

    try:
        size = parse_bytes(budget)
    except (ValueError, OverflowError):
        raise ConfigError(f"--budget '{budget}' is not a size like 8GiB, 6000MB or 1073741824") from None
    if not 0 < size <= MAX_INT:
        raise ConfigError(f"--budget {budget} is out of range (a size above 0 and at most {MAX_INT:.0e} bytes)")


def cmd_config(ns: argparse.Namespace) -> int:
    """Print the resolved config, or the reference of every key."""
    from visppo.config import to_yaml

    if ns.reference:
        for key, (typ, default, doc) in field_docs().items():
            print(f"{key:32s} {typ:16s} {default!s:22s} {doc}")
        return 0
    path, overrides = _split(ns.args)
    print(to_yaml(load_config(path, overrides)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="visppo", description="PPO for robot policies from camera images.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("train", help="train a policy: visppo train [CONFIG] [key=value ...]")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]",
                   help="a YAML file from configs/ and/or overrides such as ppo.num_envs=4")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a run from its checkpoints/latest.pt, or from RUN_DIR/checkpoints/iter_N.pt "
                        f"(overrides only for {', '.join(RESUMABLE)})")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("bench", help="bench devices: time acting and one micro-batch update per device")
    p.add_argument("what", choices=["devices"], help="what to benchmark")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (median reported)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("eval", help="evaluate a run or checkpoint: visppo eval RUN_DIR_OR_CKPT")
    p.add_argument("source", metavar="RUN_DIR_OR_CKPT")
    p.add_argument("overrides", nargs="*", metavar="env.KEY=VALUE",
                   help="evaluate in a changed env, e.g. env.kwargs.look=published (env keys only)")
    p.add_argument("--episodes", type=int, default=10, help="episodes to run (10)")
    p.add_argument("--deterministic", action="store_true", help="act with the mean / most likely action")
    p.add_argument("--video", metavar="FILE", help="write a video (.mp4, or .gif)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--seed", type=int, default=0, help="evaluation stream: its episodes' seeds are drawn from it and never "
                   "meet a training episode's (0)")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("export", help="export a policy: visppo export RUN_DIR_OR_CKPT --out DIR "
                       "[--format folder|onnx|pt2|torchscript]")
    p.add_argument("run", metavar="RUN_DIR_OR_CKPT")
    p.add_argument("--format", default="folder", choices=["folder", "onnx", "pt2", "torchscript"],
                   help="folder: model.safetensors, config.yaml, policy.json, README.md (the Hugging Face "
                        "Hub's layout; the default); onnx / pt2 (torch.export) / torchscript: one network, "
                        "stacked uint8 frames in, action out, and policy.json")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to create (new or empty)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("plot", help="learning curves: visppo plot RUN_DIR... [--out FILE]")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="curves.png", help="output image (curves.png)")
    p.add_argument("--smooth", type=int, default=10, help="moving-average window in log rows (10)")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser("probe", help="largest micro-batch / inference chunk that fit a memory budget")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--budget", help="memory budget, e.g. 8GiB (default: memory.budget)")
    p.add_argument("--device", help="target device: cuda (default when train.device=auto) or cpu")
    p.add_argument("--mode", choices=["fake", "real"],
                   help="fake: no memory allocated (default when the device is absent); real: run it")
    p.add_argument("--margin", type=float, default=None,
                   help="fraction of the budget kept free (default 0.10; 0.25 for fp32 on a GPU, whose "
                        "caching allocator keeps more beyond what the passes allocate: docs/memory.md)")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    p.add_argument("--plot", metavar="FILE", help="plot peak memory against size (PNG)")
    p.add_argument("--write-config", metavar="FILE", help="write the config with the sizes found")
    p.set_defaults(func=cmd_probe)
    p = sub.add_parser("config", help="print the resolved config (or --reference: every key)")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--reference", action="store_true", help="list every key with type, default and doc")
    p.set_defaults(func=cmd_config)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, letting positionals follow options too (``probe C --budget 8GiB a.b=1``,
    ``eval RUN --episodes 1 env.image_size=64``): argparse alone takes positionals only before the
    first option, so a command with positionals left over is parsed again, intermixed."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    ns, extra = parser.parse_known_args(argv)
    if not extra:
        return ns
    command = _command_parser(parser, ns.command)
    rest = argv[argv.index(ns.command) + 1:]
    return command.parse_intermixed_args(rest, namespace=argparse.Namespace(command=ns.command))


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of the subcommand ``name`` (argparse keeps it in its subparsers action)."""
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def _one_line(exc: Exception) -> str:
    """An error as one line (a library's text inside it may hold line breaks)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


# The errors that only a write raises (a full disk, a read-only file system, a quota); any other
# OSError may come from a read, so the catch-all does not call it a write.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG})


def _sigterm(signum: int, frame) -> None:
    raise Stopped("visppo: stopped by SIGTERM; nothing to save yet", signum)


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm) if main_thread else None  # not silent (train: saves)
    try:
        return _run(ns)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run(ns: argparse.Namespace) -> int:
    """The command, its errors as one line and an exit code (2: bad input, 1: a run that failed,
    128 + N: stopped by signal N)."""
    try:
        return ns.func(ns)
    except UserError as exc:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # the other processes of a torchrun read the same input
            print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except Stopped as exc:  # SIGINT / SIGTERM: the final checkpoint is written
        if os.environ.get("RANK", "0") == "0":
            print(exc, file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("visppo: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # a file system that failed the command: the file and the cause
        where = f" {exc.filename}" if exc.filename else ""
        if exc.errno == errno.ENAMETOOLONG:  # a path the user gave: bad input
            name = str(exc.filename or "")
            shown = name if len(name) <= 80 else f"{name[:77]}..."
            print(f"error: the path {shown} is too long (a name over 255 bytes): choose a shorter one", file=sys.stderr)
            return 2
        verb = "cannot write" if exc.errno in _WRITE_ERRNOS else "cannot use"
        print(f"error: {verb}{where}: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
