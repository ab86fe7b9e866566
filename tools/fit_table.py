"""Peak GPU memory of the update, from the probe (fake mode): the table under docs/memory.md's
"Will it fit on an 8 GiB GPU? Estimates".

    python tools/fit_table.py [--budget 8GiB] [--rows nature:84,resnet18:128] [--amp off,bf16]

For each encoder / image size / AMP setting (3 stacked frames, minibatch 256):
the peak with the whole minibatch in one backward pass, and the micro-batch
the probe picks for the budget with its peak.
"""

import argparse
import sys

import torch

from visppo.config import load_config, parse_bytes
from visppo.errors import ConfigError, UserError
from visppo.memory import format_bytes
from visppo.probe import Prober, probe

ROWS = [("nature", 84), ("resnet18", 128), ("resnet18", 224)]


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one ``error:`` line too, exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (see --help)\n")


def parse_rows(text: str) -> list[tuple[str, int]]:
    """'nature:84,resnet18:128' -> [('nature', 84), ('resnet18', 128)] (a UserError if malformed)."""
    rows = []
    for item in text.split(","):
        encoder, _, size = item.partition(":")
        if not encoder or not size.isdigit() or int(size) < 1:
            raise ConfigError(f"--rows {text!r}: give ENCODER:IMAGE_SIZE pairs, e.g. nature:84,resnet18:128")
        rows.append((encoder, int(size)))
    return rows


def config_of(encoder: str, size: int, amp: str):
    """The config of one row: 3 stacked frames, 8 envs x 128 steps, minibatch 256."""
    return load_config(None, [f"model.encoder={encoder}", f"env.image_size={size}", "env.frame_stack=3",
                              "ppo.num_envs=8", "ppo.num_steps=128", "ppo.minibatch_size=256",
                              f"train.amp={amp}", "memory.infer_chunk_size=256"])


def row(encoder: str, size: int, amp: str, budget: str) -> str:
    """One table row from the probe in fake mode (no GPU needed: nothing is allocated)."""
    cfg = config_of(encoder, size, amp)
    prober = Prober(cfg, torch.device("cuda"), "fake")
    whole = prober.measure("micro_batch", 256, parse_bytes(budget))
    found = probe(cfg, budget, "cuda", "fake")
    micro = next(c for c in found.candidates if c.kind == "micro_batch" and c.size == found.micro_batch_size)
    return (f"| {encoder} | {size}x{size} | {amp} | {format_bytes(whole.peak_bytes)} | "
            f"{found.micro_batch_size} | {format_bytes(micro.peak_bytes)} |")


def table(rows: list[tuple[str, int]], amps: list[str], budget: str) -> list[str]:
    """Every row, probed before any is printed: a row the probe refuses (nothing fits the budget)
    is one error naming it, not half a table."""
    lines = []
    for encoder, size in rows:
        for amp in amps:
            try:
                lines.append(row(encoder, size, amp, budget))
            except UserError as exc:
                raise UserError(f"{encoder}:{size} with amp {amp}: {exc}") from None
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="8GiB", help="GPU memory budget (8GiB)")
    parser.add_argument("--rows", default=",".join(f"{e}:{s}" for e, s in ROWS),
                        help="ENCODER:IMAGE_SIZE pairs, comma-separated")
    parser.add_argument("--amp", default="off,bf16", help="train.amp settings, comma-separated (off,bf16)")
    args = parser.parse_args(argv)
    try:
        parse_bytes(args.budget)
        rows = parse_rows(args.rows)
        amps = args.amp.split(",")
        for encoder, size in rows:  # every row's config is valid before the first is probed
            for amp in amps:
                config_of(encoder, size, amp)
    except (UserError, ValueError) as exc:  # parse_bytes: ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        lines = table(rows, amps, args.budget)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"| encoder | image | amp | peak, micro-batch 256 | micro-batch for {args.budget} | its peak |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
