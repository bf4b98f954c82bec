"""`python -m palimpsest.cli`."""

from palimpsest.cli import main

main()
