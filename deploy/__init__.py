"""pdserve deployment: the `pdserve` command line (`deploy.cli`) and its subcommands.

Runs in the CLI process. The Ray launcher and example configs live here too.
"""
