#!/usr/bin/env python3
"""Write a random checkpoint of an architecture with a tokenizer trained offline.

    python scripts/make_tiny_model.py --arch llama --preset tiny --out models/tiny
    python scripts/make_tiny_model.py --arch llama --preset bench-124m --out models/bench-124m

Presets live in flover/presets/*.json. Same arguments => the same files (fixed seed).
"""

import argparse
import sys

from flover.testing.tiny_model import ARCHS, make_tiny_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--preset", default="tiny", help="name in flover/presets or a JSON file")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = make_tiny_model(args.arch, args.preset, args.out, seed=args.seed)
    print(f"wrote {path} ({args.arch}, preset {args.preset}; random weights: its text is meaningless)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
