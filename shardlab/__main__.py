"""`python -m shardlab`: the command line (shardlab.cli.main)."""

from shardlab.cli.main import run

if __name__ == "__main__":
    run()
