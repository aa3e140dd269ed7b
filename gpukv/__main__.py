import sys

from gpukv.cli import main

sys.exit(main())
