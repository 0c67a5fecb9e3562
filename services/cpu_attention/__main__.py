import sys

from services.cpu_attention.server import main

sys.exit(main())
