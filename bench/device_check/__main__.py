"""`python -m bench.device_check`: the device check's command line."""

import sys

from bench.device_check.main import main

if __name__ == "__main__":
    sys.exit(main())
