import sys

from kilnlm.cli.main import main

sys.exit(main())
