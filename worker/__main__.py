"""Entry point of a worker process: ``python -m worker --model DIR --role ROLE`` (`worker.cli`)."""

import sys

from worker.cli import main

if __name__ == "__main__":
    sys.exit(main())
