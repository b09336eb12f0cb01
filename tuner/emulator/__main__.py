import sys

from tuner.emulator.emulator import main

sys.exit(main())
