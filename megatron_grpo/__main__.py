import sys

from megatron_grpo.cli import main

sys.exit(main())
