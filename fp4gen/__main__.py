import sys

from fp4gen.cli import main

sys.exit(main())
