"""The README's "Will it fit?" table: peak GPU memory of the update, from the probe (fake mode).

    python tools/fit_table.py [--budget 8GiB]

For each encoder / image size / AMP setting (3 stacked frames, minibatch 256):
the peak with the whole minibatch in one backward pass, and the micro-batch
the probe picks for the budget with its peak.
"""

import argparse

import torch

from visppo.config import load_config, parse_bytes
from visppo.memory import format_bytes
from visppo.probe import Prober, probe

ROWS = [("nature", 84), ("resnet18", 128), ("resnet18", 224)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--rows", default=",".join(f"{e}:{s}" for e, s in ROWS))
    args = parser.parse_args()
    print(f"| encoder | image | amp | peak, micro-batch 256 | micro-batch for {args.budget} | its peak |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in args.rows.split(","):
        encoder, size = row.split(":")
        for amp in ("off", "bf16"):
            cfg = load_config(None, [f"model.encoder={encoder}", f"env.image_size={size}", "env.frame_stack=3",
                                     "ppo.num_envs=8", "ppo.num_steps=128", "ppo.minibatch_size=256",
                                     f"train.amp={amp}", "memory.infer_chunk_size=256"])
            prober = Prober(cfg, torch.device("cuda"), "fake")
            whole = prober.measure("micro_batch", 256, parse_bytes(args.budget))
            found = probe(cfg, args.budget, "cuda", "fake")
            micro = next(c for c in found.candidates if c.kind == "micro_batch"
                         and c.size == found.micro_batch_size)
            print(f"| {encoder} | {size}x{size} | {amp} | {format_bytes(whole.peak_bytes)} | "
                  f"{found.micro_batch_size} | {format_bytes(micro.peak_bytes)} |", flush=True)


if __name__ == "__main__":
    main()
