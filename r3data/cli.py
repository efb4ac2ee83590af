"""``r3data`` command line: a thin shell over the library."""

from __future__ import annotations

import argparse
import sys

import torch

from r3data.batch import TensorBatch
from r3data.packed import PackedTensor


def demo(args: argparse.Namespace) -> int:
    """Pack ragged route rows, collate them into a batch and compare with a padded rectangle."""
    lengths = torch.randint(1, args.max_len, (args.rollouts,)).tolist()
    rows = [torch.randint(0, 128, (n, 48, 8), dtype=torch.uint8) for n in lengths]
    routes = PackedTensor.from_segments(rows)
    batch = TensorBatch({"routes": routes, "ids": [f"r{i}" for i in range(len(rows))]})
    padded_bytes = len(rows) * max(lengths) * 48 * 8
    print(batch)
    print(f"packed bytes {routes.values.nbytes:,} vs padded {padded_bytes:,}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="r3data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help=demo.__doc__)
    demo_parser.add_argument("--rollouts", type=int, default=64)
    demo_parser.add_argument("--max-len", type=int, default=4096)
    demo_parser.set_defaults(run=demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
