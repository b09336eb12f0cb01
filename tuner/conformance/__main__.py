import sys

from tuner.conformance.record import main

sys.exit(main())
