"""``python -m iron_batch.server``."""

from iron_batch.server.cli import main

if __name__ == "__main__":
    main()
