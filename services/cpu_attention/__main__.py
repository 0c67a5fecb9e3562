from moe_lightning.service.process_exit import exit_process
from services.cpu_attention.server import main

exit_process(main())
