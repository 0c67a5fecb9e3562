import sys

from services.gpu_expert.server import main

sys.exit(main())
