"""``python -m promptstore``: the same command line as the ``promptstore`` script."""

from promptstore.cli import main

if __name__ == "__main__":
    main(prog_name="promptstore")
