"""`python -m hlomap.cli`: the `hlomap` command."""

from hlomap.cli import main

main()
