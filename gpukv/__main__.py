import sys

from gpukv.tools.cli import main

sys.exit(main())
