"""`python -m nnscaler.plan --model <builder> --cluster cluster.yaml`: print autodist's plan report."""

import sys

from nnscaler.parallel.plan_cli import main

sys.exit(main())
