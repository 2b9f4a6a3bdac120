import sys

from emapg.cli import main

sys.exit(main())
