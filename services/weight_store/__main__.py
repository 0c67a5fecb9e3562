from moe_lightning.service.process_exit import exit_process
from services.weight_store.server import main

exit_process(main())
