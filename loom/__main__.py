"""``python -m loom ...`` and ``torchrun -m loom train ...``."""

from loom.cli import main

if __name__ == "__main__":
    main()
