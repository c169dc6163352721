"""``python -m k3lab.agentenv [host|build [--force]]``: print the host decision, build the image."""
import argparse
import sys

from k3lab.agentenv.host import detect_host
from k3lab.agentenv.image import ImageError, build_image, default_cache_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3lab.agentenv", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("host", help="print what the host offers and which backend is used, and why")
    b = sub.add_parser("build", help="build the guest image (offline after the first run)")
    b.add_argument("--cache", default=None, help=f"cache folder (default {default_cache_dir()})")
    b.add_argument("--force", action="store_true", help="rebuild even if a verified image exists")
    args = p.parse_args(argv)
    if args.cmd == "build":
        try:
            img = build_image(args.cache, force=args.force)
        except ImageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"image {img.root} kernel {img.kernel_version} digest {img.digest[:16]}")
    else:
        for k, v in detect_host().as_dict().items():
            print(f"{k:18s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
