"""``python -m kernels_cpu build|status``: compile the kernels once (``make setup``), or say whether they load.

Both print one line. ``build`` exits 0 even when the build fails (the torch path remains), unless
``--strict`` is given.
"""

from __future__ import annotations

import argparse
import sys
import time

from kernels_cpu.loader import build, build_dir, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels_cpu", description=__doc__)
    parser.add_argument("command", choices=["build", "status"])
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the kernels are unavailable")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    ok, why = build(verbose=args.verbose) if args.command == "build" else status()
    took = f" ({time.perf_counter() - start:.1f} s)" if args.command == "build" else ""
    print(f"kernels_cpu: {'available' if ok else 'unavailable'}{took}: {why}")
    if not ok and args.command == "build":
        print(f"kernels_cpu: build folder {build_dir()}", file=sys.stderr)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
