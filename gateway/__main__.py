from gateway.server import main
from moe_lightning.service.process_exit import exit_process

exit_process(main())
