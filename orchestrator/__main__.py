from moe_lightning.service.process_exit import exit_process
from orchestrator.server import main

exit_process(main())
