"""Regenerate docs/scaling.md, the small-σ exponents of every variant's blocks (symhess.cli.scaling).

Usage (from the repository root):  python docs/scaling_table.py [--check]
"""
import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from symhess.cli.scaling import markdown  # noqa: E402

TARGET = ROOT / "docs" / "scaling.md"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/scaling.md is stale")
    args = ap.parse_args(argv)
    text = markdown()
    if args.check:
        if TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET} is out of date; run python docs/scaling_table.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
