import sys

from services.weight_store.server import main

sys.exit(main())
