from megatron_grpo.cli import main
import sys
sys.exit(main())
