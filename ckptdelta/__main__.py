import sys

from ckptdelta.cli import main

sys.exit(main())
