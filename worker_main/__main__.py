"""Entry point of a worker process: ``python -m worker_main --model DIR --role ROLE``."""

import sys

from worker.cli import main
from worker_main import ROLES

if __name__ == "__main__":
    sys.exit(main(ROLES))
