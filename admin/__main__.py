"""`python -m admin`: the same commands as the `reservations` console script."""

from admin.cli import main

main()
