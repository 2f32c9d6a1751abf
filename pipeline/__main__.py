"""`python -m pipeline ...` is the `tokenmill` command (`pipeline.cli.main`), for an environment
where the console script is not on PATH (a virtualenv not activated, `pip install --no-deps`)."""
import sys

from pipeline.cli import main

sys.exit(main())
