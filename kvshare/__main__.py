import sys

from kvshare.cli import main

sys.exit(main())
