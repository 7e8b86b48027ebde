"""`python -m nnscaler.plan --model <builder> --cluster cluster.yaml`: runs `nnscaler.cli.plan`."""

import sys

from nnscaler.cli.plan import main

sys.exit(main())
