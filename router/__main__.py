"""``python -m router``: same as the ``router`` console script."""

from router.cli import main

main()
