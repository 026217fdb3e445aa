"""`python -m vitscale` is the same as the `vitscale` command."""
from vitscale.cli import main

raise SystemExit(main())
