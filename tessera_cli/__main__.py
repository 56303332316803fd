import sys

from tessera_cli import main

sys.exit(main())
