import sys

from vmpin.entry import main

sys.exit(main())
