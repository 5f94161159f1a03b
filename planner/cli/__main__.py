"""`python -m planner.cli`: the planner's command line."""

from planner.cli.main import main

main()
