from moe_lightning.service.process_exit import exit_process
from services.gpu_expert.server import main

exit_process(main())
