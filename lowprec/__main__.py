"""``python -m lowprec``: the same as the ``lowprec`` command."""
from lowprec.cli import main

main(prog_name="lowprec")
