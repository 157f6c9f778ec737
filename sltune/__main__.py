import sys

from sltune.cli.main import main

sys.exit(main())
