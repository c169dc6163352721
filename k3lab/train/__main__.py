"""``python -m k3lab.train``: see ``k3lab.train``'s docstring for the commands."""
import sys

from k3lab.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
