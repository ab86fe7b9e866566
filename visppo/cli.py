"""``visppo train | bench | config``: argument parsing and error reporting, nothing else.

Bad input never shows a traceback: it prints one ``error:`` line that says what
to change and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from visppo.config import ConfigError, RunError, UserError, field_docs, load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: same one-line form
        self.exit(2, f"error: {message} (see visppo {self.prog.split()[-1]} --help)\n")


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]``: the first argument is a config file unless it has an '='."""
    if args and "=" not in args[0]:
        first = args[0]
        if not first.endswith((".yaml", ".yml")) and not Path(first).is_file():
            raise ConfigError(f"'{first}' is neither a YAML config file nor a key=value override "
                              "(e.g. ppo.num_envs=4)")
        return first, args[1:]
    return None, args


def cmd_train(ns: argparse.Namespace) -> int:
    from visppo.train import load_for_resume, train

    if ns.resume:
        if ns.args and "=" not in ns.args[0]:
            raise ConfigError("--resume takes the saved config: give only key=value overrides, no CONFIG")
        cfg, ckpt = load_for_resume(ns.resume, ns.args)
        run_dir = train(cfg, resume=ckpt)
    else:
        path, overrides = _split(ns.args)
        run_dir = train(load_config(path, overrides))
    print(f"visppo: run finished in {run_dir}")
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from visppo.bench import bench_devices, format_devices

    path, overrides = _split(ns.args)
    cfg = load_config(path, overrides)
    print(format_devices(bench_devices(cfg, repeats=ns.repeats)))
    return 0


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
                   help="continue a run from its checkpoints/latest.pt (may raise ppo.total_steps)")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("bench", help="bench devices: time acting and one micro-batch update per device")
    p.add_argument("what", choices=["devices"], help="what to benchmark")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (median reported)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("config", help="print the resolved config (or --reference: every key)")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value]")
    p.add_argument("--reference", action="store_true", help="list every key with type, default and doc")
    p.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("visppo: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
