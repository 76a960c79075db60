import sys

from tf_remat.cli import main

sys.exit(main())
